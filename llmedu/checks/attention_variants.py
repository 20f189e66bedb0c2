"""Graders for lesson 04 (attention variants) that ask for more than the formula on the page.

    check_window_mask(fn)    fn(t_q, t_k, window) -> (t_q, t_k) bool: the causal mask of the lesson (the last
                             query is the last key's position) restricted to a sliding window, each query seeing
                             only the ``window`` most recent keys up to and including its own position (Mistral 7B,
                             sec. 2; Longformer's local attention). Fails the plain causal mask, a window of
                             ``window + 1`` keys, a top-left alignment, and any call into ``llmedu.nn``
    check_decode_batch(fn)   fn(weight_bytes, mha_cache_bytes, n_heads, n_kv_heads, target) -> the smallest
                             batch (an int) at which a memory-bound decoding step of the model with
                             ``n_kv_heads`` key/value heads is ``target`` times faster than with MHA, or None
                             when no batch reaches it; ``mha_cache_bytes`` is the MHA cache of ONE sequence

The lesson gives the speed-up of a batch, (W + bC) / (W + bC r) with r = n_kv_heads / n_heads; the exercise is
its inverse. A search over b that stops early (a cap, or powers of two) and a strict ">" fail, as does any
answer for a target at or above the cache ratio 1 / r, which the speed-up approaches but never reaches. One case's
answer is over a billion sequences and each case runs under a time limit (``TIME_LIMIT_S``, checked at every Python
line the answer executes), so a search that tries one batch at a time fails too, capped or not; a formula or a
bisection answers in microseconds.
"""

from __future__ import annotations

import math
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch

from .core import CheckResult, Grader, call_watching

__all__ = ["check_window_mask", "check_decode_batch", "decode_speedup", "TIME_LIMIT_S"]

TIME_LIMIT_S = 2.0  # seconds per case of check_decode_batch: a formula or a bisection needs far less than 0.01

_NN = Path(__file__).resolve().parent.parent / "nn"  # llmedu/nn/


def window_mask(t_q: int, t_k: int, window: int, shift: int | None = None) -> torch.Tensor:
    """(t_q, t_k) bool: query i sits at position p = i + shift (bottom-right: shift = t_k - t_q) and sees the keys
    j with p - window < j <= p."""
    p = torch.arange(t_q)[:, None] + (t_k - t_q if shift is None else shift)  # (t_q, 1)
    j = torch.arange(t_k)[None, :]  # (1, t_k)
    return (j <= p) & (j > p - window)


_MASK_CASES = ((4, 4, 2), (1, 6, 3), (3, 7, 4), (2, 9, 3), (5, 5, 8), (6, 6, 1))


def check_window_mask(fn) -> CheckResult:
    g = Grader("check_window_mask")
    for t_q, t_k, w in _MASK_CASES:
        name = f"{t_q} queries, {t_k} keys, window {w}"
        expected = window_mask(t_q, t_k, w)
        got, called = call_watching(g, fn, (t_q, t_k, w), _NN)
        if called is not None:
            g.expect(name, False, f"your function calls the library's {called}: build the mask from positions yourself")
            continue
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or tuple(got.shape) != (t_q, t_k):
            g.expect(name, False, f"got {got!r}: return a bool tensor of shape ({t_q}, {t_k})")
            continue
        hints = [
            (window_mask(t_q, t_k, t_k + t_q), "that is the plain causal mask: each query sees only `window` keys"),
            (window_mask(t_q, t_k, w + 1), f"each query sees {w + 1} keys: the window counts the query's own key"),
            (window_mask(t_q, t_k, w, shift=0), "aligned top-left: the last query sits at the last key's position"),
        ]
        for wrong, why in hints:
            if not torch.equal(wrong, expected) and torch.equal(got, wrong):
                g.expect(name, False, why)
                break
        g.compare(name, got, expected)
    return g.result()


def decode_speedup(weight_bytes, mha_cache_bytes, n_heads, n_kv_heads, batch) -> float:
    """The bytes model of lesson 04: (W + bC) / (W + bC H_kv/H)."""
    cache = batch * mha_cache_bytes
    return (weight_bytes + cache) / (weight_bytes + cache * n_kv_heads / n_heads)


def _smallest_batch(weight_bytes, mha_cache_bytes, n_heads, n_kv_heads, target) -> int | None:
    """Exact in rationals: b >= (s - 1) W / (C (1 - s r)), for s r < 1."""
    w, c, s, r = Fraction(weight_bytes), Fraction(mha_cache_bytes), Fraction(target), Fraction(n_kv_heads, n_heads)
    if s * r >= 1:
        return None
    return max(1, math.ceil((s - 1) * w / (c * (1 - s * r))))


_GB7, _CACHE7 = 2 * 6_738_415_616, 2 * 32 * 32 * 128 * 4096 * 2  # Llama-2 7B in fp16; its MHA cache, 4096 tokens
_CACHE70 = 2 * 80 * 64 * 128 * 4096 * 2  # a 70B shape with 64 key/value heads, 4096 tokens, fp16
CASES = [
    ("Llama-2 7B, 4096-token sequences, GQA-8, twice as fast", (_GB7, _CACHE7, 32, 8, 2)),
    ("a 70B shape, 4096-token sequences, GQA-8, three times as fast", (140e9, _CACHE70, 64, 8, 3)),
    ("3 GB of weights, 1 GB of cache per sequence, MQA of 4 heads, twice as fast", (3e9, 1e9, 4, 1, 2)),
    ("Llama-2 7B, GQA-8 (cache 4x smaller), four times as fast", (_GB7, _CACHE7, 32, 8, 4)),
    ("Llama-2 7B, 128-token sequences, MQA, three times as fast", (_GB7, _CACHE7 // 32, 32, 1, 3)),
    # (2 - 1) W / (C (1 - 2/8)) = 1e9 / 0.75: the smallest batch is 1,333,333,334, too many to try one at a time
    ("1 TB of weights, 1 kB of cache per sequence, MQA of 8 heads, twice as fast", (1e12, 1e3, 8, 1, 2)),
]


class _TooSlow(BaseException):  # not an Exception: an answer's own `except Exception` does not swallow it
    """Raised inside an answer that runs past its time limit."""


def _call_timed(g: Grader, fn, args: tuple, seconds: float):
    """``g.call(fn, *args)``, stopped once it has run ``seconds`` (the clock is read at every Python line the
    answer executes); returns ``_TooSlow`` then."""
    deadline = time.perf_counter() + seconds

    def tracer(frame, event, arg):
        if time.perf_counter() > deadline:
            raise _TooSlow
        return tracer

    def timed(*a):  # this frame starts before the tracer: its `finally` runs untraced
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            return fn(*a)
        finally:
            sys.settrace(previous)

    try:
        return g.call(timed, *args)
    except _TooSlow:
        return _TooSlow


def check_decode_batch(fn) -> CheckResult:
    g = Grader("check_decode_batch")
    for name, args in CASES:
        weights, cache, heads, kv_heads, target = args
        expected = _smallest_batch(*args)
        got = _call_timed(g, fn, args, TIME_LIMIT_S)
        if got is _TooSlow:
            g.expect(
                name,
                False,
                f"your function ran past the time limit of {TIME_LIMIT_S:g} s: the smallest batch here is over a "
                f"billion, too many to try one at a time; solve the inequality for b (or search by bisection)",
            )
            continue
        if expected is None:
            g.expect(
                name,
                got is None,
                f"got {got!r}, expected None: the speed-up (W + bC) / (W + bC r) grows with b towards the cache "
                f"ratio 1/r = {heads // kv_heads} but never reaches it, so no batch is {target}x faster",
            )
            continue
        if got is None:
            s = decode_speedup(weights, cache, heads, kv_heads, expected)
            g.expect(
                name,
                False,
                f"got None, but batch {expected:,} is {s:.4f}x faster (>= {target}): below the cache ratio 1/r = "
                f"{heads // kv_heads} some batch always reaches the target, so a search that stops at a cap gives up "
                f"too early",
            )
            continue
        if isinstance(got, float) and got.is_integer():
            got = int(got)
        if not isinstance(got, int) or isinstance(got, bool):
            g.expect(name, False, f"got {got!r}: a batch is a whole number of sequences (an int)")
            continue
        if 1 <= got < expected:
            s = decode_speedup(weights, cache, heads, kv_heads, got)
            fix = "round the batch up" if got == expected - 1 else "the weights are read once per step, whatever b"
            g.expect(name, False, f"at batch {got} the speed-up is {s:.4f}, below {target}: {fix}")
        elif got > expected:
            s = decode_speedup(weights, cache, heads, kv_heads, expected)
            g.expect(
                name,
                False,
                f"got {got}, but batch {expected} already gives {s:.4f}x (>= {target}): the smallest batch is wanted",
            )
        g.compare(name, got, expected)
    return g.result()
