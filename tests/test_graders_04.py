"""Lesson 04's graders: the sliding-window causal mask and the inverse of the decoding bytes model. A right answer
passes; plausible wrong values and right values computed the wrong way (the library's mask, a search that stops
early) fail."""

import math
import time

import pytest
import torch

from llmedu.checks.attention_variants import TIME_LIMIT_S, check_decode_batch, check_window_mask, decode_speedup
from llmedu.nn.attention import causal_mask


def mask_by_positions(t_q, t_k, window):
    pos = torch.arange(t_q)[:, None] + (t_k - t_q)  # (t_q, 1): each query's position among the keys
    j = torch.arange(t_k)[None, :]  # (1, t_k)
    return (j <= pos) & (j > pos - window)


def test_window_mask_right_answers_pass():
    assert check_window_mask(mask_by_positions)
    # a band of tril/triu is a right method too
    assert check_window_mask(
        lambda q, k, w: (
            torch.ones(q, k, dtype=torch.bool).tril(k - q) & torch.ones(q, k, dtype=torch.bool).triu(k - q - w + 1)
        )
    )


def test_window_mask_wrong_values_fail(capsys):
    assert not check_window_mask(lambda q, k, w: mask_by_positions(q, k, k + q))  # the plain causal mask, no window
    assert "plain causal mask" in capsys.readouterr().out
    assert not check_window_mask(lambda q, k, w: mask_by_positions(q, k, w + 1))  # the window off by one
    assert "own key" in capsys.readouterr().out
    top_left = lambda q, k, w: (
        (torch.arange(k)[None] <= torch.arange(q)[:, None])
        & (  # noqa: E731
            torch.arange(k)[None] > torch.arange(q)[:, None] - w
        )
    )
    assert not check_window_mask(top_left)
    assert "top-left" in capsys.readouterr().out
    assert not check_window_mask(lambda q, k, w: mask_by_positions(q, k, w).int())  # not a bool tensor


def test_window_mask_library_call_or_copied_function_fails(capsys):
    # the right value, but the causal part asked of the library
    def via_library(t_q, t_k, window):
        return causal_mask(t_q, t_k) & mask_by_positions(t_q, t_k, window)

    assert all(torch.equal(via_library(*c), mask_by_positions(*c)) for c in [(3, 7, 4), (5, 5, 8)])
    assert not check_window_mask(via_library)
    assert "causal_mask" in capsys.readouterr().out
    # the function printed in the lesson, copied: no window
    assert not check_window_mask(lambda q, k, w: causal_mask(q, k))
    copied = lambda q, k, w: torch.arange(k)[None, :] <= torch.arange(q)[:, None] + (k - q)  # noqa: E731
    assert not check_window_mask(copied)


def closed_form(w, c, heads, kv_heads, target):
    r = kv_heads / heads
    if target * r >= 1:
        return None
    return max(1, math.ceil((target - 1) * w / (c * (1 - target * r))))


def search(w, c, heads, kv_heads, target, cap=None, step=lambda b: b + 1, strict=False):
    if target * kv_heads / heads >= 1:
        return None
    b = 1
    while cap is None or b <= cap:
        s = decode_speedup(w, c, heads, kv_heads, b)
        if s > target or (not strict and s >= target):
            return b
        b = step(b)
    return None


def bisection(w, c, heads, kv_heads, target):
    if target * kv_heads / heads >= 1:
        return None
    hi = 1
    while decode_speedup(w, c, heads, kv_heads, hi) < target:  # doubling until the target is reached ...
        hi *= 2
    lo = 1
    while lo < hi:  # ... then halving the interval: about 60 steps for a batch of a billion
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if decode_speedup(w, c, heads, kv_heads, mid) >= target else (mid + 1, hi)
    return lo


def test_right_answers_pass():
    assert check_decode_batch(closed_form)
    assert check_decode_batch(bisection)  # a search that halves its interval is a right method too


def test_plausible_wrong_values_fail():
    # rounding down, or returning the real-valued root
    assert not check_decode_batch(lambda *a: None if closed_form(*a) is None else max(1, closed_form(*a) - 1))
    assert not check_decode_batch(lambda w, c, h, k, s: None if s * k / h >= 1 else (s - 1) * w / (c * (1 - s * k / h)))
    # the cache ratio alone, as if the weights cost nothing: batch 1 always reaches any target below H/H_kv
    assert not check_decode_batch(lambda w, c, h, k, s: 1 if s < h / k else None)
    # an impossible target answered with a number instead of None
    assert not check_decode_batch(lambda *a: closed_form(*a) or math.inf)
    # "faster than" read as strictly greater: the exact case (speed-up exactly 2 at batch 6) gives 7
    assert not check_decode_batch(lambda *a: search(*a, strict=True))


def test_right_values_computed_the_wrong_way_fail():
    # a search capped at 256 sequences answers the first four cases right and gives up on the fifth (444)
    assert not check_decode_batch(lambda *a: search(*a, cap=256))
    # a search over powers of two finds a batch that reaches the target, not the smallest one
    assert not check_decode_batch(lambda *a: search(*a, step=lambda b: 2 * b))


def test_capped_search_fails_on_the_billion_case(capsys):
    # one batch at a time with ">=", up to a cap: right on every case whose answer is below the cap (444 at most),
    # but the last case's answer is 1,333,333,334. A cap of a million passed before that case existed; now it
    # fails, by the time limit or by giving up; a smaller cap gives up within the limit and is told why
    assert not check_decode_batch(lambda *a: search(*a, cap=10**6))
    assert "case 6 of the check" in capsys.readouterr().out
    assert not check_decode_batch(lambda *a: search(*a, cap=5000))
    out = capsys.readouterr().out
    assert "case 6 of the check" in out and "got None, but batch 1,333,333,334" in out and "cap" in out


@pytest.mark.alone  # a wall-clock bound
def test_search_one_batch_at_a_time_runs_out_of_time(capsys):
    # uncapped, the same search would need hours; the grader stops it at its time limit, even inside an answer
    # that catches every Exception in its loop
    def patient(w, c, heads, kv_heads, target):
        if target * kv_heads / heads >= 1:
            return None
        b = 1
        while True:
            try:
                if decode_speedup(w, c, heads, kv_heads, b) >= target:
                    return b
            except Exception:
                pass
            b += 1

    start = time.perf_counter()
    assert not check_decode_batch(patient)
    assert time.perf_counter() - start < 10 * TIME_LIMIT_S
    assert "time limit" in capsys.readouterr().out
