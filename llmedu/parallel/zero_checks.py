"""The guards of ``zero.py``, kept out of the algorithm's way: bad arguments, and changes made behind its back.

A ZeRO wrapper owns its parameters: the optimizer steps the fp32 shards and the full copies follow.
Replacing a parameter of a wrapped module, or changing one in place, would leave the ranks' shards
and full copies disagreeing without an error; these checks catch both, from the parameters' entries
in their modules and from autograd's in-place version counters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..optim import adamw
from .zero_shard import FlatShard

# An optimizer can be sharded by elements only if each element's update reads nothing but that
# element's parameter, gradient and state. These do; LBFGS (a line search over the whole vector),
# Adafactor-like factored moments, Shampoo, or 8-bit Adam's block-wise scales (llmedu.optim.AdamW8bit) do not.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    adamw.AdamW,  # ours, from scratch (llmedu.optim)
)


def check_stage(stage) -> None:
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r} (stage 0 is plain DDP)")


def check_arguments(stage: int, optimizer_class: type, max_grad_norm: float | None, host) -> None:
    check_stage(stage)
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, ELEMENTWISE_OPTIMIZERS)):
        raise TypeError(
            f"cannot shard {getattr(optimizer_class, '__name__', optimizer_class)!r}: ZeRO splits every tensor "
            "across ranks, so each element's update must depend on that element alone; pass an optimizer class "
            f"among {[f'{c.__module__}.{c.__name__}' for c in ELEMENTWISE_OPTIMIZERS]}"
        )
    if not dist.is_initialized():
        raise RuntimeError("ZeRO needs torch.distributed initialised (run it under llmedu.parallel.launch or torchrun)")
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
    if host is not None and stage != 2:
        raise ValueError(f"the optimizer can be offloaded with stage 2 only (ZeRO-Offload), got stage {stage}")


def check_something_to_train(units: list[FlatShard]) -> None:
    if not units:
        raise ValueError(
            "nothing to train: every parameter of the module is frozen (requires_grad=False), or it has none; "
            "ZeRO shards the trainable parameters and their optimizer state"
        )


def _versions(unit: FlatShard) -> tuple[int, ...]:
    """Autograd's in-place counters of the shard and of a persistent full copy: they move on any write."""
    return (unit.shard._version,) + ((unit.flat._version,) if isinstance(unit.flat, nn.Parameter) else ())


def record_versions(units: list[FlatShard]) -> None:
    """After a change the wrapper made itself (its step): remember the counters."""
    for unit in units:
        unit.version = _versions(unit)


def check_untouched(unit: FlatShard) -> None:
    """Before a unit's forward: its parameters were neither replaced nor changed in place outside ZeRO."""
    for holders in unit.holders:
        for owner, name in holders:
            if name in owner._parameters:
                raise RuntimeError(
                    f"{type(owner).__name__}.{name} was replaced by a new parameter outside ZeRO: the wrapper owns "
                    "the parameters; change them through it (or wrap the model again)"
                )
    if _versions(unit) != unit.version:
        raise RuntimeError(
            "parameters were changed in place outside ZeRO (not by its step()): every rank's shard would "
            "disagree with the full copy; change them before wrapping, or through zero.shards"
        )


def check_ready_to_step(units: list[FlatShard], stage: int) -> None:
    for unit in units:
        if _versions(unit) != unit.version:
            raise RuntimeError("parameters were changed in place outside ZeRO since its last step")
        grad = unit.flat.grad if stage == 1 else unit.shard.grad  # stage 1: the full one; 2 and 3: the shard
        if grad is None:
            raise RuntimeError(
                "step() before any backward() since the last step (or a unit's parameters were not used in it): "
                "there is no gradient to apply; call backward() on a loss that uses every unit, then step()"
            )
