"""What a PEFT method costs to train, measured: trainable parameters, peak memory, time per step, file size.

``step_cost`` trains a model for a few steps and reports:

* ``trainable`` and ``percent``: the parameters that receive gradients (``inject.count_parameters``),
  as a share of the base model's;
* ``peak_mib``: the peak of lesson 06's ``MemoryTracker`` over one training step: parameters, gradients,
  AdamW's two moments (only for trainable tensors) and the activations kept for backward;
* ``step_s``: the median of the timed steps, with their min and max (the first step, which allocates
  AdamW's state, is not timed);
* ``file_bytes``: the size of ``save_adapter``'s safetensors file (the trainable tensors and a header).

Left out: accuracy (that needs the protocol of ``llmedu.peft.study``), and GPU timing (no synchronisation).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .inject import count_parameters, save_adapter

__all__ = ["step_cost"]


def step_cost(
    model: nn.Module, base_total: int, batch: Callable[[int], tuple], steps: int = 5, lr: float = 1e-3
) -> dict:
    """Train ``model`` (its trainable parameters, AdamW) on ``batch(i) -> (ids, mask, labels)`` for ``steps``."""
    from ..memory.tracker import MemoryTracker

    if steps < 2:
        raise ValueError(f"steps must be at least 2 (the first is not timed), got {steps}")
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def step(i):
        ids, mask, labels = batch(i)
        loss = nn.functional.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for i in range(steps):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
    with MemoryTracker(model, optimizer) as tracker:  # one more step, measured
        step(steps)
    with tempfile.TemporaryDirectory() as tmp:
        file_bytes = save_adapter(model, Path(tmp) / "adapter.safetensors")
    trainable = count_parameters(model)[0]
    timed = times[1:]
    return dict(
        trainable=trainable,
        percent=100 * trainable / base_total,
        peak_mib=tracker.peak_bytes / 2**20,
        step_s=statistics.median(timed),
        step_range=(min(timed), max(timed)),
        file_bytes=file_bytes,
    )
