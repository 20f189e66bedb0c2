"""Context parallelism: ring attention, with each of N ranks holding one piece of the sequence.

Context parallelism splits the *sequence*: rank r holds T/N tokens of Q, K and V, (B, H, T/N, D).
Every layer but attention works token by token; attention needs every key for every query. Ring
attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context") keeps Q in place and passes the K/V blocks around a ring: at step s rank r holds the K/V
of rank (r - s) mod N, computes its queries against them, and sends them on to rank r + 1 while it
receives the next from r - 1. After N steps every query has seen every key, and no rank held more
than two K/V blocks at once.

The partial results are combined with FlashAttention's online softmax (``llmedu.kernels.
flash_attention``), the visiting blocks playing the part of its key tiles. Per query row a running
maximum m, sum l and unnormalised output acc; for each new block of scores S_j:

    m_new = max(m, rowmax(S_j))    l = exp(m - m_new) l + rowsum(exp(S_j - m_new))
    acc = exp(m - m_new) acc + exp(S_j - m_new) V_j       ... and at the end O = acc / l, L = m + log l

``merge_partial_attention`` is the same identity for two blocks already normalised: weights
exp(lse_i - lse) with lse = log(e^lse1 + e^lse2).

Backward (FlashAttention-2, Algorithm 2) keeps only O and L. K/V go around the ring once more, the
probabilities are recomputed exactly, P = exp(S - L), and with D = rowsum(dO * O):

    dV_j += P^T dO    dP = dO V_j^T    dS = P * (dP - D)    dQ += dS K_j / sqrt(d)    dK_j += dS^T Q / sqrt(d)

dQ stays home; the dK_j, dV_j of a block travel around the ring with it and arrive at its owner
after the N-th step.

Causal masking and load balance. A rank's tokens come in chunks; for each (query chunk, key chunk)
tile, a later key chunk is skipped, the same chunk is masked (the diagonal), an earlier one is full.
With the contiguous layout rank r's queries see the keys of ranks 0..r only: rank 0 computes one
tile and rank N - 1 computes N, and as every ring step waits for the slowest rank, the causal half
of the work is not saved. The zig-zag layout cuts the sequence into 2N chunks and gives rank r
chunks r and 2N - 1 - r, an early one and a late one: every rank computes 2N + 1 tiles of (T/2N)^2
scores. Llama 3 (Dubey et al. 2024, section 3.3.2) uses this split, with an all-gather of K/V
instead of the ring. ``work_per_rank`` (``sequence_layout.py``) counts the tiles; ``tiles_computed()``
those a run computes. RoPE needs each token's global position: ``split_sequence(torch.arange(T), ...)``.

Memory per rank: Q, K, V, O, dO and their gradients, O(T/N) each, the K/V block in flight, and the
scores of one tile: (B, H, c, c) with c = T/N (contiguous) or T/2N (zig-zag), or, with ``block_size``,
FlashAttention inside the ring step: the (c, c) tile walked in (block_size, block_size) pieces with the
same running statistics, so a rank holds O(T/N) plus one small piece. ``attention_peak_memory``
measures it with ``llmedu.memory.MemoryTracker``.

Overlap: a step posts its K/V exchange before its compute (``overlap=True``: max(compute, transfer)) or
after it (compute + transfer). ``link``: send over a ``Link`` (``link.py``, an alpha-beta model's time);
``ring_step_times()`` records each step's compute and total seconds (``long_sequence_study.py``).

Numerics: scores, statistics and accumulators in fp32 (fp64 for fp64 inputs). Left out: overlapping
the dK/dV transfer with compute, grouped-query attention, masks other than causal, dropout, process
groups other than the whole world, striped attention (Brandon et al. 2023) and all-to-all over heads
(DeepSpeed-Ulysses).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .collectives import _shapes_everywhere
from .link import Link
from .sequence_layout import check_layout, chunk_ids, ring_bytes_sent, tiles, work_per_rank

__all__ = [
    "ring_attention",
    "RingAttentionFunction",
    "work_per_rank",
    "tiles_computed",
    "TileCount",
    "attention_peak_memory",
    "merge_partial_attention",
    "ring_bytes_sent",
    "ring_step_times",
]

_KV, _GRAD_KV = 0, 1  # message tags: K/V blocks and their gradients travel the ring at the same time


@dataclass
class TileCount:
    """(query chunk, key chunk) tiles of ``tile_len`` x ``tile_len`` scores computed by this rank."""

    forward: int = 0
    backward: int = 0
    tile_len: int = 0


_counters: list[TileCount] = []  # the tiles_computed() blocks this rank is inside
_step_logs: list[list[dict]] = []  # the ring_step_times() blocks this rank is inside


@contextmanager
def tiles_computed() -> Iterator[TileCount]:
    """Count the tiles ``ring_attention`` computes on this rank inside the block (a count, not a time)."""
    counter = TileCount()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


@contextmanager
def ring_step_times() -> Iterator[list[dict]]:
    """Record each ring step inside the block: dict(pass_, step, compute_s, step_s), perf_counter seconds.

    compute_s runs from the step's start to the end of its tiles; step_s to the arrival of the next K/V block.
    """
    log: list[dict] = []
    _step_logs.append(log)
    try:
        yield log
    finally:
        _step_logs.remove(log)


def _log_step(pass_: str, step: int, start: float, computed: float) -> None:
    end = time.perf_counter()
    for log in _step_logs:
        log.append(dict(pass_=pass_, step=step, compute_s=computed - start, step_s=end - start))


def merge_partial_attention(o1, lse1, o2, lse2) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys K1 then K2 from the two halves' *normalised* outputs and logsumexps.

    o_i (..., T, D) = softmax(S_i) V_i and lse_i (..., T) = logsumexp(S_i) over key block i. The whole
    softmax weighs block i by its share of the total mass, exp(lse_i - lse) with lse = log(e^lse1 + e^lse2):
    the identity the ring's online softmax applies one block at a time (lesson 17). A block with no
    visible key (lse = -inf) gets weight 0.
    """
    lse = torch.logaddexp(lse1, lse2)  # (..., T)
    w1 = torch.exp(lse1 - lse).nan_to_num(0.0)  # -inf - -inf: a row that saw no key at all
    w2 = torch.exp(lse2 - lse).nan_to_num(0.0)
    return w1[..., None] * o1 + w2[..., None] * o2, lse


# -- the ring ---------------------------------------------------------------------------------------
def _post_exchange(send: torch.Tensor, tag: int, link: Link | None) -> tuple[torch.Tensor, list]:
    """Start sending ``send`` to rank + 1 and receiving a tensor like it from rank - 1; return both.

    Over a ``link`` the messages carry no tag: K/V and gradient messages are told apart by their order,
    which is the same on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    recv = torch.empty_like(send)
    if link is not None:
        return recv, link.post([(send, (rank + 1) % world)], [(recv, (rank - 1) % world)])
    works = [dist.irecv(recv, (rank - 1) % world, tag=tag), dist.isend(send, (rank + 1) % world, tag=tag)]
    return recv, works


def _pieces(c: int, block: int | None, diagonal: bool) -> Iterator[tuple[slice, slice, tuple[int, int] | None]]:
    """The (rows, cols, mask offsets) pieces of one (c, c) tile: the whole tile (``block`` None), or
    FlashAttention's (block, block) tiles, those wholly above a diagonal tile's diagonal skipped."""
    size = c if block is None else block
    for q0 in range(0, c, size):
        q1 = min(q0 + size, c)
        for k0 in range(0, c, size):
            if diagonal and k0 > q1 - 1:
                break  # every key of this piece is in the future of every query
            yield slice(q0, q1), slice(k0, min(k0 + size, c)), (q0, k0) if diagonal else None


def _scores(q_i: torch.Tensor, k_j: torch.Tensor, offsets: tuple[int, int] | None) -> torch.Tensor:
    """S = Q K^T / sqrt(D) of one piece, (B, H, rows, cols); ``offsets`` (q0, k0) inside a diagonal tile:
    query q0 + i sees keys k0 + j <= q0 + i only."""
    s = (q_i @ k_j.transpose(-2, -1)) * q_i.shape[-1] ** -0.5
    if offsets is not None:
        rows = torch.arange(s.shape[-2], device=s.device)[:, None] + offsets[0]  # (rows, 1)
        cols = torch.arange(s.shape[-1], device=s.device)[None, :] + offsets[1]  # (1, cols)
        s = s.masked_fill(cols > rows, -math.inf)
    return s


def _shift(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class RingAttentionFunction(torch.autograd.Function):
    """Forward: the online softmax over the visiting K/V blocks. Backward: the ring again, P recomputed."""

    @staticmethod
    def forward(ctx, q, k, v, causal, layout, block_size=None, overlap=True, link=None):
        rank, world = _world()
        B, H, T, D = q.shape  # T = this rank's tokens, T_full / N
        n = len(chunk_ids(rank, world, layout))
        c = T // n  # tokens per chunk
        wide = torch.promote_types(q.dtype, torch.float32)
        q_w = q.to(wide)
        m = torch.full((B, H, T), -math.inf, dtype=wide, device=q.device)  # running max
        l = torch.zeros_like(m)  # (B, H, T) running sum of exp(s - m)
        acc = torch.zeros_like(q_w)  # (B, H, T, D) unnormalised output
        kv = torch.stack([k, v])  # (2, B, H, T, D): one message per step
        for step in range(world):
            src, start, sends = (rank - step) % world, time.perf_counter(), step < world - 1  # src: whose K/V
            if sends and overlap:
                incoming, works = _post_exchange(kv, _KV, link)  # travels while we compute on kv
            for a, b, diagonal in tiles(rank, src, world, layout, causal):
                for r, k_cols, offsets in _pieces(c, block_size, diagonal):
                    rows = _shift(r, a * c)
                    k_j, v_j = kv[:, :, :, _shift(k_cols, b * c)].to(wide)  # (B, H, cols, D) each
                    s = _scores(q_w[:, :, rows], k_j, offsets)  # (B, H, rows, cols)
                    m_new = torch.maximum(m[:, :, rows], s.amax(dim=-1))
                    m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # rows that saw no key yet
                    p = torch.exp(s - m_safe[..., None])  # (B, H, rows, cols)
                    alpha = torch.exp(m[:, :, rows] - m_safe)  # rescales what was summed under the old maximum
                    l[:, :, rows] = alpha * l[:, :, rows] + p.sum(dim=-1)
                    acc[:, :, rows] = alpha[..., None] * acc[:, :, rows] + p @ v_j
                    m[:, :, rows] = m_new
                for counter in _counters:
                    counter.forward, counter.tile_len = counter.forward + 1, c
            computed = time.perf_counter()
            if sends and not overlap:
                incoming, works = _post_exchange(kv, _KV, link)  # only now: the transfer adds to the step
            if sends:
                for work in works:
                    work.wait()
                kv = incoming
            _log_step("forward", step, start, computed)
        out = (acc / l[..., None]).to(q.dtype)  # (B, H, T, D); every query sees at least one key
        lse = m + torch.log(l)  # (B, H, T): the logsumexp L, all backward needs beyond Q, K, V, O
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.layout, ctx.block_size, ctx.overlap, ctx.link = causal, layout, block_size, overlap, link
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world = _world()
        T = q.shape[2]
        c = T // len(chunk_ids(rank, world, ctx.layout))
        wide = lse.dtype
        q_w, do = q.to(wide), grad_out.to(wide)  # (B, H, T, D)
        delta = (do * out.to(wide)).sum(dim=-1)  # (B, H, T): D_i = rowsum(dO * O)
        dq = torch.zeros_like(q_w)  # (B, H, T, D), stays here
        kv = torch.stack([k, v])  # (2, B, H, T, D)
        dkv = torch.zeros(kv.shape, dtype=wide, device=q.device)  # the gradients of the K/V block here
        for step in range(world):
            src, start, sends = (rank - step) % world, time.perf_counter(), step < world - 1
            if sends and ctx.overlap:
                incoming, works = _post_exchange(kv, _KV, ctx.link)
            for a, b, diagonal in tiles(rank, src, world, ctx.layout, ctx.causal):
                for r, k_cols, offsets in _pieces(c, ctx.block_size, diagonal):
                    rows, cols = _shift(r, a * c), _shift(k_cols, b * c)
                    k_j, v_j = kv[:, :, :, cols].to(wide)  # (B, H, cols, D) each
                    q_i, do_i = q_w[:, :, rows], do[:, :, rows]  # (B, H, rows, D)
                    p = torch.exp(_scores(q_i, k_j, offsets) - lse[:, :, rows, None])  # (B, H, rows, cols), exact
                    dkv[1][:, :, cols] += p.transpose(-2, -1) @ do_i  # dV_j
                    ds = p * (do_i @ v_j.transpose(-2, -1) - delta[:, :, rows, None])  # softmax's Jacobian
                    dq[:, :, rows] += (ds @ k_j) * q.shape[-1] ** -0.5
                    dkv[0][:, :, cols] += (ds.transpose(-2, -1) @ q_i) * q.shape[-1] ** -0.5  # dK_j
                for counter in _counters:
                    counter.backward, counter.tile_len = counter.backward + 1, c
            computed = time.perf_counter()
            if sends and not ctx.overlap:
                incoming, works = _post_exchange(kv, _KV, ctx.link)
            if world > 1:  # the gradients follow their block; after the N-th step they are home
                received, grad_works = _post_exchange(dkv, _GRAD_KV, ctx.link)
                for work in grad_works:
                    work.wait()
                dkv = received
            if sends:
                for work in works:
                    work.wait()
                kv = incoming
            _log_step("backward", step, start, computed)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    layout: str = "contiguous",
    check: bool = True,
    block_size: int | None = None,
    overlap: bool = True,
    link: Link | None = None,
) -> torch.Tensor:
    """Exact attention over the whole sequence, of which this rank holds one part.

    Args:
        q, k, v: (B, H, T / N, D), this rank's tokens as ``split_sequence(x, rank, N, layout)`` gives them.
        causal: each token sees itself and the tokens before it in the *full* sequence.
        layout: "contiguous" (rank r holds chunk r of N) or "zigzag" (chunks r and 2N - 1 - r of 2N).
        check: first compare shapes and dtypes across ranks (a tiny ring all-gather), so that a
            mismatch raises the same error on every rank instead of hanging or failing in gloo.
        block_size: None: one score tile per (query chunk, key chunk); an int: FlashAttention's tiles
            of block_size x block_size inside it, O(block_size^2) scores at a time.
        overlap: post each step's K/V exchange before its compute (True) or after it (False).
        link: a ``Link`` to send over (its alpha-beta model sets each transfer's time), or None: gloo.
    Returns:
        (B, H, T / N, D): this rank's rows of softmax(Q K^T / sqrt(D)) V, in the same layout.
    Without ``torch.distributed`` initialised (or with one rank) it is plain attention.
    """
    check_layout(layout)
    if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1):
        raise ValueError(f"block_size must be None (one tile per chunk pair) or a positive int, got {block_size!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    if link is not None and not isinstance(link, Link):
        raise TypeError(f"link must be None or an llmedu.parallel.link.Link, got {type(link).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D tensor (batch, heads, tokens, head_dim), got {getattr(t, 'shape', t)}"
            )
    if not q.shape == k.shape == v.shape:
        raise ValueError(
            f"q, k, v must have one shape (no GQA here), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] == 0 or (layout == "zigzag" and q.shape[2] % 2):
        raise ValueError(
            f"this rank holds {q.shape[2]} tokens: the {layout} layout needs "
            + ("at least one" if layout == "contiguous" else "an even number (two equal chunks; T divisible by 2N)")
        )
    if check and _world()[1] > 1:
        _shapes_everywhere(q, "ring_attention")  # raises the same ValueError on every rank
    return RingAttentionFunction.apply(q, k, v, causal, layout, block_size, overlap, link)


def attention_peak_memory(
    q: torch.Tensor, causal: bool = True, layout: str = "contiguous", block_size: int | None = None
) -> int:
    """Peak bytes on this rank during one forward and backward of ``ring_attention``, measured.

    ``q`` (B, H, T / N, D) is this rank's query block; K and V are copies of it. ``MemoryTracker``
    counts every storage alive on q's device from the first op that reads it: Q, K, V, the K/V and
    gradient blocks in flight, O, L, the score tile (or FlashAttention's piece, with ``block_size``), dO and
    the three gradients.
    """
    from ..memory import MemoryTracker  # here: the memory package is not needed to run attention

    q, k, v = (q.detach().clone().requires_grad_() for _ in range(3))
    with MemoryTracker(nn.Module(), device=q.device) as tracker:
        ring_attention(q, k, v, causal=causal, layout=layout, block_size=block_size).sum().backward()
    return tracker.peak_bytes
