"""SmoothQuant: move the activations' outliers into the weights, where int8 copes with them.

Xiao, Lin, Seznec, Wu, Demouth & Han 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models", Section 4, eq. 4. W8A8 (int8 weights *and* activations)
fails on LLMs because a few activation channels are 10-100x larger than the rest, and a per-tensor
(or per-token) activation scale must cover them. Weights have no such outliers. Since

    Y = X W^T = (X diag(s)^-1) (W diag(s))^T      for any positive s (d_in,),

dividing input channel j by s_j and multiplying weight column j by s_j changes nothing in exact
arithmetic but moves the difficulty from X to W. The migration strength alpha splits it:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)       (alpha = 0.5: both sides end with max sqrt(|X_j| |W_j|))

The division by s is free when X comes out of a LayerNorm: fold 1/s into its weight and bias
(``smooth_layernorm_linears``), as the paper does for the q/k/v and fc1 inputs of OPT and BLOOM, which
are pre-LN. In a post-LN model such as BERT the LayerNorm's output is also the residual stream
(``LayerNorm(dense(...) + x)`` adds x, the previous LayerNorm's output, back in), so folding 1/s there
would rescale the residual too and change the model. ``SmoothedLinear`` keeps the migration exact in
that case: it multiplies its input by 1/s itself (one elementwise (N, d_in) product per call, which a
fused kernel would fold into the activation quantization's own multiply) and holds W diag(s).

``w8a8_linear`` is the quantized matmul used to measure the gain: per-tensor dynamic int8
activations, per-channel int8 weights, an int8 x int8 -> int32 product.

Left out: static activation scales from calibration (the paper's O3; its O2 is per-tensor dynamic, as
ours, and its O1 per-token dynamic), per-tensor weight scales (all three levels use them; ours are per
channel), and the migration into the previous linear layer.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from .int8 import int8_matmul, quantize

__all__ = ["smoothing_scales", "smooth_linear_weight", "smooth_layernorm_linears", "SmoothedLinear", "w8a8_linear"]


def smoothing_scales(
    act_absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float = 0.5, eps: float = 1e-5
) -> torch.Tensor:
    """s (d_in,) = max|X_j|^alpha / max|W_j|^(1-alpha), the max over every weight that reads X."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"the migration strength alpha must lie in [0, 1], got {alpha}")
    if act_absmax.dim() != 1:
        raise ValueError(f"act_absmax must be (d_in,), one max per input channel; got {tuple(act_absmax.shape)}")
    if not weights or any(w.dim() != 2 or w.shape[1] != act_absmax.numel() for w in weights):
        shapes = [tuple(w.shape) for w in weights]
        raise ValueError(f"weights must be (d_out, {act_absmax.numel()}) matrices reading X; got {shapes}")
    w_absmax = torch.stack([w.detach().abs().amax(dim=0) for w in weights]).amax(dim=0)  # (d_in,)
    s = act_absmax.float().clamp(min=eps) ** alpha / w_absmax.float().clamp(min=eps) ** (1 - alpha)
    return s.clamp(min=eps)


@torch.no_grad()
def smooth_linear_weight(linear: nn.Linear, s: torch.Tensor) -> None:
    """W <- W diag(s), in place: the linear's half of the migration."""
    if s.shape != (linear.in_features,):
        raise ValueError(f"s must have one entry per input feature ({linear.in_features}), got {tuple(s.shape)}")
    linear.weight.mul_(s.to(linear.weight.dtype))  # (d_out, d_in) * (d_in,): scales each column


@torch.no_grad()
def smooth_layernorm_linears(
    norm: nn.LayerNorm, linears: Sequence[nn.Linear], act_absmax: torch.Tensor, alpha: float = 0.5
) -> torch.Tensor:
    """Migrate between a LayerNorm and the linears that read its output (in place); returns s.

    LN(x) / s = (x_hat * gamma + beta) / s: folding 1/s into gamma and beta costs nothing at run time.
    """
    if not isinstance(norm, nn.LayerNorm) or norm.weight is None:
        raise TypeError(f"the activations must come out of an affine nn.LayerNorm, got {type(norm).__name__}")
    s = smoothing_scales(act_absmax, [lin.weight for lin in linears], alpha)
    norm.weight.div_(s)
    if norm.bias is not None:
        norm.bias.div_(s)
    for lin in linears:
        smooth_linear_weight(lin, s)
    return s


class SmoothedLinear(nn.Module):
    """``linear(x / s)`` with ``linear``'s weight replaced by W diag(s): the fp32 function unchanged, the
    inner linear's input (``x / s``) and weight balanced. The inner layer is an ``nn.Linear`` named
    ``linear``, so that ``int8.quantize_linears`` on the model quantizes it like any other."""

    def __init__(self, linear: nn.Linear, s: torch.Tensor):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"SmoothedLinear wraps an nn.Linear, got {type(linear).__name__}")
        if s.shape != (linear.in_features,) or not (s > 0).all():
            raise ValueError(f"s must hold {linear.in_features} positive scales, got shape {tuple(s.shape)}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.linear = copy.deepcopy(linear)
        smooth_linear_weight(self.linear, s)  # (d_out, d_in): W diag(s)
        self.register_buffer("inverse_scale", (1 / s.detach()).float())  # (d_in,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d_out)
        return self.linear(x * self.inverse_scale)  # (X diag(s)^-1) (W diag(s))^T = X W^T

    def extra_repr(self) -> str:
        return f"input divided by {self.in_features} smoothing scales"


def w8a8_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """(..., d_in) -> (..., d_out) with int8 activations (one scale per tensor, dynamic) and int8
    weights (one scale per output channel): ``s_x s_w (Q_x Q_w^T) + b``."""
    if x.shape[-1] != linear.in_features:
        raise ValueError(f"expected inputs with {linear.in_features} features, got shape {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1])  # (N, d_in)
    qx, sx, _ = quantize(x2, bits=8, symmetric=True)  # (N, d_in) int8, (1, 1)
    qw, sw, _ = quantize(linear.weight, bits=8, symmetric=True, axis=0)  # (d_out, d_in), (d_out, 1)
    y = int8_matmul(qx, qw.t()).float() * (sx * sw.t())  # (N, d_out)
    if linear.bias is not None:
        y = y + linear.bias
    return y.reshape(*x.shape[:-1], linear.out_features)
