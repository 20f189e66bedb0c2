"""Lesson 04's new grader: the inverse of the decoding bytes model. A right answer passes; plausible wrong values
and right values computed the wrong way (a search that stops early) fail."""

import math

from llmedu.checks.attention_variants import check_decode_batch, decode_speedup


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


def test_right_answers_pass():
    assert check_decode_batch(closed_form)
    assert check_decode_batch(search)  # an unbounded search is a right method too


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
