"""The bytes attention moves between slow and fast memory, counted as the code runs (the IO model).

FlashAttention's case (Dao et al. 2022, Section 3.2) is about memory traffic, not arithmetic. A GPU keeps
its tensors in HBM (large, slow) and computes on tiles held in on-chip SRAM (small, fast). For sequence
length N, head dimension d and an SRAM of M elements, Theorem 2 counts the HBM accesses:

    standard attention (their Algorithm 0): Theta(N d + N^2)      S and P written to HBM and read back
    FlashAttention:                          Theta(N^2 d^2 / M)    K and V re-read once per query tile

This file makes that count checkable on any machine. ``load(tile)`` (HBM to SRAM) and ``store(dst, value)``
(SRAM to HBM) mark every move in ``flash_attention.py``; inside ``with counting() as traffic:`` they add
the bytes of each tile to ``traffic.read`` and ``traffic.written``. "HBM" is what a kernel is handed and
returns (q, k, v, the output, the logsumexp, the gradients); everything computed in between is "SRAM".
``standard_attention`` is Algorithm 0 with the same marks, and ``largest_temporary`` measures the largest
tensor a call computes in between (its SRAM working set: a tile, or a whole (T, T) matrix).

Left out: caches between the two levels (every load is counted as HBM traffic, as in the paper's model,
though on a real GPU the L2 cache serves many of FlashAttention's K/V re-reads), and the user's mask
(a broadcast view has no honest byte count).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Traffic", "counting", "load", "store", "add_into", "standard_attention", "largest_temporary"]


@dataclass(eq=False)  # two counters with the same counts are still two counters
class Traffic:
    """Bytes read from and written to HBM while ``counting()`` was open."""

    read: int = 0
    written: int = 0

    @property
    def total(self) -> int:
        return self.read + self.written


_open: list[Traffic] = []  # the counters of the ``counting()`` blocks now open, innermost last


@contextmanager
def counting():
    """``with counting() as traffic:`` every ``load``/``store`` inside adds its bytes to ``traffic``."""
    traffic = Traffic()
    _open.append(traffic)
    try:
        yield traffic
    finally:
        _open.remove(traffic)


def load(tile: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Read ``tile`` (a view of an HBM tensor) into fast memory, in ``dtype`` (its own by default)."""
    for traffic in _open:
        traffic.read += tile.numel() * tile.element_size()
    return tile if dtype is None else tile.to(dtype)


def store(dst: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` into ``dst`` (a view of an HBM tensor), rounded to ``dst``'s dtype."""
    for traffic in _open:
        traffic.written += dst.numel() * dst.element_size()
    dst.copy_(value)


def add_into(dst: torch.Tensor, value: torch.Tensor) -> None:
    """``dst += value`` on an HBM tile: a load and a store (atomic adds in FlashAttention-2's backward)."""
    store(dst, load(dst) + value)


def standard_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Algorithm 0 of FlashAttention (non-causal), q, k, v (B, H, T, D): S and P go through HBM."""
    B, H, Tq, D = q.shape
    wide = torch.promote_types(q.dtype, torch.float32)  # arithmetic in fp32, as in the fused kernels
    s = torch.empty(B, H, Tq, k.shape[2], dtype=q.dtype, device=q.device)  # (B, H, Tq, Tk) in HBM
    store(s, load(q, wide) @ load(k, wide).transpose(-2, -1) * D**-0.5)  # 1. S = Q K^T / sqrt(D), written
    p = torch.empty_like(s)
    store(p, load(s, wide).softmax(dim=-1))  # 2. S read back, P = softmax(S) written
    out = torch.empty_like(q)
    store(out, load(p, wide) @ load(v, wide))  # 3. P and V read, O = P V written
    return out


# -- the SRAM side: the largest tensor computed between the loads and the stores ---------------------
class _LargestOutput(TorchDispatchMode):
    """Keeps the largest tensor (elements, shape, op) produced by an op that computes: no view, no
    allocation of an HBM buffer (``empty``), no write into one (``copy_``)."""

    def __init__(self):
        super().__init__()
        self.largest = (0, (), "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if not func.is_view and not name.startswith(("aten.empty", "aten.copy_")):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                    self.largest = (t.numel(), tuple(t.shape), name)
        return out


def largest_temporary(fn, *args) -> tuple[int, tuple[int, ...], str]:
    """(elements, shape, op) of the largest tensor any ATen op computes while ``fn(*args)`` runs."""
    with _LargestOutput() as recorder:
        fn(*args)
    return recorder.largest
