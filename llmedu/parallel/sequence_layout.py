"""How a sequence is cut across the ranks of context parallelism, and which tiles each rank computes.

Two layouts of N ranks: ``contiguous`` gives rank r the r-th of N equal chunks; ``zigzag`` cuts the
sequence into 2N chunks and gives rank r chunks r and 2N - 1 - r, an early and a late one, so that
under a causal mask every rank has the same work (Llama 3's context parallelism, Dubey et al. 2024).
``split_sequence``/``merge_sequence`` move between the full sequence and the ranks' pieces (also for
RoPE's positions: ``split_sequence(torch.arange(T), ...)``); ``tiles`` lists the (query chunk, key
chunk) tiles one rank computes against another's keys, skipping those wholly in the future;
``work_per_rank`` and ``ring_bytes_sent`` count the ring's schedule (``context_parallel.py`` runs it).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = [
    "LAYOUTS",
    "check_layout",
    "chunk_ids",
    "n_chunks",
    "split_sequence",
    "merge_sequence",
    "zigzag_split",
    "zigzag_merge",
    "tiles",
    "work_per_rank",
    "ring_bytes_sent",
]

LAYOUTS = ("contiguous", "zigzag")


def chunk_ids(rank: int, world: int, layout: str) -> list[int]:
    """Global indices of the chunks ``rank`` holds, in local order: N chunks (contiguous) or 2N (zig-zag)."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def n_chunks(seq_len: int, world: int, layout: str) -> int:
    """How many equal chunks the layout cuts a sequence of ``seq_len`` into; raises if they are not equal."""
    check_layout(layout)
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    n_chunks = world * (1 if layout == "contiguous" else 2)
    if seq_len % n_chunks:
        raise ValueError(
            f"the {layout} layout over {world} ranks cuts the sequence into {n_chunks} equal chunks, "
            f"but its length {seq_len} is not divisible by {n_chunks}"
        )
    return n_chunks


def split_sequence(x: torch.Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s part of the full sequence ``x`` (along ``dim``) under ``layout``."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    chunks = x.chunk(n_chunks(x.shape[dim], world, layout), dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, world, layout)], dim)


def merge_sequence(pieces: list[torch.Tensor], layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's part (in rank order): the inverse of ``split_sequence``."""
    check_layout(layout)
    world = len(pieces)
    chunks: list[torch.Tensor | None] = [None] * (world * (1 if layout == "contiguous" else 2))
    for rank, piece in enumerate(pieces):
        ids = chunk_ids(rank, world, layout)
        if piece.shape[dim] % len(ids):
            raise ValueError(f"rank {rank}'s piece has {piece.shape[dim]} tokens: not {len(ids)} equal chunks")
        for i, chunk in zip(ids, piece.chunk(len(ids), dim)):
            chunks[i] = chunk
    return torch.cat(chunks, dim)


def zigzag_split(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Chunks ``rank`` and ``2 world - 1 - rank`` of the 2 ``world`` chunks of ``x``, concatenated."""
    return split_sequence(x, rank, world, "zigzag", dim)


def zigzag_merge(chunks: list[torch.Tensor], world: int, dim: int = 2) -> torch.Tensor:
    """The full sequence from the ``world`` zig-zag pieces (in rank order)."""
    if len(chunks) != world:
        raise ValueError(f"expected one piece per rank ({world}), got {len(chunks)}")
    return merge_sequence(chunks, "zigzag", dim)


def tiles(rank: int, src: int, world: int, layout: str, causal: bool) -> Iterator[tuple[int, int, bool]]:
    """The tiles of rank's queries against rank src's keys: (query chunk, key chunk, on the diagonal?)."""
    for a, q_id in enumerate(chunk_ids(rank, world, layout)):
        for b, k_id in enumerate(chunk_ids(src, world, layout)):
            if causal and k_id > q_id:
                continue  # every key of the chunk is in the future of every query: never computed
            yield a, b, causal and k_id == q_id


def work_per_rank(seq_len: int, world: int, layout: str = "contiguous", causal: bool = True) -> list[int]:
    """Tiles each rank computes in one forward (backward: the same): the schedule, counted, not timed.

    A tile is (T/N)^2 scores in the contiguous layout and (T/2N)^2 in the zig-zag one.
    """
    n_chunks(seq_len, world, layout)
    return [
        sum(1 for s in range(world) for _ in tiles(r, (r - s) % world, world, layout, causal)) for r in range(world)
    ]


def ring_bytes_sent(batch: int, heads: int, seq_len: int, head_dim: int, world: int, bytes_per: int = 4) -> int:
    """Bytes one rank sends in one forward of ring attention: N - 1 steps, each a K and a V block (B, H, T/N, D)."""
    n_chunks(seq_len, world, "contiguous")
    return (world - 1) * 2 * batch * heads * (seq_len // world) * head_dim * bytes_per
