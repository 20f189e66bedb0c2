"""Activations and the feed-forward network that uses them.

* ReLU:               max(0, x)                          (Vaswani et al. 2017)
* GELU, exact:        x * Phi(x) = x/2 * (1 + erf(x / sqrt(2)))         (Hendrycks & Gimpel 2016; BERT)
* GELU, tanh approx.: x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))  (GPT-2's "gelu_new")
* SiLU (Swish-1):     x * sigmoid(x)
* Gated linear units (Shazeer 2020, "GLU Variants Improve Transformer"):
      FFN_SwiGLU(x) = W_down (SiLU(W_gate x) * W_up x)     (PaLM, LLaMA)
      FFN_GeGLU(x)  = W_down (GELU(W_gate x) * W_up x)
  A gated FFN has three matrices instead of two, so at equal parameter count its hidden width is
  2/3 of the plain one (LLaMA: 8d/3 instead of 4d); ``glu_hidden_size`` computes it.

``FUSED`` holds torch's one-kernel versions of the same functions (``F.gelu`` and friends), which
``FeedForward(fused=True)`` uses: the written-out GELU is five elementwise kernels, each saving its
input for the backward pass. Left out: the dropout inside the FFN.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["relu", "gelu", "gelu_tanh", "silu", "ACTIVATIONS", "FUSED", "GATED", "FeedForward", "glu_hidden_size"]


def relu(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(min=0)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


# name -> the function applied (to the gate, for the gated units named in GATED)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": relu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "silu": silu,
    "swiglu": silu,  # SiLU on the gate
    "geglu": gelu,  # GELU on the gate
}
GATED = {"swiglu", "geglu"}

# the same functions as torch's single kernels (forward and backward): for speed, not for reading
FUSED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swiglu": F.silu,
    "geglu": F.gelu,
}


def glu_hidden_size(d_ff: int, multiple_of: int = 1) -> int:
    """Hidden width of a gated FFN with the parameters of a plain FFN of width ``d_ff``: 2/3 of it."""
    hidden = int(2 * d_ff / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


class FeedForward(nn.Module):
    """Position-wise FFN: ``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` when gated."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = True, fused: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose from {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.act = (FUSED if fused else ACTIVATIONS)[activation]
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias) if activation in GATED else None
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))  # (B, T, d_ff) -> (B, T, d)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def projections(self) -> list[nn.Linear]:
        return [p for p in (self.gate_proj, self.up_proj, self.down_proj) if p is not None]
