"""Graders for lesson 20 (long sequences: sequence parallelism and ring attention).

check_kv_traffic(fn)      fn(b, heads, kv_heads, t, d, n, bytes_per) -> dict of the bytes one rank sends and the
                          K/V bytes it holds beyond its own block, ring against all-gather, with grouped-query
                          attention (Llama 3's reason to all-gather K/V)
check_hiding_block(fn)    fn(heads, kv_heads, head_dim, bytes_per, flops, alpha, beta) -> the fewest tokens per rank
                          for which a ring step's compute hides its K/V transfer (Liu et al. 2023, sec. 3), graded
                          by the overlap model ``step_model``
check_striped_pairs(fn)   fn(t, n) -> [rank][step] the causal (query, key) pairs each rank scores at each ring step
                          under the striped layout (Brandon et al. 2023)

Each asks for a count worked out by hand, so each fails an answer that calls llmedu (``ring_bytes_sent``,
``work_per_rank``, ``step_model``, ...): the course's call watching (``core.call_watching``). All run in this
process in well under a second.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from pathlib import Path

from ..parallel.long_sequence_study import step_model
from .core import CheckResult, Grader, call_watching

__all__ = ["check_kv_traffic", "check_hiding_block", "check_striped_pairs"]
__all__ += ["kv_traffic", "hiding_block", "striped_pairs"]

_LIBRARY = Path(__file__).resolve().parents[1]  # llmedu/
_GRADING = _LIBRARY / "checks" / "core.py"  # the Grader itself, which runs the learner's function


def _by_hand(g: Grader, fn: Callable, args: tuple):
    """``fn(*args)``, failing the case when it calls llmedu (the Grader aside): work it out yourself."""
    got, called = call_watching(g, fn, args, _LIBRARY, exempt=lambda code: code.co_filename == str(_GRADING))
    g.expect("worked out by hand", called is None, f"your function calls llmedu's {called}: count it yourself")
    return got


# -- 1. ring or all-gather, with grouped-query attention ---------------------------------------------------------
def kv_traffic(b: int, heads: int, kv_heads: int, t: int, d: int, n: int, bytes_per: int) -> dict[str, int]:
    """The reference. One rank holds t / n tokens; its K/V block is 2 b kv_heads (t/n) d values (Q's heads do not
    travel). Ring: n - 1 sending steps of one block; beyond its own, it holds the visiting block and the one
    arriving (at n = 2 the only other block: it never holds two). All-gather (a ring all-gather): each rank's block
    passes on n - 1 times, the same bytes; it holds the n - 1 other blocks at once."""
    block = 2 * b * kv_heads * (t // n) * d * bytes_per
    return {
        "ring_sent": (n - 1) * block,
        "gather_sent": (n - 1) * block,
        "ring_held": min(2, n - 1) * block,
        "gather_held": (n - 1) * block,
    }


def check_kv_traffic(fn: Callable) -> CheckResult:
    """``fn(b, heads, kv_heads, t, d, n, bytes_per)`` -> {"ring_sent", "gather_sent", "ring_held", "gather_held"}:
    bytes ONE rank sends in one forward, and the most K/V bytes of OTHER ranks it holds at once, for a ring and
    for an all-gather of K and V (Q never travels). Counted by hand: calling llmedu fails."""
    g = Grader("check_kv_traffic")
    cases = [
        (1, 128, 8, 131072, 128, 16, 2),  # Llama 3 405B's heads, 128K tokens over 16 ranks, bf16
        (2, 32, 32, 8192, 64, 4, 4),  # multi-head: K/V as many heads as Q
        (1, 32, 8, 32768, 128, 2, 2),  # two ranks: the ring never holds two other blocks
        (4, 16, 2, 4096, 64, 3, 4),
    ]
    for args in cases:
        got = _by_hand(g, fn, args)
        g.compare(f"b, heads, kv_heads, t, d, n, bytes = {args}", got, kv_traffic(*args))
    return g.result()


# -- 2. the fewest tokens per rank that hide the transfer --------------------------------------------------------
def _step(c: int, heads, kv_heads, head_dim, bytes_per, flops, alpha, beta) -> tuple[float, float]:
    """(compute, transfer) seconds of one full (non-causal) ring step with c tokens per rank, batch 1."""
    compute = 4 * c * c * head_dim * heads / flops  # Q K^T and P V: 2 c^2 D multiply-adds per head, 2 FLOPs each
    transfer = alpha + 2 * c * kv_heads * head_dim * bytes_per / beta  # the K and V block, one message
    return compute, transfer


def hiding_block(heads: int, kv_heads: int, head_dim: int, bytes_per: int, flops: float, alpha: float, beta: float):
    """The reference: the smallest c >= 1 whose overlapped step (``step_model``) is its compute alone."""
    a = 4 * head_dim * heads / flops
    bb = 2 * kv_heads * head_dim * bytes_per / beta
    args = (heads, kv_heads, head_dim, bytes_per, flops, alpha, beta)

    def hidden(c: int) -> bool:  # the overlapped step is the compute alone
        compute, transfer = _step(c, *args)
        return step_model(compute, transfer, overlap=True) == compute

    c = max(1, math.floor((bb + math.sqrt(bb * bb + 4 * a * alpha)) / (2 * a)))  # the root of a c^2 = bb c + alpha
    while c > 1 and hidden(c - 1):
        c -= 1
    while not hidden(c):
        c += 1
    return c


def check_hiding_block(fn: Callable) -> CheckResult:
    """``fn(heads, kv_heads, head_dim, bytes_per, flops, alpha, beta)`` -> the fewest tokens c per rank (an int)
    for which one full ring step's compute, 4 c^2 head_dim heads / flops seconds, is at least the transfer of
    its K/V block, alpha + 2 c kv_heads head_dim bytes_per / beta: the overlapped step max(c, C) is the compute.
    Batch 1, forward, no mask. Worked out by hand: calling llmedu fails."""
    g = Grader("check_hiding_block")
    cases = [
        ("H100-class, InfiniBand 50 GB/s, GQA 32/8", (32, 8, 128, 2, 400e12, 5e-6, 50e9)),
        ("the same, NVLink 450 GB/s, alpha 2 us", (32, 8, 128, 2, 400e12, 2e-6, 450e9)),
        ("multi-head 32/32, 45 GB/s, no latency", (32, 32, 128, 2, 400e12, 0.0, 45e9)),
        ("multi-head 16/16 over 12.5 GB/s Ethernet", (16, 16, 64, 2, 300e12, 1e-5, 12.5e9)),
        ("a CPU: 20 GFLOP/s, 1 ms, 3 MB/s, fp32", (4, 4, 64, 4, 20e9, 1e-3, 3e6)),
    ]
    for name, args in cases:
        got = _by_hand(g, fn, args)
        whole = isinstance(got, numbers.Integral) and not isinstance(got, bool)
        if g.expect(f"{name}: a whole number of tokens", whole, f"got {got!r:.60}"):
            g.compare(f"{name}: tokens per rank", got, hiding_block(*args))
    return g.result()


# -- 3. striped layout: each rank's work at each step -----------------------------------------------------------
def striped_pairs(t: int, n: int) -> list[list[int]]:
    """The reference, counted from the mask: rank r holds tokens r, r + n, r + 2n, ...; at step s it scores its
    queries against the keys of rank (r - s) mod n; a query at position i sees keys at positions <= i."""
    rows = []
    for r in range(n):
        queries = range(r, t, n)
        rows.append([sum(1 for i in queries for j in range((r - s) % n, t, n) if j <= i) for s in range(n)])
    return rows


def check_striped_pairs(fn: Callable) -> CheckResult:
    """``fn(t, n)`` -> a list of n lists of n ints: [r][s] the (query, key) pairs rank r scores at ring step s of a
    causal forward over the striped layout. Worked out by hand: calling llmedu fails."""
    g = Grader("check_striped_pairs")
    for t, n in [(8, 2), (12, 3), (32, 4), (64, 8), (40, 5)]:
        got = _by_hand(g, fn, (t, n))
        g.compare(f"t = {t}, n = {n}", got, striped_pairs(t, n))
    return g.result()
