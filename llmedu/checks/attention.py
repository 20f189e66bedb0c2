"""Graders for lessons 15 (FlashAttention) and 16 (PagedAttention).

check_online_logsumexp(fn)   fn(x, block) -> logsumexp over the last dim, reading `block` columns at a time
check_tiled_attention(fn)    fn(q, k, v, block) -> softmax(q k^T / sqrt(D)) v, tile by tile
check_slot_of(fn)            fn(position, table, block_size) -> (block, offset) of a token in a paged cache
check_gather_kv(fn)          fn(pool, block_tables, length) -> (B, H_kv, length, D) keys read through the tables
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..inference.paged_attention import gather_kv
from .core import Grader

__all__ = ["check_online_logsumexp", "check_tiled_attention", "check_slot_of", "check_gather_kv"]


def check_online_logsumexp(fn):
    """``fn(x, block)``: logsumexp of x (..., N) over the last dim, one pass over blocks of columns."""
    g = Grader("check_online_logsumexp")
    gen = torch.Generator().manual_seed(0)
    cases = [
        ("small values", torch.randn(3, 10, generator=gen), 4),
        ("one block", torch.randn(2, 7, generator=gen), 16),
        ("values near 1000 (exp overflows without the running max)", 1000 + torch.randn(4, 33, generator=gen), 8),
        (
            "rows with -inf entries",
            torch.randn(2, 12, generator=gen).masked_fill(torch.arange(12) % 3 == 0, -math.inf),
            5,
        ),
    ]
    for name, x, block in cases:
        got = g.call(fn, x.clone(), block)
        g.compare(
            f"{name}, x of shape {tuple(x.shape)}, block {block}", got, torch.logsumexp(x, dim=-1), atol=1e-4, rtol=1e-6
        )
    return g.result()


def check_tiled_attention(fn):
    """``fn(q, k, v, block)``: non-causal attention, q (B, H, Tq, D), k and v (B, H, Tk, D)."""
    g = Grader("check_tiled_attention")
    gen = torch.Generator().manual_seed(0)
    for B, H, Tq, Tk, D, block in [
        (1, 1, 8, 8, 4, 4),
        (2, 3, 13, 21, 8, 8),
        (1, 2, 5, 40, 16, 16),
        (1, 1, 3, 3, 4, 64),
    ]:
        q, k, v = (torch.randn(B, H, T, D, generator=gen) for T in (Tq, Tk, Tk))
        k = k * 4  # large scores: a missing rescaling by exp(m_old - m_new) shows up
        got = g.call(fn, q, k, v, block)
        g.compare(f"Tq={Tq}, Tk={Tk}, D={D}, block={block}", got, F.scaled_dot_product_attention(q, k, v), atol=1e-5)
    return g.result()


def _slot_of(position: int, table: list[int], block_size: int) -> tuple[int, int]:
    return table[position // block_size], position % block_size


def check_slot_of(fn):
    """``fn(position, table, block_size)``: the (block, offset) where token ``position`` is stored."""
    g = Grader("check_slot_of")
    table = [7, 2, 9, 0, 4]
    for block_size in (1, 4, 16):
        last = len(table) * block_size - 1
        for position in sorted({0, 1, block_size - 1, block_size, 2 * block_size + 1, last}):
            got = g.call(fn, position, list(table), block_size)
            got = tuple(got) if isinstance(got, list) else got
            g.compare(
                f"position {position}, table {table}, block_size {block_size}",
                got,
                _slot_of(position, table, block_size),
            )
    return g.result()


def check_gather_kv(fn):
    """``fn(pool, block_tables, length)``: pool (N, H_kv, S, D), tables (B, n) -> (B, H_kv, length, D)."""
    g = Grader("check_gather_kv")
    gen = torch.Generator().manual_seed(0)
    for N, H, S, D, tables, length in [
        (6, 1, 4, 2, [[3, 1]], 7),
        (8, 2, 4, 3, [[5, 0, 7], [2, 6, 1]], 10),
        (4, 2, 2, 2, [[1, 1], [3, 0]], 4),
    ]:
        pool = torch.randn(N, H, S, D, generator=gen)
        block_tables = torch.tensor(tables)
        got = g.call(fn, pool.clone(), block_tables.clone(), length)
        g.compare(f"tables {tables}, block_size {S}, length {length}", got, gather_kv(pool, block_tables, length))
    return g.result()
