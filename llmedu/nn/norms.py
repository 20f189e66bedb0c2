"""Normalisation: LayerNorm, RMSNorm, and DeepNorm's residual scaling.

* LayerNorm (Ba et al. 2016):  y = (x - mean(x)) / sqrt(var(x) + eps) * g + b, over the features.
* RMSNorm (Zhang & Sennrich 2019):  y = x / sqrt(mean(x^2) + eps) * g. No centring, no bias:
  cheaper, and as good in practice (LLaMA, T5, Gopher).
* DeepNorm (Wang et al. 2022, "DeepNet"): post-LN with the residual up-weighted,
  x_{l+1} = LN(alpha * x_l + f(x_l)), and the weights of f initialised smaller by beta
  (Xavier normal with gain beta on the FFN, value and output projections). For an encoder-only or
  a decoder-only stack of N layers: alpha = (2N)^(1/4), beta = (8N)^(-1/4).

Where the norm sits (pre-LN, post-LN, sandwich, DeepNorm) is the block's business: see
``llmedu.nn.blocks``. ``fused=True`` computes the same maths with torch's one-kernel
``F.layer_norm`` / ``F.rms_norm``: the written-out forward launches about six elementwise kernels
and autograd saves their intermediates, which costs time and memory where the matmuls are small
(lesson 25, the capstone, measures it). Left out: the encoder-decoder constants of DeepNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LayerNorm", "RMSNorm", "make_norm", "deepnorm_constants", "deepnorm_init_"]


class LayerNorm(nn.Module):
    """LayerNorm written out: centre, scale to unit variance, then an affine map."""

    def __init__(self, d_model: int, eps: float = 1e-5, bias: bool = True, fused: bool = False):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., d)
        if self.fused:  # the same function, one kernel each way
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)  # biased variance, as in the paper
        y = (x - mean) * torch.rsqrt(var + self.eps) * self.weight
        return y + self.bias if self.bias is not None else y


class RMSNorm(nn.Module):
    """RMSNorm: divide by the root mean square; computed in fp32 whatever the input dtype."""

    def __init__(self, d_model: int, eps: float = 1e-6, fused: bool = False):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., d)
        x32 = x.float()
        if self.fused:
            return self.weight * F.rms_norm(x32, self.weight.shape, eps=self.eps).to(x.dtype)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def make_norm(kind: str, d_model: int, eps: float, bias: bool = True, fused: bool = False) -> nn.Module:
    """``"layernorm"`` or ``"rmsnorm"``; ``fused``: torch's kernel instead of the written-out maths."""
    if kind == "layernorm":
        return LayerNorm(d_model, eps, bias, fused)
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps, fused)
    raise ValueError(f"unknown norm {kind!r}; choose 'layernorm' or 'rmsnorm'")


def deepnorm_constants(n_layers: int) -> tuple[float, float]:
    """(alpha, beta) of DeepNet for an encoder-only or decoder-only stack of ``n_layers``."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be positive, got {n_layers}")
    return (2 * n_layers) ** 0.25, (8 * n_layers) ** -0.25


@torch.no_grad()
def deepnorm_init_(block: nn.Module, beta: float) -> None:
    """DeepNet's initialisation of one block: Xavier normal, gain beta on v, o and the FFN, 1 on q, k."""
    attn, mlp = block.attn, block.mlp
    for linear in (attn.q_proj, attn.k_proj):
        nn.init.xavier_normal_(linear.weight, gain=1.0)
    for linear in (attn.v_proj, attn.o_proj, *mlp.projections()):
        nn.init.xavier_normal_(linear.weight, gain=beta)
