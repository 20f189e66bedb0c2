"""The lesson-07 graders pass correct answers and fail the plausible wrong ones."""

import math

import torch

from llmedu.checks.precision import (
    check_adam8bit_state_bytes,
    check_additions_to_stall,
    check_float_format,
    check_stall_point,
)
from llmedu.train.accumulation import running_sum, stall_point

SIGNIFICANT = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


# -- stall point ------------------------------------------------------------------------------------
def stall(value, dtype):
    v = torch.tensor(value, dtype=dtype).item()
    k, p = math.floor(math.log2(v)), SIGNIFICANT[dtype]
    return 2.0 ** (k + p) if v == 2.0**k else 2.0 ** (k + p + 1)


def test_stall_reference_is_where_a_real_running_sum_stops():
    for value, dtype in [
        (0.01, torch.bfloat16),
        (0.3, torch.bfloat16),
        (0.01, torch.float16),
        (2.0**-7, torch.bfloat16),
    ]:
        s = stall_point(value, dtype)
        v = torch.tensor(value, dtype=dtype).item()
        n = int(s / v) + 50  # past the stall
        assert running_sum(value, n, dtype, value_dtype=dtype) == s


def test_stall_point_passes_and_fails():
    assert check_stall_point(stall)
    assert not check_stall_point(lambda v, d: 2.0 ** (math.floor(math.log2(v)) + SIGNIFICANT[d]))  # half-ulp missed
    assert not check_stall_point(lambda v, d: 2.0 ** (math.floor(math.log2(v)) + SIGNIFICANT[d] + 1))  # ties missed
    assert not check_stall_point(lambda v, d: v * 2.0 ** SIGNIFICANT[d])  # "v times 2^p"
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
    result = check_stall_point(lambda v, d: 2.0 ** (math.floor(math.log2(v)) + mantissa_bits[d] + 1))
    assert not result and "value=0.01, dtype=bf16" in result.failure  # forgot the implicit bit


# -- additions before the stall ---------------------------------------------------------------------
def additions_by_simulation(value, dtype):
    """A learner's loop: add until the sum stops changing."""
    v, total, n = torch.tensor(value, dtype=dtype), torch.zeros((), dtype=dtype), 0
    while total + v != total:
        total, n = total + v, n + 1
    return n


def additions_by_binades(value, dtype):
    """The reasoning of the lesson in Python floats: each sum s + v is rounded to the grid of its binade."""
    p = SIGNIFICANT[dtype]
    v = torch.tensor(value, dtype=dtype).item()
    s, n = 0.0, 0
    while True:
        exact = s + v  # exact in float64 for these formats
        ulp = 2.0 ** (math.floor(math.log2(exact)) - p + 1)
        new = round(exact / ulp) * ulp  # Python's round: half to even
        if new == s:
            return n
        s, n = new, n + 1


def test_additions_to_stall_passes_and_fails():
    assert not check_additions_to_stall(additions_by_simulation)  # the right count, but by running the sum
    assert check_additions_to_stall(additions_by_binades)
    naive = lambda value, d: math.ceil(stall_point(value, d) / torch.tensor(value, dtype=d).item())
    result = check_additions_to_stall(naive)  # "stall / v": ignores the rounding of every addition
    assert not result and "value=0.01, dtype=bf16" in result.failure
    assert not check_additions_to_stall(lambda value, d: round(stall_point(value, d) / value))  # unrounded value too
    assert not check_additions_to_stall(lambda value, d: additions_by_simulation(value, d) + 1)  # the no-op counted
    assert not check_additions_to_stall(lambda value, d: additions_by_binades(value, torch.bfloat16))  # p ignored


def test_additions_to_stall_reach_the_stall_point():
    for value, dtype in [(0.01, torch.bfloat16), (1e-3, torch.bfloat16), (0.01, torch.float16), (3.0, torch.float16)]:
        n = additions_by_simulation(value, dtype)
        assert running_sum(value, n, dtype, value_dtype=dtype) == stall_point(value, dtype)
        assert running_sum(value, n - 1, dtype, value_dtype=dtype) < stall_point(value, dtype)


# -- number formats ----------------------------------------------------------------------------------
def fmt(e, m, ieee):
    bias = 2 ** (e - 1) - 1
    if ieee:
        top, mant = 2**e - 2 - bias, 2 - 2.0**-m
    else:
        top, mant = 2**e - 1 - bias, 2 - 2.0 ** (1 - m)
    return 2.0**top * mant, 2.0 ** (1 - bias), 2.0 ** (1 - bias - m)


def test_float_format_passes_and_fails():
    assert check_float_format(fmt)
    result = check_float_format(lambda e, m, ieee: fmt(e, m, True))  # E4M3 read as IEEE: max 240
    assert not result and "E4M3" in result.failure
    assert not check_float_format(
        lambda e, m, ieee: (fmt(e, m, ieee)[0], fmt(e, m, ieee)[1], 2.0 ** (-(2 ** (e - 1) - 1) - m))
    )
    assert not check_float_format(lambda e, m, ieee: fmt(e, m, ieee)[:2])  # wrong arity
    assert not check_float_format(lambda e, m, ieee: None)


# -- 8-bit state bytes -------------------------------------------------------------------------------
def adam8bit_bytes(numel, block_size, min_8bit_size):
    step = 4  # the step counter, a float32 scalar tensor
    if numel < min_8bit_size:
        return 8 * numel + step
    return 2 * numel + 2 * 4 * math.ceil(numel / block_size) + step


def test_adam8bit_state_bytes_passes_and_fails():
    assert check_adam8bit_state_bytes(adam8bit_bytes)
    assert not check_adam8bit_state_bytes(lambda n, b, t: 2 * n)  # the absmax and the step forgotten
    assert not check_adam8bit_state_bytes(lambda n, b, t: adam8bit_bytes(n, b, 0))  # small tensors quantized too
    assert not check_adam8bit_state_bytes(lambda n, b, t: adam8bit_bytes(n, b, t) - 4)  # the step counter forgotten
    no_ceil = lambda n, b, t: 8 * n + 4 if n < t else int(2 * n + 8 * n / b + 4)
    assert not check_adam8bit_state_bytes(no_ceil)  # partial last block
    assert not check_adam8bit_state_bytes(lambda n, b, t: adam8bit_bytes(n, b, t + 1))  # threshold off by one
