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

Left out: grouping (a grid per 128 columns), act-order (columns by decreasing diag H), the fused
int4 kernels that make the quantized layer fast, and the whole-model sequential driver.
"""

from __future__ import annotations

import torch

from .int8 import qrange, quantize

__all__ = ["hessian", "rtn_quantize", "gptq_quantize", "layer_error"]


def hessian(x: torch.Tensor) -> torch.Tensor:
    """Calibration inputs (..., d_in) -> H = 2 X^T X / N, (d_in, d_in) float64 (the mean; the scale of H
    does not change GPTQ's result, only the size of the damping relative to it)."""
    x2 = x.detach().reshape(-1, x.shape[-1]).double()  # (N, d_in)
    return 2 * x2.t() @ x2 / x2.shape[0]


def _grid(weight: torch.Tensor, bits: int, symmetric: bool):
    _, scale, zero_point = quantize(weight, bits=bits, symmetric=symmetric, axis=0)  # (d_out, 1) each
    qmin, qmax = qrange(bits, symmetric)
    return scale, zero_point, qmin, qmax


def _round(w: torch.Tensor, scale, zero_point, qmin: int, qmax: int) -> torch.Tensor:
    """w (d_out, k) -> the nearest grid values of each row (dequantized, float)."""
    q = (torch.round(w / scale) + zero_point).clamp(qmin, qmax)
    return scale * (q - zero_point)


def rtn_quantize(weight: torch.Tensor, bits: int = 4, symmetric: bool = False) -> torch.Tensor:
    """Round-to-nearest on a per-row min-max grid: the baseline GPTQ improves on (dequantized)."""
    scale, zero_point, qmin, qmax = _grid(weight.detach().float(), bits, symmetric)
    return _round(weight.detach().double(), scale.double(), zero_point.double(), qmin, qmax).float()


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
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be (d_out, d_in) and x (..., d_in): got {tuple(weight.shape)} and {tuple(x.shape)}"
        )
    if not 0 <= damp < 1:
        raise ValueError(f"damp is a fraction of mean(diag H) in [0, 1), got {damp}")
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
    Q = torch.zeros_like(W)
    for i1 in range(0, d_in, block_size):  # lazy batches: updates inside a block, then one matmul
        i2 = min(i1 + block_size, d_in)
        E = torch.zeros(W.shape[0], i2 - i1, dtype=W.dtype)  # (d_out, block) scaled errors
        for i in range(i1, i2):
            w = W[:, i : i + 1]  # (d_out, 1)
            q = _round(w, scale, zero_point, qmin, qmax)  # (d_out, 1)
            Q[:, i : i + 1] = q
            e = (w - q) / U[i, i]  # (d_out, 1)
            W[:, i + 1 : i2] -= e @ U[i : i + 1, i + 1 : i2]  # the rest of this block, now
            E[:, i - i1 : i - i1 + 1] = e
        W[:, i2:] -= E @ U[i1:i2, i2:]  # the columns after the block, once per block
    return Q.float()


def layer_error(weight: torch.Tensor, quantized: torch.Tensor, x: torch.Tensor) -> float:
    """|| X W^T - X Q^T ||_F^2 / || X W^T ||_F^2: the relative squared error of the layer's output."""
    x2 = x.detach().reshape(-1, x.shape[-1]).double()
    exact = x2 @ weight.detach().double().t()
    return float((exact - x2 @ quantized.double().t()).pow(2).sum() / exact.pow(2).sum())
