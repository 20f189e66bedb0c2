"""The grading pattern (llmedu.checks.core.Grader) and the lesson-00 graders (llmedu.checks.hardware).

A grader is only useful if it fails the wrong answers with a message that points at the mistake,
so most cases here are wrong learner functions and the message each one must produce.
"""

import math

import pytest
import torch

from llmedu.checks import hardware as checks
from llmedu.checks.core import Grader


def grade_softmax(fn):
    """A grader written the way lessons write them, against torch.softmax."""
    g = Grader("check_softmax", verbose=False)
    for shape in [(3,), (2, 5), (4, 3, 7)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
        g.compare(f"x of shape {shape}", g.call(fn, x), torch.softmax(x, -1), atol=1e-6)
    return g.result()


def test_a_correct_function_passes():
    res = grade_softmax(lambda x: x.exp() / x.exp().sum(-1, keepdim=True))
    assert res and res.passed and res.cases == 3 and res.failure is None
    assert str(res).startswith("PASS check_softmax: all 3 cases")


def test_a_wrong_function_fails_at_the_first_mismatch():
    res = grade_softmax(lambda x: x.exp())  # forgot to normalise
    assert not res and res.cases == 1  # stops at the first case
    assert "x of shape (3,)" in res.failure and "values differ: first at index (0,)" in res.failure
    assert "tolerance atol=1e-06" in res.failure
    assert str(res).startswith("FAIL check_softmax: case 1")


def test_a_mistake_only_in_later_cases_is_reported_there():
    res = grade_softmax(lambda x: torch.softmax(x, -1) if x.ndim < 3 else torch.softmax(x, 0))
    assert not res and res.cases == 3 and "x of shape (4, 3, 7)" in res.failure


def test_a_function_that_raises_fails_with_the_exception_named():
    def broken(x):
        raise ZeroDivisionError("oops")

    res = grade_softmax(broken)
    assert not res and "your function raised ZeroDivisionError: oops" in res.failure
    assert "(in broken, line" in res.failure  # where it was raised


def test_a_shape_mismatch_is_reported_as_such():
    res = grade_softmax(lambda x: torch.softmax(x, -1).flatten()[:1])
    assert not res and "x of shape (3,): shape is (1,), expected (3,)" in res.failure


def test_a_non_tensor_answer_is_reported():
    res = grade_softmax(lambda x: x.tolist())
    assert not res and "expected a tensor/array, got list" in res.failure


def test_nan_is_named():
    res = grade_softmax(lambda x: torch.full_like(x, float("nan")))
    assert not res and "NaN at index (0,)" in res.failure


def test_expect_and_numbers_and_a_grader_without_cases():
    g = Grader("numbers", verbose=False)
    assert g.compare("one third", 1 / 3, 0.333, rtol=1e-2)
    assert not g.expect("positive", False, "got -1")
    assert g.result().failure == "positive: got -1"
    empty = Grader("empty", verbose=False).result()
    assert not empty and "ran no case" in empty.failure


def test_result_is_printed(capsys):
    Grader("loud").result()
    assert "FAIL loud" in capsys.readouterr().out


# -- the lesson-00 graders: right and wrong answers ------------------------------------------------
def test_check_matmul_flops(capsys):
    assert checks.check_matmul_flops(lambda m, k, n: 2 * m * k * n)
    assert "PASS check_matmul_flops" in capsys.readouterr().out
    res = checks.check_matmul_flops(lambda m, k, n: m * k * n)
    assert not res and "counts multiply-adds; each is 2 FLOPs" in res.failure
    res = checks.check_matmul_flops(lambda m, k, n: m * n * (2 * k - 1))  # exact count, not the convention
    assert not res and "(2x3)@(3x4): got 40, the exact count m*n*(2k-1)" in res.failure
    res = checks.check_matmul_flops(lambda m, k, n: 2 * m * k * k)  # used the wrong dimension
    assert not res and "(2x3)@(3x4): got 36, expected 48" in res.failure


def test_check_arithmetic_intensity():
    assert checks.check_arithmetic_intensity(lambda m, k, n, b: 2 * m * k * n / ((m * k + k * n + m * n) * b))
    res = checks.check_arithmetic_intensity(lambda m, k, n, b: 2 * m * k * n / ((m * k + k * n) * b))  # forgot C
    expected = "(2x3)@(3x4) with 2-byte elements: got 1.3333333333333333, expected 0.9230769230769231"
    assert not res and expected in res.failure
    res = checks.check_arithmetic_intensity(lambda m, k, n, b: 2 * m * k * n / (m * k + k * n + m * n))  # no bytes
    assert not res and "2-byte elements" in res.failure


def test_check_attainable_flops():
    assert checks.check_attainable_flops(lambda i, peak, bw: min(peak, i * bw))
    res = checks.check_attainable_flops(lambda i, peak, bw: i * bw)  # no ceiling
    assert not res and "intensity 295.0" not in res.failure and "intensity 1365.3" in res.failure
    res = checks.check_attainable_flops(lambda i, peak, bw: max(peak, i * bw))
    assert not res and "intensity 0.25" in res.failure


@pytest.mark.parametrize(
    "grader", [checks.check_matmul_flops, checks.check_arithmetic_intensity, checks.check_attainable_flops]
)
def test_hardware_graders_survive_an_unfinished_exercise(grader):
    def todo(*args):
        raise NotImplementedError("your code here")

    res = grader(todo)
    assert not res and "raised NotImplementedError: your code here" in res.failure


def _batch_closed_form(k, n, peak, bw, s):  # 2bkn / (s (bk + kn + bn)) >= peak / bw, solved for b
    ridge = peak / bw
    return math.ceil(ridge * s * k * n / (2 * k * n - ridge * s * (k + n)))


def test_check_compute_bound_batch():
    assert checks.check_compute_bound_batch(_batch_closed_form)
    res = checks.check_compute_bound_batch(lambda k, n, peak, bw, s: math.ceil(peak / bw))  # the ridge point
    assert not res and "the ridge point itself" in res.failure
    res = checks.check_compute_bound_batch(lambda k, n, peak, bw, s: math.ceil(peak / bw * s / 2))  # counts only b
    assert not res


def test_check_elementwise_intensity():
    assert checks.check_elementwise_intensity(lambda n, s, wa: (n - 1) / ((n + 1 + wa) * s))
    res = checks.check_elementwise_intensity(lambda n, s, wa: (n - 1) / (n * s))  # forgot the write
    assert not res and "2 inputs" in res.failure
    res = checks.check_elementwise_intensity(lambda n, s, wa: (n - 1) / ((n + 1) * s))  # ignores write-allocate
    assert not res and "write-allocate True" in res.failure
