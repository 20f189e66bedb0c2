"""Ring attention's forward with one fused attention kernel per tile, as production context parallelism runs it.

``context_parallel.py`` writes the ring's arithmetic out (the online softmax, tile by tile, in Python) so that
it can be read and differentiated. Production code calls a fused kernel on each (query chunk, visiting key
chunk) tile instead and merges the tiles by their logsumexps: torch's experimental ``context_parallel``
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``) runs flash, memory-efficient or
cuDNN SDPA per block; Megatron-Core's context parallelism runs Transformer Engine's fused attention per block.
This file does the same on the CPU with ``aten._scaled_dot_product_flash_attention_for_cpu``, which returns
the tile's output and its row logsumexp, and ``merge_partial_attention`` (Dubey et al. 2024 and Liu et al.
2023 use the same identity). The long-sequence lesson times its steps: their compute is then a kernel's, not
the interpreter's.

Forward only (no autograd), CPU tensors, the same layouts, ``overlap`` and ``link`` as ``ring_attention``;
each step is logged for ``ring_step_times()``. Left out: the backward, GPUs (there ``scaled_dot_product_attention``
does not return the logsumexp through a public call either), GQA.
"""

from __future__ import annotations

import math
import time

import torch

from .context_parallel import _KV, _log_step, _post_exchange, _world, merge_partial_attention
from .link import Link
from .sequence_layout import check_layout, chunk_ids, tiles

__all__ = ["fused_tile", "fused_ring_forward"]


def fused_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile by PyTorch's fused CPU kernel: output (B, H, t, D) and row logsumexp (B, H, t) of softmax(QK^T/sqrt(D)).

    ``causal``: query i sees keys j <= i (the tile is on the diagonal, square)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[:2]
    return out, lse


def fused_ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    layout: str = "zigzag",
    overlap: bool = True,
    link: Link | None = None,
) -> torch.Tensor:
    """This rank's rows (B, H, T/N, D) of softmax(QK^T/sqrt(D))V, one fused kernel per tile, K/V round the ring."""
    check_layout(layout)
    if q.device.type != "cpu" or not (q.shape == k.shape == v.shape) or q.dim() != 4:
        raise ValueError(f"fused_ring_forward takes CPU q, k, v of one 4-D shape, got {tuple(q.shape)} on {q.device}")
    rank, world = _world()
    B, H, T, D = q.shape
    c = T // len(chunk_ids(rank, world, layout))  # tokens per chunk
    out = torch.zeros_like(q)  # (B, H, T, D): normalised output over the blocks merged so far
    lse = torch.full((B, H, T), -math.inf, dtype=q.dtype)  # (B, H, T): their logsumexp
    kv = torch.stack([k, v])  # (2, B, H, T, D): one message per step
    for step in range(world):
        src, start, sends = (rank - step) % world, time.perf_counter(), step < world - 1
        if sends and overlap:
            incoming, works = _post_exchange(kv, _KV, link)  # travels while the kernels run
        for a, b, diagonal in tiles(rank, src, world, layout, causal):
            rows, cols = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
            o, l = fused_tile(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], diagonal)
            out[:, :, rows], lse[:, :, rows] = merge_partial_attention(out[:, :, rows], lse[:, :, rows], o, l)
        computed = time.perf_counter()
        if sends and not overlap:
            incoming, works = _post_exchange(kv, _KV, link)  # only now: the transfer adds to the step
        if sends:
            for work in works:
                work.wait()
            kv = incoming
        _log_step("forward", step, start, computed)
    return out
