"""Graders for lessons 17 (FlashAttention) and 18 (PagedAttention).

check_online_logsumexp(fn)   fn(x, block) -> logsumexp over the last dim, reading `block` columns at a time
check_tiled_attention(fn)    fn(q, k, v, block) -> softmax(q k^T / sqrt(D)) v, tile by tile
check_causal_tiles(fn)       fn(Tq, Tk, block) -> how many (query tile, key tile) pairs a causal kernel computes
check_causal_traffic(fn)     fn(T, D, block, itemsize) -> bytes our causal forward moves to and from HBM (predicted)
check_slot_of(fn)            fn(position, table, block_size) -> (block, offset) of a token in a paged cache
check_gather_kv(fn)          fn(pool, block_tables, length) -> (B, H_kv, length, D) keys read through the tables
check_kv_waste(fn)           fn(lengths, max_len, block_size, bytes_per_token) -> bytes wasted, contiguous and paged
check_fork_tables(fn)        fn(prompt_len, block_size, n_samples) -> block tables after a fork and one append each
check_blocks_needed(fn)      fn(length, n_new, block_size, n_blocks, last_block_shared) -> fresh blocks (find the bug)

The first two grade the method as well as the value (every ATen op the function runs is recorded); they live
in ``tiling.py`` and are imported here, where lesson 17 finds them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..inference.paged_attention import PagedKVCache, gather_kv
from ..kernels import flash_attention
from ..kernels.traffic import counting
from .core import Grader, call_watching
from .tiling import check_online_logsumexp, check_tiled_attention

__all__ = [
    "check_online_logsumexp",
    "check_tiled_attention",
    "check_causal_tiles",
    "check_causal_traffic",
    "check_slot_of",
    "check_gather_kv",
    "check_kv_waste",
    "check_fork_tables",
    "check_blocks_needed",
]

_INFERENCE = Path(__file__).resolve().parent.parent / "inference"  # llmedu/inference/: the paged cache itself


def _causal_tiles(Tq: int, Tk: int, block: int) -> int:
    """Tiles of ``block`` x ``block`` with at least one allowed (query, key) pair; the mask is bottom-right
    aligned (query i sees keys up to i + Tk - Tq), as in the course's models and flash_attention."""
    offset = Tk - Tq
    count = 0
    for q0 in range(0, Tq, block):
        last_query = min(q0 + block, Tq) - 1
        count += sum(1 for k0 in range(0, Tk, block) if k0 <= last_query + offset)
    return count


def check_causal_tiles(fn):
    """``fn(Tq, Tk, block)``: how many tiles a causal FlashAttention computes (the others are skipped)."""
    g = Grader("check_causal_tiles")
    for Tq, Tk, block in [
        (1500, 1500, 128),  # not the T = 1000 drawn in the lesson
        (4096, 4096, 128),
        (300, 300, 64),
        (128, 1024, 128),
        (1, 777, 64),
        (200, 1000, 64),
    ]:
        got = g.call(fn, Tq, Tk, block)
        g.compare(f"Tq={Tq}, Tk={Tk}, block={block}", got, _causal_tiles(Tq, Tk, block))
    return g.result()


def check_causal_traffic(fn):
    """``fn(T, D, block, itemsize)``: the bytes our causal forward (one head, Tq = Tk = T, tiles of ``block``,
    inputs of ``itemsize`` bytes) reads from and writes to HBM, predicted from the loop, not run: the check fails
    a function that runs the kernel (a ``load`` or ``store`` counted while it runs)."""
    g = Grader("check_causal_traffic")
    for T, D, block, itemsize in [(1000, 64, 128, 2), (300, 32, 64, 4), (129, 16, 128, 2), (1, 8, 16, 4)]:
        case = f"T={T}, D={D}, block={block}, {itemsize}-byte inputs"
        with counting() as ran:
            got = g.call(fn, T, D, block, itemsize)
        q = torch.zeros(1, 1, T, D, dtype={2: torch.bfloat16, 4: torch.float32}[itemsize])
        with torch.no_grad(), counting() as counted:  # the answer: the kernel's own count
            flash_attention(q, q, q, causal=True, block_size=block)
        g.compare(case, got, counted.total)
        ran_it = f"it ran the kernel ({ran.total:,} bytes counted): predict the count from the loop instead"
        g.expect(f"{case}: predicted, not run", ran.total == 0, ran_it)
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


def _wasted_bytes(lengths: list[int], max_len: int, block_size: int, bytes_per_token: int) -> tuple[int, int]:
    contiguous = sum(max_len - L for L in lengths) * bytes_per_token
    paged = sum(-(-L // block_size) * block_size - L for L in lengths) * bytes_per_token
    return contiguous, paged


def check_kv_waste(fn):
    """``fn(lengths, max_len, block_size, bytes_per_token)`` -> (bytes wasted by a contiguous cache that
    reserves ``max_len`` slots per sequence, bytes wasted by a paged cache with blocks of ``block_size``)."""
    g = Grader("check_kv_waste")
    for lengths, max_len, block_size, bytes_per_token in [
        ([100, 2000, 37], 2048, 16, 800 * 1024),  # OPT-13B: 800 KiB per token
        ([16, 32, 48], 64, 16, 2),  # every length a multiple of the block: nothing wasted by paging
        ([1, 17, 33], 64, 16, 4),
        ([5, 9, 250, 256], 256, 64, 10),
        ([7], 7, 1, 3),
    ]:
        got = g.call(fn, list(lengths), max_len, block_size, bytes_per_token)
        got = tuple(got) if isinstance(got, list) else got
        g.compare(
            f"lengths {lengths}, max_len {max_len}, block_size {block_size}, {bytes_per_token} bytes per token",
            got,
            _wasted_bytes(lengths, max_len, block_size, bytes_per_token),
        )
    return g.result()


def _tables_after_fork(prompt_len: int, block_size: int, n_samples: int) -> dict[int, list[int]]:
    cache = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=1, num_blocks=64, block_size=block_size)
    cache.add(0)
    cache.reserve(0, prompt_len)
    for child in range(1, n_samples):
        cache.fork(0, child)
    for seq in [*range(1, n_samples), 0]:
        cache.reserve(seq, 1)
    return {seq: list(table) for seq, table in cache.tables.items()}


def check_fork_tables(fn):
    """``fn(prompt_len, block_size, n_samples)`` -> {sequence: block table} after: sequence 0 stores a
    prompt of ``prompt_len`` tokens in a fresh pool (free blocks are handed out lowest number first),
    is forked into sequences 1 .. n_samples - 1, then sequences 1, 2, ..., n_samples - 1 and last 0
    each append one token (copy-on-write where needed). Worked out by reasoning: a function that runs
    ``llmedu.inference`` (``PagedKVCache``, or this module's reference, which runs it) fails."""
    g = Grader("check_fork_tables")
    for prompt_len, block_size, n_samples in [(6, 4, 2), (6, 4, 3), (8, 4, 3), (10, 4, 4), (3, 16, 2), (32, 16, 2)]:
        case = f"prompt of {prompt_len} tokens, blocks of {block_size}, {n_samples} samples"
        expected = _tables_after_fork(prompt_len, block_size, n_samples)
        got, called = call_watching(g, fn, (prompt_len, block_size, n_samples), _INFERENCE)
        if not g.expect(f"{case}: reasoned, not run", called is None, f"your function ran the paged cache ({called})"):
            break
        got = {int(s): list(t) for s, t in got.items()} if isinstance(got, dict) else got
        g.compare(case, got, expected)
    return g.result()


def _blocks_needed(length: int, n_new: int, block_size: int, n_blocks: int, last_block_shared: bool) -> int:
    fresh = -(-(length + n_new) // block_size) - n_blocks  # blocks to add at the end of the table
    cow = length % block_size != 0 and last_block_shared  # a partly filled shared last block is copied
    return fresh + int(cow)


def check_blocks_needed(fn):
    """``fn(length, n_new, block_size, n_blocks, last_block_shared)`` -> fresh blocks a sequence of
    ``length`` tokens in ``n_blocks`` blocks takes to append ``n_new`` tokens (a copy-on-write counts). The fix is
    to the arithmetic: a function that asks ``llmedu.inference`` (``PagedKVCache.blocks_needed``) fails."""
    g = Grader("check_blocks_needed")
    for length, n_new, block_size, n_blocks, shared in [
        (6, 1, 4, 2, False),
        (6, 1, 4, 2, True),  # the last block is half full and shared: copy it first
        (8, 1, 4, 2, True),  # the last block is full: the new token goes to a new block, nothing is copied
        (8, 1, 4, 2, False),
        (0, 5, 4, 0, False),  # an empty sequence (a prompt arriving)
        (5, 20, 4, 2, False),
        (5, 20, 4, 2, True),
        (15, 1, 16, 1, True),
    ]:
        case = (
            f"length {length}, {n_new} new tokens, blocks of {block_size}, {n_blocks} blocks held, "
            f"last block {'shared' if shared else 'private'}"
        )
        got, called = call_watching(g, fn, (length, n_new, block_size, n_blocks, shared), _INFERENCE)
        if not g.expect(f"{case}: computed, not asked of the cache", called is None, f"your function called {called}"):
            break
        g.compare(case, got, _blocks_needed(length, n_new, block_size, n_blocks, shared))
    return g.result()
