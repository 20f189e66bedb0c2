"""One small trainer for every lesson: a budget, accumulation, precision, clipping, a schedule,
callbacks, a progress bar, and checkpoints that resume exactly.

    history = train(model, optimizer, batches, loss_fn, TrainConfig(max_steps=200, accumulation=4))

What it needs, and nothing more:

* ``model`` and ``optimizer``: any ``nn.Module`` and ``torch.optim.Optimizer``.
* ``batches``: a function ``i -> the i-th micro-batch`` (best: a run can then resume at any
  position exactly), or any iterable of micro-batches (resuming skips the ones already used).
* ``loss_fn(model, batch) -> scalar loss``: the forward pass lives there, so the trainer knows
  nothing of models, tasks or heads.

One optimizer step, with ``k = accumulation`` micro-batches::

    for each of k micro-batches:          # gradients add up in .grad
        with autocast:  loss = loss_fn(model, batch) / k
        backward(loss * S)                # S = the loss scale (fp16), else 1
    unscale; clip ||g|| to `clip_grad_norm`; lr = base_lr * schedule(step)
    optimizer.step()                      # skipped if a gradient overflowed (fp16)

Dividing each micro-batch's loss by k makes the summed gradient the gradient of the mean loss over
all k micro-batches: the gradient of one k-times larger batch (when the loss is a mean over equal
micro-batches, and no layer mixes the samples of a batch: BatchNorm does; see lesson 09).

``accumulation`` may also be a function ``step -> k``: a batch size that grows during training
(Cramming's ramp: small, noisy, cheap steps first). Each step's k micro-batches are read in order,
so a resumed run continues at the same micro-batch whatever k was.

The budget is a number of optimizer steps, a number of wall-clock seconds (the Cramming setting:
Geiping & Goldstein 2022), or both: training stops at whichever comes first.

Faults. A loss or (without fp16's loss scaler, whose job it is) a gradient norm that is NaN or
infinite stops training with ``FloatingPointError`` before that step is applied or checkpointed;
``TrainConfig(nonfinite="skip")`` skips such steps instead, with a warning, and still stops after
``MAX_SKIPPED_IN_A_ROW`` in a row. Ctrl-C (SIGINT) or SIGTERM during training saves a checkpoint of
the last finished step (when there is a ``checkpoint_dir``) and then raises ``KeyboardInterrupt``: a
resumed run loses nothing. Resuming starts from the newest intact checkpoint
(``checkpoint.newest_intact``): a damaged newer one is moved aside with a warning, and the steps after
the one before are recomputed and saved. ``keep_checkpoints=N`` removes all but the newest N (at least
2, for that fallback) after each save, so that a long run does not fill the disk.

Left out: evaluation during training (a callback can do it), several optimizers, ``torch.compile``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from itertools import count, islice
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from ..runtime import sigterm_as_interrupt, synchronize
from . import checkpoint as ckpt
from .clipping import clip_grads_with_norm, global_grad_norm
from .history import History, StepInfo, count_tokens, log_to
from .precision import Precision
from .schedules import Schedule

__all__ = ["TrainConfig", "StepInfo", "History", "train", "log_to", "count_tokens"]


@dataclass
class TrainConfig:
    max_steps: int | None = None  # optimizer steps
    max_seconds: float | None = None  # wall-clock budget; the first limit reached stops training
    accumulation: int | Callable[[int], int] = 1  # micro-batches per optimizer step, or step -> that number
    precision: str | Precision = "fp32"  # fp32, bf16 (autocast), fp16 (autocast + loss scaling)
    clip_grad_norm: float | None = None  # clip the global gradient norm to this value
    schedule: Schedule | None = None  # step -> multiplier of each group's base learning rate
    checkpoint_dir: str | Path | None = None
    checkpoint_every: int | None = None  # steps between checkpoints (and one at the end)
    keep_checkpoints: int | None = None  # after each save, keep the newest N (>= 2) and remove older; None: all
    progress: bool = True  # a tqdm progress bar
    nonfinite: str = "raise"  # a NaN/inf loss or gradient norm: "raise" (stop) or "skip" the step

    def __post_init__(self):
        if self.max_steps is None and self.max_seconds is None:
            raise ValueError("give a budget: max_steps, max_seconds, or both")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise ValueError(f"max_steps must be a positive int, got {self.max_steps!r}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be positive, got {self.max_seconds!r}")
        if not callable(self.accumulation):
            _check_accumulation(self.accumulation)
        if not isinstance(self.precision, Precision):
            Precision(self.precision)  # raises for an unknown precision
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be positive, got {self.clip_grad_norm!r}")
        if self.checkpoint_every is not None and (self.checkpoint_dir is None or self.checkpoint_every < 1):
            raise ValueError("checkpoint_every needs a checkpoint_dir and must be >= 1")
        if self.keep_checkpoints is not None:
            if self.checkpoint_dir is None:
                raise ValueError("keep_checkpoints needs a checkpoint_dir")
            ckpt.check_keep(self.keep_checkpoints, "keep_checkpoints")
        if self.nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {self.nonfinite!r}")


MAX_SKIPPED_IN_A_ROW = 10  # non-finite steps skipped in a row before training stops anyway


def _check_accumulation(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"accumulation must be an int >= 1 (micro-batches per step), got {k!r}")
    return k


def _micro_batches(batches, start: int):
    """Micro-batches from position ``start`` on: ``batches(i)`` or an iterable skipped ahead."""
    if callable(batches):
        return (batches(i) for i in count(start))
    iterator = iter(batches)
    for _ in range(start):
        if next(iterator, None) is None:
            raise ValueError(f"cannot resume at micro-batch {start}: the data ended before it")
    return iterator


@dataclass
class _Progress:
    """How far a run has got: what a checkpoint holds besides the model and the optimizer."""

    step: int = 0  # optimizer steps done
    position: int = 0  # micro-batches read
    seconds: float = 0.0  # wall-clock time spent training, across resumes


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Callable[[int], Any] | Iterable,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    config: TrainConfig,
    *,
    callbacks: Iterable[Callable[[StepInfo], None]] = (),
    resume: bool | str | Path = False,
    count_tokens: Callable[[Any], int] = count_tokens,
    allow_unchecked: bool = False,
) -> History:
    """Train until the budget in ``config`` is spent (or the data ends); see the module docstring.

    ``resume``: True continues from the latest checkpoint in ``config.checkpoint_dir``; a path
    continues from that checkpoint folder. Without it, an existing checkpoint in the directory is
    an error rather than something to overwrite. ``allow_unchecked``: resume from a checkpoint that
    records no checksums (one written by an older llmedu), with a warning; otherwise that is an error.
    """
    c = config
    policy = c.precision if isinstance(c.precision, Precision) else Precision(c.precision)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    device = params[0].device
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])  # the base rate the schedule multiplies
    progress = _start_or_resume(c.checkpoint_dir, resume, model, optimizer, policy, allow_unchecked)
    saved_at = progress.step if resume else None  # the step of the latest checkpoint
    data = _micro_batches(batches, progress.position)
    history = History()
    bar = tqdm(
        total=c.max_steps, initial=progress.step, disable=not c.progress, desc="train", unit="step", dynamic_ncols=True
    )
    model.train()
    skipped_in_a_row, stop = 0, ""
    try:
        with sigterm_as_interrupt():
            while not (stop := _budget_spent(c, progress)):
                start = time.perf_counter()
                scale = policy.scaler.scale_value if policy.scaler else None  # the loss scale of this step's backward
                k = _check_accumulation(c.accumulation(progress.step) if callable(c.accumulation) else c.accumulation)
                loss, tokens, used = _accumulate(model, loss_fn, islice(data, k), k, policy, device.type, count_tokens)
                if used < k:  # the data ended inside a step: drop its partial gradients
                    optimizer.zero_grad(set_to_none=True)
                    progress.position += used
                    stop = "data"
                    break
                grad_norm, stepped = _apply_gradients(optimizer, params, policy, c, progress.step, loss)
                skipped_in_a_row = 0 if stepped or policy.scaler else skipped_in_a_row + 1
                if skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                    raise FloatingPointError(f"{skipped_in_a_row} steps in a row had a non-finite loss or gradient")
                progress.position += used
                progress.step += 1
                synchronize(device)  # GPU kernels run asynchronously: wait before reading the clock
                seconds = time.perf_counter() - start
                progress.seconds += seconds
                lr = optimizer.param_groups[0]["lr"]
                info = StepInfo(
                    progress.step, loss, lr, float(grad_norm), tokens, seconds, progress.seconds, scale, not stepped
                )
                _report(info, history, callbacks, bar)
                if c.checkpoint_every and progress.step % c.checkpoint_every == 0:
                    _save(c, model, optimizer, policy, progress)
                    saved_at = progress.step
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the last finished step, then stop as asked
        optimizer.zero_grad(set_to_none=True)  # the interrupted step's partial gradients
        if c.checkpoint_dir is not None and saved_at != progress.step:
            path = _save(c, model, optimizer, policy, progress)
            print(f"interrupted: step {progress.step} saved in {path}; resume=True continues from it", flush=True)
        raise
    finally:
        bar.close()
    history.stop_reason = stop
    if c.checkpoint_dir is not None and saved_at != progress.step:
        _save(c, model, optimizer, policy, progress)  # the final state
    return history


# -- the steps of train() ---------------------------------------------------------------------------
def _start_or_resume(directory, resume, model, optimizer, policy: Precision, allow_unchecked: bool) -> _Progress:
    """A fresh start, or the progress (and model, optimizer, loss scaler, RNG) of a checkpoint."""
    if not resume:
        if directory is not None and ckpt.latest(directory) is not None:
            raise FileExistsError(f"{directory} already holds checkpoints: pass resume=True, or use an empty directory")
        return _Progress()
    if resume is True:
        # damaged newer ones are moved aside, so that the recomputed steps can be saved again
        path = None if directory is None else ckpt.newest_intact(directory, allow_unchecked=allow_unchecked)
        if path is None:
            raise FileNotFoundError(
                f"resume=True but there is no checkpoint in {directory!r} (none at all, or only damaged ones: "
                "those are moved aside, with a warning)"
            )
        state = ckpt.load(path, model, optimizer, allow_unchecked=allow_unchecked)
    else:
        state = ckpt.load(resume, model, optimizer, allow_unchecked=allow_unchecked)
    if policy.scaler is not None and state.get("scaler"):
        policy.scaler.load_state_dict(state["scaler"])
    return _Progress(state["step"], state["position"], state["seconds"])


def _budget_spent(config: TrainConfig, progress: _Progress) -> str:
    """Why training must stop now: 'steps' or 'seconds'; '' while there is budget left."""
    if config.max_steps is not None and progress.step >= config.max_steps:
        return "steps"
    if config.max_seconds is not None and progress.seconds >= config.max_seconds:
        return "seconds"
    return ""


def _accumulate(model, loss_fn, micro_batches, k: int, policy: Precision, device_type: str, count_tokens):
    """Forward and backward over (up to) k micro-batches; their gradients add up in ``.grad``.

    Returns the mean loss, the tokens and the number of micro-batches used (fewer than k: the data ended).
    """
    loss_sum, tokens, used = 0.0, 0, 0
    for batch in micro_batches:
        with policy.autocast(device_type):
            loss = loss_fn(model, batch) / k
        (policy.scaler.scale(loss) if policy.scaler else loss).backward()
        loss_sum += loss.item()
        tokens += count_tokens(batch)
        used += 1
    return loss_sum, tokens, used


def _apply_gradients(
    optimizer, params, policy: Precision, config: TrainConfig, step: int, loss: float
) -> tuple[torch.Tensor, bool]:
    """Unscale, measure and clip the gradients, set the learning rate, step, clear the gradients.

    Returns the gradient norm before clipping, and whether the step was taken: not if a gradient
    overflowed under fp16's loss scaler, nor if the loss or gradient norm was not finite and
    ``config.nonfinite`` is "skip" (with "raise", that is an error before anything changes).
    """
    if policy.scaler:
        policy.scaler.unscale_(optimizer)  # the true gradients, before measuring or clipping
    grad_norm = global_grad_norm(params)  # params without a .grad are skipped
    message = None  # the scaler skips overflowed steps itself; anything else non-finite is a fault
    if not math.isfinite(loss):
        message = f"step {step + 1}: the loss is {loss}"
    elif policy.scaler is None and not torch.isfinite(grad_norm):
        message = f"step {step + 1}: the gradient norm is {grad_norm.item()}"
    if message:
        optimizer.zero_grad(set_to_none=True)
        if config.nonfinite == "raise":
            raise FloatingPointError(
                f"{message}; training stopped before applying or checkpointing it "
                "(TrainConfig(nonfinite='skip') skips such steps instead)"
            )
        warnings.warn(f"{message}; the step is skipped", RuntimeWarning, stacklevel=3)
        return grad_norm, False
    if config.clip_grad_norm is not None:
        clip_grads_with_norm(params, config.clip_grad_norm, grad_norm)
    if config.schedule is not None:
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * config.schedule(step)
    if policy.scaler:
        stepped = policy.scaler.step(optimizer)  # False: a gradient overflowed, step skipped
        policy.scaler.update()
    else:
        optimizer.step()
        stepped = True
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


def _report(info: StepInfo, history: History, callbacks, bar: tqdm) -> None:
    """Record the step, hand it to every callback, move the progress bar."""
    history.steps.append(info)
    for callback in callbacks:
        callback(info)
    bar.update(1)
    bar.set_postfix(loss=f"{info.loss:.4f}", refresh=False)


def _save(c: TrainConfig, model, optimizer, policy: Precision, progress: _Progress) -> Path:
    scaler = policy.scaler.state_dict() if policy.scaler else None
    state = {**asdict(progress), "scaler": scaler}  # step, position, seconds
    path = ckpt.save(c.checkpoint_dir, model, optimizer, state)
    if c.keep_checkpoints is not None:  # only once the new one is complete
        ckpt.prune(c.checkpoint_dir, c.keep_checkpoints)
    return path
