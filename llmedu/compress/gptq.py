"""GPTQ: round a layer's weights column by column, pushing each rounding error onto the columns left.

Frantar, Ashkboos, Hoefler & Alistarh 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", Algorithm 1. Round-to-nearest (RTN) rounds every weight on its own. GPTQ
minimises what the layer *computes* on calibration inputs X (N, d_in) instead:

    min_Q || X W^T - X Q^T ||^2,      whose Hessian in each row of W is  H = 2 X^T X   (d_in, d_in)

Optimal Brain Quantization fixes one weight at a time: rounding column i costs (w_i - q_i)^2 / [H^-1]_ii,
and the best correction of the columns not yet rounded is  delta = -(w_i - q_i) / [H^-1]_ii * [H^-1]_{i,:}.
GPTQ's three changes make this fast and stable: every row uses the same column order (so one H^-1
serves all rows); the updates are batched ("lazy") over blocks of 128 columns; and the rows of H^-1
that the loop needs are read from the upper Cholesky factor U of H^-1 (H^-1 = U^T U), which already
holds H^-1 with the rounded columns eliminated, instead of updating H^-1 by Gaussian elimination:

    for i in columns:   q_i = round(w_i);   e = (w_i - q_i) / U_ii;   W[:, i+1:] -= e U[i, i+1:]

A damping of 1% of mean(diag H) is added to H's diagonal; a column that never sees a nonzero input
(diag H = 0) is set to 0. The grid (scale and zero point per output row) is RTN's, from the full
row's min and max, so GPTQ and RTN produce codes on the same grid and differ only in which code each
weight gets. If H is a multiple of the identity, U is diagonal, nothing is pushed, and GPTQ is RTN.

``gptq_codes`` and ``rtn_codes`` return the integer codes with their grid; ``PackedLinear`` stores
them as a model would on disk: b-bit codes packed 8/b to a byte (two per byte at 4 bits), one fp32
scale and one uint8 zero point per output row, the fp32 bias; it dequantizes the whole weight to fp32
at each call and runs ``F.linear`` (the arithmetic of fp32 plus an unpacking, like ``qlora.NF4Linear``):
it saves bytes, not time. At 4 bits a (d_out, d_in) layer is d_out d_in / 2 + 9 d_out bytes, 4 + 72/d_in
bits a weight (4.19 at d_in = 384). The whole-model driver (block by block, each block calibrated on
the outputs of the blocks already quantized, as the paper does) is ``rows_quant.gptq_linears``.

Left out: grouping (a grid per 128 columns), act-order (columns by decreasing diag H), the fused
int4 kernels that make the quantized layer fast, 3-bit packing (``gptq_codes`` takes 2 to 8 bits;
``PackedLinear`` stores 2, 4 or 8).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .int8 import qrange, quantize

__all__ = [
    "PACKED_BITS",
    "hessian",
    "rtn_codes",
    "rtn_quantize",
    "gptq_codes",
    "gptq_quantize",
    "layer_error",
    "PackedLinear",
]

PACKED_BITS = (2, 4, 8)  # code widths that fill a byte exactly: 8 // bits codes to a byte


def hessian(x: torch.Tensor) -> torch.Tensor:
    """Calibration inputs (..., d_in) -> H = 2 X^T X / N, (d_in, d_in) float64 (the mean; the scale of H
    does not change GPTQ's result, only the size of the damping relative to it)."""
    x2 = x.detach().reshape(-1, x.shape[-1]).double()  # (N, d_in)
    return 2 * x2.t() @ x2 / x2.shape[0]


def _grid(weight: torch.Tensor, bits: int, symmetric: bool):
    _, scale, zero_point = quantize(weight, bits=bits, symmetric=symmetric, axis=0)  # (d_out, 1) each
    qmin, qmax = qrange(bits, symmetric)
    return scale, zero_point, qmin, qmax


def _codes(w: torch.Tensor, scale, zero_point, qmin: int, qmax: int) -> torch.Tensor:
    """w (d_out, k) -> the integer code of each weight's nearest grid value (as floats)."""
    return (torch.round(w / scale) + zero_point).clamp(qmin, qmax)


def _dequantize(q: torch.Tensor, scale, zero_point) -> torch.Tensor:
    return scale * (q - zero_point)


def rtn_codes(
    weight: torch.Tensor, bits: int = 4, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest on a per-row min-max grid: (codes (d_out, d_in), scale (d_out, 1), zero_point
    (d_out, 1)), codes and zero points integers held in float64, scale in float64."""
    scale, zero_point, qmin, qmax = _grid(weight.detach().float(), bits, symmetric)
    scale, zero_point = scale.double(), zero_point.double()
    return _codes(weight.detach().double(), scale, zero_point, qmin, qmax), scale, zero_point


def rtn_quantize(weight: torch.Tensor, bits: int = 4, symmetric: bool = False) -> torch.Tensor:
    """Round-to-nearest on a per-row min-max grid: the baseline GPTQ improves on (dequantized)."""
    return _dequantize(*rtn_codes(weight, bits, symmetric)).float()


def _check_finite(t: torch.Tensor, what: str) -> None:
    """NaN or inf in H (or W) fails deep inside the Cholesky factorisation with no word of where it came from."""
    bad = ~torch.isfinite(t.detach()).all(dim=-1)  # (rows,)
    if bad.any():
        first = int(bad.nonzero()[0])
        raise ValueError(
            f"{what} has NaN or inf in {int(bad.sum())} of its {len(bad)} rows (the first is row {first}): "
            "GPTQ needs finite values; find where they came from (an overflowing fp16 forward?) or drop those rows"
        )


def gptq_codes(
    weight: torch.Tensor,
    x: torch.Tensor,
    bits: int = 4,
    symmetric: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (d_out, d_in), calibration inputs x (..., d_in) -> (codes, scale, zero_point) as ``rtn_codes``
    returns them: the same grid, codes chosen by Algorithm 1."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be (d_out, d_in) and x (..., d_in): got {tuple(weight.shape)} and {tuple(x.shape)}"
        )
    if not 0 <= damp < 1:
        raise ValueError(f"damp is a fraction of mean(diag H) in [0, 1), got {damp}")
    _check_finite(weight, "the weight (d_out, d_in)")
    _check_finite(x.reshape(-1, x.shape[-1]), "the calibration inputs x, as (N, d_in) rows,")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int (columns per lazy batch), got {block_size!r}")
    W = weight.detach().double().clone()  # (d_out, d_in), float64 for the updates
    d_in = W.shape[1]
    H = hessian(x)  # (d_in, d_in)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0  # never multiplied by a nonzero input: any value will do, 0 is on every grid
    H += damp * torch.diag(H).mean() * torch.eye(d_in, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # H^-1 = U^T U
    scale, zero_point, qmin, qmax = _grid(W.float(), bits, symmetric)  # RTN's grid, from the start
    scale, zero_point = scale.double(), zero_point.double()
    Q = torch.zeros_like(W)  # (d_out, d_in) the integer codes
    for i1 in range(0, d_in, block_size):  # lazy batches: updates inside a block, then one matmul
        i2 = min(i1 + block_size, d_in)
        E = torch.zeros(W.shape[0], i2 - i1, dtype=W.dtype)  # (d_out, block) scaled errors
        for i in range(i1, i2):
            w = W[:, i : i + 1]  # (d_out, 1)
            code = _codes(w, scale, zero_point, qmin, qmax)  # (d_out, 1)
            Q[:, i : i + 1] = code
            e = (w - _dequantize(code, scale, zero_point)) / U[i, i]  # (d_out, 1)
            W[:, i + 1 : i2] -= e @ U[i : i + 1, i + 1 : i2]  # the rest of this block, now
            E[:, i - i1 : i - i1 + 1] = e
        W[:, i2:] -= E @ U[i1:i2, i2:]  # the columns after the block, once per block
    return Q, scale, zero_point


def gptq_quantize(
    weight: torch.Tensor,
    x: torch.Tensor,
    bits: int = 4,
    symmetric: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
) -> torch.Tensor:
    """weight (d_out, d_in), calibration inputs x (..., d_in) -> the quantized weight (dequantized,
    float32, on the same grid as ``rtn_quantize``)."""
    return _dequantize(*gptq_codes(weight, x, bits, symmetric, damp, block_size)).float()


def layer_error(weight: torch.Tensor, quantized: torch.Tensor, x: torch.Tensor) -> float:
    """|| X W^T - X Q^T ||_F^2 / || X W^T ||_F^2: the relative squared error of the layer's output."""
    x2 = x.detach().reshape(-1, x.shape[-1]).double()
    exact = x2 @ weight.detach().double().t()
    return float((exact - x2 @ quantized.double().t()).pow(2).sum() / exact.pow(2).sum())


def _check_packed_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in PACKED_BITS:
        raise ValueError(f"bits must be one of {PACKED_BITS} (8 // bits codes fill a byte exactly), got {bits!r}")
    return bits


class PackedLinear(nn.Module):
    """An ``nn.Linear`` stored as ``bits``-bit codes packed 8 // bits to a byte (the first code in the high
    bits), with one fp32 scale and one uint8 zero point per output row: ``W = scale * (code - zero)``.
    The weight is dequantized to fp32 at every call; nothing here trains."""

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        bias: torch.Tensor | None,
        bits: int,
        qmin: int = 0,
    ):
        super().__init__()
        _check_packed_bits(bits)
        if codes.dim() != 2:
            raise ValueError(f"codes must be (d_out, d_in), got {tuple(codes.shape)}")
        self.out_features, self.in_features = codes.shape
        self.bits = bits
        # stored unsigned: a symmetric grid's codes (qmin = -2^(b-1)) are shifted by -qmin, and its zero with them
        unsigned = (codes.detach().double() - qmin).round()  # (d_out, d_in) in [0, 2^bits)
        if unsigned.min() < 0 or unsigned.max() >= 2**bits:
            raise ValueError(f"codes minus qmin={qmin} must lie in [0, {2**bits - 1}] for {bits}-bit storage")
        self.register_buffer("packed", self._pack(unsigned.to(torch.uint8).flatten(), bits))  # (ceil(n / per),)
        self.register_buffer("scale", scale.detach().reshape(-1, 1).float())  # (d_out, 1) fp32
        self.register_buffer("zero_point", (zero_point.detach().reshape(-1, 1) - qmin).round().to(torch.uint8))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())  # (d_out,)

    @staticmethod
    def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
        """(n,) uint8 codes < 2^bits -> (ceil(n * bits / 8),) bytes, zero-padded at the end."""
        per = 8 // bits
        padded = torch.cat([codes, codes.new_zeros(-codes.numel() % per)]).reshape(-1, per)  # (bytes, per)
        shifts = torch.arange(per - 1, -1, -1, dtype=torch.uint8) * bits  # (per,) high bits first
        return (padded << shifts).sum(dim=1, dtype=torch.uint8)  # disjoint bits: the sum is an OR

    def codes(self) -> torch.Tensor:
        """(d_out, d_in) uint8: the unsigned codes, unpacked."""
        per, mask = 8 // self.bits, 2**self.bits - 1
        shifts = torch.arange(per - 1, -1, -1, dtype=torch.uint8, device=self.packed.device) * self.bits  # (per,)
        flat = ((self.packed[:, None] >> shifts) & mask).flatten()  # (bytes * per,)
        return flat[: self.out_features * self.in_features].reshape(self.out_features, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        """(d_out, d_in) fp32, made anew at each call."""
        return self.scale * (self.codes().float() - self.zero_point.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d_out)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs with {self.in_features} features, got shape {tuple(x.shape)}")
        return F.linear(x.float(), self.dequantized_weight(), self.bias).to(x.dtype)

    @classmethod
    def rtn(cls, linear: nn.Linear, bits: int = 4, symmetric: bool = False) -> PackedLinear:
        """Round-to-nearest codes of ``linear``'s weight (per-row min-max grid), stored."""
        _check_packed_bits(bits)
        return cls(*rtn_codes(linear.weight, bits, symmetric), linear.bias, bits, qrange(bits, symmetric)[0])

    @classmethod
    def gptq(cls, linear: nn.Linear, x: torch.Tensor, bits: int = 4, symmetric: bool = False, **kwargs) -> PackedLinear:
        """GPTQ codes of ``linear``'s weight on calibration inputs x (..., d_in), stored on RTN's grid;
        ``kwargs`` (damp, block_size) go to ``gptq_codes``."""
        _check_packed_bits(bits)
        codes = gptq_codes(linear.weight, x, bits, symmetric, **kwargs)
        return cls(*codes, linear.bias, bits, qrange(bits, symmetric)[0])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.bits}-bit codes packed"
