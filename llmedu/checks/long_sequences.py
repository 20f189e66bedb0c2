"""Graders for lesson 20 (long sequences: sequence parallelism and ring attention).

check_sp_activation_bytes(fn)   fn(s, b, h, a, t) -> bytes one rank saves per layer under Megatron-SP (paper's count)
check_zigzag_chunks(fn)         fn(rank, world) -> the chunk indices (of 2N) that rank holds under zig-zag
check_merge_attention(fn)       fn(o1, lse1, o2, lse2) -> (o, lse): two partial attentions combined by their LSE
check_ring_bytes(fn)            fn(b, h, t, d, n, bytes_per) -> bytes one rank sends in one ring-attention forward

All run in this process in well under a second.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..parallel.context_parallel import ring_bytes_sent
from ..parallel.sequence_layout import chunk_ids
from ..parallel.sequence_parallel_attention import paper_block_activation_bytes
from .core import CheckResult, Grader

__all__ = ["check_sp_activation_bytes", "check_zigzag_chunks", "check_merge_attention", "check_ring_bytes"]


def check_sp_activation_bytes(fn) -> CheckResult:
    """``fn(s, b, h, a, t)``: bytes of activations one rank stores for one transformer layer under tensor +
    sequence parallelism over t ranks, 16-bit activations, 1-byte dropout masks (Korthikanti et al. 2022,
    table 2): without SP it is sbh(10 + 24/t + 5as/(ht)); SP splits the 10sbh that TP leaves replicated."""
    g = Grader("check_sp_activation_bytes")
    for s, b, h, a, t in [(2048, 1, 12288, 96, 8), (1024, 4, 256, 8, 2), (8192, 2, 4096, 32, 4), (16, 1, 64, 4, 1)]:
        expected = paper_block_activation_bytes(s, b, h, a, t, "sp")
        got = g.call(fn, s, b, h, a, t)
        g.compare(f"s={s}, b={b}, h={h}, a={a}, t={t}", got, expected, rtol=1e-6)
    return g.result()


def check_zigzag_chunks(fn) -> CheckResult:
    """``fn(rank, world)``: the indices (in order) of the 2N equal chunks rank holds under the zig-zag layout."""
    g = Grader("check_zigzag_chunks")
    for world in (1, 2, 3, 4, 8):
        for rank in range(world):
            got = g.call(fn, rank, world)
            g.compare(
                f"rank {rank} of {world}",
                [int(i) for i in got] if isinstance(got, (list, tuple, range, np.ndarray, torch.Tensor)) else got,
                chunk_ids(rank, world, "zigzag"),
            )
    return g.result()


def check_merge_attention(fn) -> CheckResult:
    """``fn(o1, lse1, o2, lse2)`` -> (o, lse): attention over keys K1 and K2 together, from each block's
    normalised output o_i (..., T, D) and row logsumexp lse_i (..., T). Compared with softmax over all keys."""
    g = Grader("check_merge_attention")
    gen = torch.Generator().manual_seed(0)

    def part(s, v):  # (.., T, k) scores -> normalised output and logsumexp
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)

    cases = [("equal blocks", 6, 6, 1.0), ("unequal blocks", 3, 9, 1.0), ("large scores (exp overflows)", 5, 4, 300.0)]
    for name, k1, k2, scale in cases:
        s = torch.randn(2, 4, 7, k1 + k2, generator=gen, dtype=torch.float64) * scale  # (B, H, T, keys)
        v = torch.randn(2, 4, k1 + k2, 8, generator=gen, dtype=torch.float64)
        o1, l1 = part(s[..., :k1], v[..., :k1, :])
        o2, l2 = part(s[..., k1:], v[..., k1:, :])
        got = g.call(fn, o1, l1, o2, l2)
        if not g.expect(
            f"{name}: a pair (o, lse)", isinstance(got, (tuple, list)) and len(got) == 2, f"got {got!r:.80}"
        ):
            continue
        o_ref, lse_ref = part(s, v)
        g.compare(f"{name}: o", got[0], o_ref, atol=1e-9, rtol=1e-9)
        g.compare(f"{name}: lse", got[1], lse_ref, atol=1e-9, rtol=1e-9)
    # a causal ring: a query that sees no key of block 2 has lse2 = -inf and o2 = 0
    o1, l1 = part(
        torch.randn(1, 1, 3, 4, generator=gen, dtype=torch.float64),
        torch.randn(1, 1, 4, 2, generator=gen, dtype=torch.float64),
    )
    o2, l2 = torch.zeros_like(o1), torch.full_like(l1, -math.inf)
    got = g.call(fn, o1, l1, o2, l2)
    if g.expect("a block with no visible key (lse2 = -inf): a pair", isinstance(got, (tuple, list)) and len(got) == 2):
        g.compare("a block with no visible key (lse2 = -inf): o is block 1's", got[0], o1, atol=1e-12)
    return g.result()


def check_ring_bytes(fn) -> CheckResult:
    """``fn(b, h, t, d, n, bytes_per)``: bytes ONE rank sends during one forward of ring attention over n
    ranks, for q, k, v of (b, h, t, d) on the full sequence (each rank holds t / n tokens)."""
    g = Grader("check_ring_bytes")
    for args in [(1, 1, 8192, 64, 2, 4), (2, 8, 4096, 128, 4, 2), (1, 32, 131072, 128, 16, 2), (4, 2, 64, 8, 1, 4)]:
        g.compare(f"b, h, t, d, n, bytes = {args}", g.call(fn, *args), ring_bytes_sent(*args))
    return g.result()
