"""LoRA: a low-rank update beside a frozen linear layer (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models", eq. 3).

    h = W0 x + (alpha / r) * B A dropout(x)        W0 (d_out, d_in) frozen, A (r, d_in), B (d_out, r)

A starts random (Kaiming-uniform, as in the paper's code and ``peft``), B starts at zero, so the
adapted model computes exactly what the base model did until the first update. The update
``(alpha / r) B A`` has the shape of W0, so after training it can be added into W0 (``merge``):
the model is then a plain network again, with no extra matmul at inference. ``unmerge``
subtracts it back out (up to rounding) to continue training or to switch adapters.
``merge_and_unload`` merges and then puts the plain ``nn.Linear`` layers back, so the model's
state-dict keys are the base model's again: what ``save_pretrained`` and ``from_pretrained`` of
``transformers`` expect (``peft``'s function of the same name does the same).

Trainable parameters per adapted layer: r * (d_in + d_out), against d_in * d_out for the layer.

Left out: LoRA on embeddings and convolutions, rank-stabilised scaling (rsLoRA), DoRA, and
quantised base weights (QLoRA).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from .inject import ensure_not_applied, find_modules, freeze_base, replace_module

__all__ = ["LoRALinear", "apply_lora", "merge_lora", "unmerge_lora", "merge_and_unload"]


class LoRALinear(nn.Module):
    """``base(x) + (alpha / r) * dropout(x) A^T B^T`` around a frozen ``nn.Linear``."""

    peft_method = "lora"

    def __init__(self, base: nn.Linear, r: int, alpha: float = 1.0, dropout: float = 0.0):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear wraps an nn.Linear, got {type(base).__name__}")
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"the LoRA rank r must be a positive int, got {r!r}")
        if r > min(base.in_features, base.out_features):
            raise ValueError(
                f"rank r={r} exceeds min(d_in, d_out) = {min(base.in_features, base.out_features)}: not low-rank"
            )
        self.base = base
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=w.device, dtype=w.dtype))  # (r, d_in)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=w.device, dtype=w.dtype))  # (d_out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # what nn.Linear does to its own weight
        self.dropout = nn.Dropout(dropout)
        self.merged = False
        self.enabled = True

    def delta_weight(self) -> torch.Tensor:
        """The update as a full matrix: (alpha / r) B A, shape (d_out, d_in)."""
        return self.scaling * self.lora_B @ self.lora_A

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d_out)
        y = self.base(x)
        if self.merged or not self.enabled:  # merged: W0 already holds the update
            return y
        low = F.linear(self.dropout(x), self.lora_A)  # (..., r): the bottleneck
        return y + self.scaling * F.linear(low, self.lora_B)  # (..., d_out)

    @torch.no_grad()
    def merge(self) -> None:
        """W0 <- W0 + (alpha / r) B A: one matmul per layer at inference, as before LoRA."""
        if self.merged:
            raise RuntimeError("this LoRA layer is already merged")
        if not self.enabled:
            raise RuntimeError("this LoRA layer is switched off; switch it on before merging")
        self.base.weight += self.delta_weight().to(self.base.weight.dtype)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """W0 <- W0 - (alpha / r) B A: the base weight back (up to floating-point rounding)."""
        if not self.merged:
            raise RuntimeError("this LoRA layer is not merged")
        self.base.weight -= self.delta_weight().to(self.base.weight.dtype)
        self.merged = False

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, merged={self.merged}"


def apply_lora(
    model: nn.Module, targets: str | Iterable[str], r: int = 8, alpha: float = 16.0, dropout: float = 0.0
) -> list[str]:
    """Wrap every ``nn.Linear`` whose name matches ``targets`` in a ``LoRALinear``; freeze the rest.

    Returns the adapted names. ``targets`` follow ``inject.find_modules``: ``["q_proj", "v_proj"]``
    for Llama and our models, ``["query", "value"]`` for BERT.
    """
    ensure_not_applied(model, "lora")
    if not isinstance(r, int) or r <= 0:
        raise ValueError(f"the LoRA rank r must be a positive int, got {r!r}")
    found = find_modules(model, targets, kind=nn.Linear)
    for name, linear in found:
        replace_module(model, name, LoRALinear(linear, r, alpha, dropout))
    freeze_base(model)
    return [name for name, _ in found]


def _lora_layers(model: nn.Module) -> list[LoRALinear]:
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if not layers:
        raise ValueError("the model has no LoRA layer; call apply_lora first")
    return layers


def merge_lora(model: nn.Module) -> None:
    """Fold every LoRA update into its base weight (see ``LoRALinear.merge``)."""
    for layer in _lora_layers(model):
        layer.merge()


def unmerge_lora(model: nn.Module) -> None:
    """Take every LoRA update back out of its base weight."""
    for layer in _lora_layers(model):
        layer.unmerge()


@torch.no_grad()
def merge_and_unload(model: nn.Module) -> nn.Module:
    """Merge every LoRA update and replace each ``LoRALinear`` by its base ``nn.Linear``; returns ``model``.

    The result has no LoRA module and the base model's parameter names (``...query.weight``, not
    ``...query.base.weight``), so it saves and loads as the plain model it now is. Parameters keep
    the ``requires_grad`` they had (the base stays frozen), as with ``peft``.
    """
    names = [name for name, module in model.named_modules() if isinstance(module, LoRALinear)]
    if not names:
        raise ValueError("the model has no LoRA layer; call apply_lora first")
    for name in names:
        layer = model.get_submodule(name)
        if not layer.merged:
            layer.merge()
        replace_module(model, name, layer.base)
    return model
