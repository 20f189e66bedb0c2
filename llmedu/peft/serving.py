"""Many LoRA adapters, one frozen base, one batch (the idea behind S-LoRA, Sheng et al. 2023, and
Punica, Chen et al. 2023).

Every LoRA-adapted model shares the same frozen W0; only the small A, B differ. So a server keeps
one copy of the base and a stack of adapters, and each row of a batch picks its own:

    y_b = W0 x_b + s_i B_i A_i x_b        i = route[b]       A: (N, r, d_in), B: (N, d_out, r)

The base matmul is batched over all rows as usual; the adapter matmuls gather each row's A and
B. Merging is impossible here (rows want different weights), which is the price of sharing.

A small layer that each adapted model trained in full (a task's classifier head, opened with
``mark_trainable``) is served the same way, as a stack of per-adapter copies (``RoutedLinear``).

Left out: adapters of different ranks in one stack, the custom kernels (SGMV, BGMV) that avoid
gathering, and paging adapters in and out of GPU memory.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .lora import LoRALinear

__all__ = ["MultiLoRALinear", "RoutedLinear", "MultiLoRAModel"]


class MultiLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` and N stacked LoRA updates; ``route`` (B,) says which row uses which."""

    def __init__(self, base: nn.Linear, layers: Sequence[LoRALinear]):
        super().__init__()
        ranks = {layer.r for layer in layers}
        if len(ranks) != 1:
            raise ValueError(f"adapters served together must share one rank, got ranks {sorted(ranks)}")
        self.base = base
        self.register_buffer("A", torch.stack([l.lora_A.detach() for l in layers]))  # (N, r, d_in)
        self.register_buffer("B", torch.stack([l.lora_B.detach() for l in layers]))  # (N, d_out, r)
        self.register_buffer("scaling", torch.tensor([l.scaling for l in layers], dtype=base.weight.dtype))  # (N,)
        self.route: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d_in) -> (B, T, d_out)
        if self.route is None:
            raise RuntimeError("no route is set: call the MultiLoRAModel, which sets one per batch")
        y = self.base(x)  # shared by every row
        A, B = self.A[self.route], self.B[self.route]  # (B, r, d_in), (B, d_out, r): each row's adapter
        low = torch.einsum("btd,brd->btr", x, A)  # (B, T, r)
        return y + self.scaling[self.route][:, None, None] * torch.einsum("btr,bor->bto", low, B)


class RoutedLinear(nn.Module):
    """N fully trained copies of a small linear layer (a task head); row b uses copy ``route[b]``."""

    def __init__(self, linears: Sequence[nn.Linear]):
        super().__init__()
        if any(l.bias is None for l in linears) != all(l.bias is None for l in linears):
            raise ValueError("the copies of a routed layer must all have a bias, or none")
        self.register_buffer("weight", torch.stack([l.weight.detach() for l in linears]))  # (N, d_out, d_in)
        self.register_buffer(
            "bias", None if linears[0].bias is None else torch.stack([l.bias.detach() for l in linears])
        )  # (N, d_out)
        self.route: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, ..., d_in) -> (B, ..., d_out)
        if self.route is None:
            raise RuntimeError("no route is set: call the MultiLoRAModel, which sets one per batch")
        y = torch.einsum("b...i,boi->b...o", x, self.weight[self.route])
        if self.bias is not None:
            y = y + self.bias[self.route].view(x.shape[0], *[1] * (x.dim() - 2), -1)
        return y


class MultiLoRAModel(nn.Module):
    """One base model serving several LoRA adapters: ``model(["pos", "neg", "pos"], input_ids, ...)``.

    ``adapted`` maps a name to a LoRA-adapted copy of ``base`` (same targets, same rank); only
    their A and B are kept, and one copy of the base. Linear layers that the adapted models
    trained in full (a classifier head) are kept per adapter as a ``RoutedLinear``.
    """

    def __init__(self, base: nn.Module, adapted: Mapping[str, nn.Module]):
        super().__init__()
        if not adapted:
            raise ValueError("give at least one adapted model")
        self.names = list(adapted)
        per_model = [
            {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)} for model in adapted.values()
        ]
        targets = list(per_model[0])
        if not targets:
            raise ValueError(f"adapter {self.names[0]!r} has no LoRA layer")
        for name, layers in zip(self.names, per_model):
            if list(layers) != targets:
                raise ValueError(f"adapter {name!r} adapts other layers than {self.names[0]!r}")
        self.base = copy.deepcopy(base)
        for target in targets:
            parent, _, child = target.rpartition(".")
            owner = self.base.get_submodule(parent) if parent else self.base
            linear = getattr(owner, child)
            if not isinstance(linear, nn.Linear):
                raise TypeError(
                    f"{target!r} is a {type(linear).__name__} in the base model, not the nn.Linear it should be"
                )
            setattr(owner, child, MultiLoRALinear(linear, [layers[target] for layers in per_model]))
        heads = [
            n for n, m in adapted[self.names[0]].named_modules() if isinstance(m, nn.Linear) and m.weight.requires_grad
        ]
        for head in heads:
            copies = [model.get_submodule(head) for model in adapted.values()]
            if not all(isinstance(c, nn.Linear) and c.weight.requires_grad for c in copies):
                raise ValueError(f"{head!r} is trained in some adapted models and not in others")
            parent, _, child = head.rpartition(".")
            setattr(self.base.get_submodule(parent) if parent else self.base, child, RoutedLinear(copies))
        self.base.requires_grad_(False)

    def forward(self, adapters: Sequence[str], *args, **kwargs):
        unknown = sorted(set(adapters) - set(self.names))
        if unknown:
            raise KeyError(f"unknown adapters {unknown}; this model serves {self.names}")
        route = torch.tensor([self.names.index(a) for a in adapters], device=next(self.base.parameters()).device)
        layers = [m for m in self.base.modules() if isinstance(m, (MultiLoRALinear, RoutedLinear))]
        for layer in layers:
            layer.route = route
        try:
            return self.base(*args, **kwargs)
        finally:
            for layer in layers:
                layer.route = None
