"""The roofline model: is a kernel limited by arithmetic or by memory?

Williams, Waterman & Patterson, "Roofline: An Insightful Visual Performance Model for Multicore
Architectures" (CACM, 2009). A kernel that does ``F`` floating-point operations and moves ``Q``
bytes between memory and the chip has arithmetic intensity

    I = F / Q                                          (FLOP per byte)

and on a chip with peak compute ``P`` (FLOP/s) and memory bandwidth ``B`` (bytes/s) it can run
no faster than

    attainable(I) = min(P, I * B).

Below the *ridge point* ``I* = P / B`` the kernel is memory-bound: a faster multiplier would not
help, only fewer bytes would. Above it the kernel is compute-bound.

The counts below are the textbook ones. A multiply-add is 2 FLOPs, so an (m, k) @ (k, n) matmul
is ``2mkn`` (``torch.utils.flop_counter`` uses the same convention). Bytes are the *minimum*
traffic: every input read once and every output written once, as if caches were perfect for the
inputs of one kernel and useless between kernels. What is left out: caches (a kernel whose data
fits in cache beats the roofline drawn with DRAM bandwidth), the cost of ``exp`` and ``rsqrt``
relative to an add (each counted as one FLOP), masking, dropout and the 1/sqrt(d) scaling in
attention (O(T*D) next to O(T^2*D)), and every backward pass.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = [
    "Workload",
    "matmul_flops",
    "matmul",
    "softmax",
    "layernorm",
    "attention",
    "arithmetic_intensity",
    "attainable_flops",
    "ridge_point",
    "bound",
]


@dataclass(frozen=True)
class Workload:
    """What one kernel costs: floating-point operations and bytes moved to and from memory."""

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP per byte."""
        return arithmetic_intensity(self.flops, self.bytes)

    def __str__(self) -> str:
        return f"{self.name}: {self.flops:.3g} FLOP, {self.bytes:.3g} B, intensity {self.intensity:.3g} FLOP/B"


# -- FLOP and byte counts ------------------------------------------------------------------------
def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of an (m, k) @ (k, n) matmul: m*n outputs, each k multiplies and k adds."""
    _check_dims(m=m, k=k, n=n)
    return 2 * m * k * n


def matmul(m: int, k: int, n: int, bytes_per_element: int = 2) -> Workload:
    """(m, k) @ (k, n) -> (m, n): read A and B once, write C once."""
    _check_dims(m=m, k=k, n=n, bytes_per_element=bytes_per_element)
    elements = m * k + k * n + m * n  # A, B in; C out
    return Workload(f"matmul ({m}x{k})@({k}x{n})", matmul_flops(m, k, n), elements * bytes_per_element)


def softmax(rows: int, cols: int, bytes_per_element: int = 2) -> Workload:
    """Softmax over the last dimension of a (rows, cols) tensor.

    Per element: a max, a subtraction, an exp, a sum and a division: 5 FLOPs. Read once, write once.
    """
    _check_dims(rows=rows, cols=cols, bytes_per_element=bytes_per_element)
    elements = rows * cols
    return Workload(f"softmax ({rows}x{cols})", 5 * elements, 2 * elements * bytes_per_element)


def layernorm(rows: int, dim: int, bytes_per_element: int = 2) -> Workload:
    """LayerNorm over the last dimension of a (rows, dim) tensor, with a weight and a bias.

    Per element: the mean's add, x - mean, its square, the variance's add, the multiply by
    1/std, the weight's multiply and the bias's add: 7 FLOPs (the per-row rsqrt is ignored).
    Bytes: x in, y out, and the weight and bias (dim each) read once.
    """
    _check_dims(rows=rows, dim=dim, bytes_per_element=bytes_per_element)
    elements = rows * dim
    return Workload(f"layernorm ({rows}x{dim})", 7 * elements, (2 * elements + 2 * dim) * bytes_per_element)


def attention(
    batch: int, heads: int, seq_len: int, head_dim: int, bytes_per_element: int = 2, fused: bool = False
) -> Workload:
    """softmax(Q K^T) V for Q, K, V of shape (batch, heads, seq_len, head_dim), no mask.

    FLOPs: Q K^T and P V are 2*T*T*D each per head, the softmax 5*T*T.

    Bytes depend on the implementation, and that is the point of FlashAttention (Dao et al.,
    2022, section 3.2):
      * standard (``fused=False``): Q, K, V are read; the (T, T) scores S are written, read back
        by the softmax, whose output P is written and read again by P V; O is written:
        4*T*D + 4*T*T elements per head.
      * fused (``fused=True``): S and P live in on-chip memory; only Q, K, V in and O out:
        4*T*D elements per head.
    """
    _check_dims(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim, bytes_per_element=bytes_per_element)
    bh, t, d = batch * heads, seq_len, head_dim
    flops = bh * (2 * t * t * d + 5 * t * t + 2 * t * t * d)  # Q K^T, softmax, P V
    elements = bh * (4 * t * d if fused else 4 * t * d + 4 * t * t)
    kind = "fused attention" if fused else "attention"
    return Workload(f"{kind} (B={batch}, H={heads}, T={seq_len}, D={head_dim})", flops, elements * bytes_per_element)


# -- the roofline ---------------------------------------------------------------------------------
def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved."""
    _check_number("flops", flops, zero_ok=True)
    _check_number("bytes moved", nbytes)
    return flops / nbytes


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: ``min(peak_flops, intensity * bandwidth)`` in FLOP/s."""
    _check_number("intensity", intensity, zero_ok=True)
    _check_number("peak_flops", peak_flops)
    _check_number("bandwidth", bandwidth)
    return min(peak_flops, intensity * bandwidth)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The intensity (FLOP/B) above which a kernel can reach the peak: ``peak_flops / bandwidth``."""
    _check_number("peak_flops", peak_flops)
    _check_number("bandwidth", bandwidth)
    return peak_flops / bandwidth


def bound(workload: Workload, peak_flops: float, bandwidth: float) -> str:
    """``"compute"`` or ``"memory"``: which roof limits ``workload`` on this chip."""
    return "compute" if workload.intensity >= ridge_point(peak_flops, bandwidth) else "memory"


def _check_dims(**dims: int) -> None:
    for name, value in dims.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_number(name: str, value: float, zero_ok: bool = False) -> None:
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (is_number and math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise ValueError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0, got {value!r}")
