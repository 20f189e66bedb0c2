"""Bottleneck adapters (Houlsby et al. 2019, "Parameter-Efficient Transfer Learning for NLP", fig. 2).

A small two-layer network with a skip connection is inserted after the output projection of
attention and after the output projection of the feed-forward network, before the block adds
its residual and normalises:

    h <- h + W_up act(W_down h + b_down) + b_up        W_down (m, d), W_up (d, m), m << d

With W_up and b_up at zero the adapter is the identity, so the adapted model starts exactly
where the pretrained one was (the paper initialises near zero; exact zero is the limit of that,
and it is what LoRA does with B). Per adapter: 2 d m + d + m parameters, two per block.

Which modules are the "output projections" is a matter of names:

    Hugging Face BERT:   r".*\\.output\\.dense"   (attention.output.dense and output.dense)
    Llama, our models:   ["o_proj", "down_proj"]

Left out: the paper's also-trained layer norms, AdapterFusion and parallel adapters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .inject import ensure_not_applied, find_modules, freeze_base, replace_module

__all__ = ["BottleneckAdapter", "apply_adapters"]


class BottleneckAdapter(nn.Module):
    """``y = base(x); y + up(act(down(y)))``: an identity at initialisation."""

    peft_method = "adapter"

    def __init__(self, base: nn.Linear, bottleneck: int, activation: nn.Module | None = None):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"a bottleneck adapter follows an nn.Linear projection, got {type(base).__name__}")
        if not isinstance(bottleneck, int) or bottleneck <= 0:
            raise ValueError(f"the bottleneck size must be a positive int, got {bottleneck!r}")
        d, w = base.out_features, base.weight
        self.base = base
        self.down = nn.Linear(d, bottleneck, device=w.device, dtype=w.dtype)
        self.up = nn.Linear(bottleneck, d, device=w.device, dtype=w.dtype)
        self.act = activation if activation is not None else nn.GELU()
        nn.init.normal_(self.down.weight, std=1e-2)  # the paper's near-zero initialisation
        nn.init.zeros_(self.down.bias)
        nn.init.zeros_(self.up.weight)  # exactly the identity at the start
        nn.init.zeros_(self.up.bias)
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d)
        h = self.base(x)  # (..., d)
        if not self.enabled:
            return h
        return h + self.up(self.act(self.down(h)))  # (..., m) in the middle


def apply_adapters(model: nn.Module, targets: str | Iterable[str], bottleneck: int = 16) -> list[str]:
    """Put a ``BottleneckAdapter`` after every projection matching ``targets``; freeze the rest."""
    ensure_not_applied(model, "adapter")
    found = find_modules(model, targets, kind=nn.Linear)
    for name, linear in found:
        replace_module(model, name, BottleneckAdapter(linear, bottleneck))
    freeze_base(model)
    return [name for name, _ in found]
