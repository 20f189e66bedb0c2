"""What a training run records: one ``StepInfo`` per optimizer step, the ``History`` of a run, and
``log_to``, the callback that draws them live (``llmedu.viz.LiveMonitor``).

``count_tokens`` is how the trainer counts the tokens of a micro-batch for the tokens/s column.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["StepInfo", "History", "log_to", "count_tokens"]


@dataclass
class StepInfo:
    """What happened in one optimizer step; handed to every callback."""

    step: int  # optimizer steps done, this one included
    loss: float  # mean loss over the step's micro-batches
    lr: float  # learning rate of the first parameter group
    grad_norm: float  # global gradient norm before clipping (inf if it overflowed)
    tokens: int
    seconds: float  # wall-clock time of this step
    elapsed: float  # wall-clock time of the run so far (across resumes)
    loss_scale: float | None  # fp16 only: the scale used in this step
    skipped: bool  # fp16 only: the update was skipped because a gradient overflowed

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class History:
    """Every ``StepInfo`` of a run, and why it stopped ('steps', 'seconds' or 'data')."""

    steps: list[StepInfo] = field(default_factory=list)
    stop_reason: str = ""

    def __getitem__(self, name: str) -> list:
        """A column, e.g. ``history['loss']``."""
        return [getattr(s, name) for s in self.steps]


def count_tokens(batch: Any) -> int:
    """Elements of the batch's first tensor (a (B, T) tensor of ids: B*T tokens)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.numel()
    raise TypeError(f"cannot count the tokens of a {type(batch).__name__}; pass count_tokens=")


def log_to(monitor, metrics: Iterable[str] = ("loss", "lr", "tokens_per_s")) -> Callable[[StepInfo], None]:
    """A callback that logs the named ``StepInfo`` fields to a ``LiveMonitor`` every step."""
    names = tuple(metrics)
    return lambda info: monitor.log(info.step, **{n: getattr(info, n) for n in names if getattr(info, n) is not None})
