"""The crammed training step as one loop, read top to bottom (as nanoGPT's ``train.py`` keeps its own).

Geiping & Goldstein 2023, *Cramming: Training a Language Model on a Single GPU in One Day* (ICML;
arXiv:2212.14034). The rules (sec. 2) give a run a number of seconds, not of steps, so what a recipe ties
to "the end of training" is tied to the budget instead (sec. 4.3), and the head predicts only the masked
tokens (sec. 4.2). One optimizer step::

    f = the fraction of the budget spent              (BudgetClock.fraction: seconds or steps, the larger)
    k = micro-batches in this step                    (budget_accumulation: the batch ramp, 1 early, more later)
    for each of k micro-batches:
        with autocast (bf16 where the device has it): loss = sparse MLM loss / k
        loss.backward()                               # gradients add up in .grad
    clip ||g|| to recipe.clip_grad_norm               # 0.5 in the crammed recipe, none in BERT's
    lr = recipe.lr * budget_schedule(f)               # the schedule spans the budget, not a step count
    optimizer.step()

Sparse prediction (sec. 4.2, the head block): the MLM head is a dense layer, a norm and a d x vocab matmul
per position, but only the ~15% masked positions carry a loss. Running it on those rows alone gives the same
loss and gradients and skips about 85% of the largest matmul (``mlm_loss_fn(sparse=True)``).

The clock counts the optimizer steps' seconds alone: held-out evaluation and checkpoints run outside it,
through ``hooks`` (one line each in the loop; ``Hooks`` does nothing, ``pretrain`` passes ones that write
its run folder). Resuming is the caller's: it loads a checkpoint and passes its step, data position and clock.

Left out, on purpose: run folders and resuming (``pretrain.py``); skipping a non-finite step (here it stops
the run with an error; ``llmedu.train.train``, the general trainer of the other lessons, can skip);
``torch.compile``; several devices; the authors' data sorting and filtering (sec. 4.4).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from time import perf_counter

import torch
import torch.nn.functional as F

from ..models import MaskedLM
from ..runtime import synchronize
from ..train.clipping import clip_grads_with_norm, global_grad_norm
from ..train.history import History, StepInfo
from ..train.precision import Precision
from .recipe import BudgetClock, Recipe, budget_accumulation, budget_schedule

__all__ = ["crammed_loop", "Hooks", "budget_spent", "mlm_loss_fn"]


def mlm_loss_fn(sparse: bool) -> Callable:
    """loss_fn(model, batch) for the trainer: cross-entropy over the masked positions."""

    def loss_fn(model: MaskedLM, batch: dict) -> torch.Tensor:
        h = model.transformer(batch["input_ids"])  # (B, T, d)
        labels = batch["labels"]  # (B, T), -100 where nothing is predicted
        if sparse:
            picked = labels != -100  # (B, T)
            logits = model.mlm_head(h[picked])  # (M, vocab): the masked rows only
            return F.cross_entropy(logits.float(), labels[picked])
        logits = model.mlm_head(h)  # (B, T, vocab): every position
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    return loss_fn


class Hooks:
    """What the run around the loop does between steps, outside the clock. These do nothing."""

    def evaluate(self, info: StepInfo) -> None:
        """Every ``eval_every`` steps: e.g. measure the held-out loss."""

    def step_done(self, info: StepInfo) -> None:
        """After every step: e.g. a progress bar, callbacks."""

    def checkpoint(self, step: int, position: int, seconds: float) -> None:
        """Every ``checkpoint_every`` steps, at the end and on an interrupt: save what a resume needs."""


def budget_spent(clock: BudgetClock, step: int) -> str:
    """Why the run must stop now: 'steps' or 'seconds'; '' while there is budget left."""
    if clock.max_steps is not None and step >= clock.max_steps:
        return "steps"
    if clock.seconds is not None and clock.elapsed >= clock.seconds:
        return "seconds"
    return ""


def crammed_loop(
    model: MaskedLM,
    optimizer: torch.optim.Optimizer,
    batches: Callable[[int], dict],
    recipe: Recipe,
    clock: BudgetClock,
    *,
    device: torch.device,
    precision: Precision | None = None,
    step: int = 0,
    position: int = 0,
    eval_every: int | None = None,
    checkpoint_every: int | None = None,
    hooks: Hooks | None = None,
) -> History:
    """Train ``model`` by ``recipe`` until ``clock``'s budget (seconds, max_steps or both) is spent.

    ``batches(i)``: the i-th micro-batch, {"input_ids": (B, T), "labels": (B, T), -100 where unmasked}.
    ``clock.elapsed``, ``step``, ``position``: the seconds, optimizer steps and micro-batches already done (a
    resumed run's). ``precision``: default ``recipe.resolved_precision(device)``; fp16 carries a loss scaler.
    Returns every step's ``StepInfo`` and why it stopped ('steps' or 'seconds').
    """
    hooks = hooks or Hooks()
    policy = precision or Precision(recipe.resolved_precision(device))
    scaler = policy.scaler  # fp16 only (lesson 07): None in fp32 and bf16, which need no loss scaling
    loss_fn = mlm_loss_fn(recipe.sparse_prediction)  # sparse prediction: the head on the masked rows only
    schedule = budget_schedule(recipe, clock)  # step -> lr multiplier, read from the budget spent
    ramp = budget_accumulation(recipe, clock)  # step -> micro-batches; an int when the batch is fixed
    params = [p for group in optimizer.param_groups for p in group["params"]]
    history = History()
    model.train()
    try:
        while not (stop := budget_spent(clock, step)):
            start = perf_counter()
            k = ramp(step) if callable(ramp) else ramp  # the batch ramp
            scale = scaler.scale_value if scaler else None
            loss_sum, tokens = 0.0, 0
            for i in range(position, position + k):
                batch = {name: t.to(device, non_blocking=True) for name, t in batches(i).items()}  # (B, T) each
                with torch.autocast(device.type, dtype=policy.dtype, enabled=policy.name != "fp32"):
                    loss = loss_fn(model, batch) / k  # / k: the summed gradients are those of the mean loss
                (scaler.scale(loss) if scaler else loss).backward()  # gradients add up in .grad
                loss_sum += loss.item()
                tokens += batch["input_ids"].numel()
            if scaler:
                scaler.unscale_(optimizer)  # the true gradients, before they are measured and clipped
            grad_norm = global_grad_norm(params)  # ||g|| over all parameters, before clipping
            if not math.isfinite(loss_sum) or (scaler is None and not torch.isfinite(grad_norm)):
                raise FloatingPointError(f"step {step + 1}: loss {loss_sum}, gradient norm {float(grad_norm)}")
            if recipe.clip_grad_norm is not None:
                clip_grads_with_norm(params, recipe.clip_grad_norm, grad_norm)  # g * min(1, c / ||g||)
            for group in optimizer.param_groups:
                group["lr"] = recipe.lr * schedule(step)  # a triangle over the budget (crammed)
            if scaler:
                stepped = scaler.step(optimizer)  # False: a gradient overflowed and the step is skipped
                scaler.update()
            else:
                optimizer.step()
                stepped = True
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)  # a GPU runs asynchronously: wait for it before reading the clock
            seconds = perf_counter() - start
            step, position, clock.elapsed = step + 1, position + k, clock.elapsed + seconds
            lr = optimizer.param_groups[0]["lr"]
            info = StepInfo(step, loss_sum, lr, float(grad_norm), tokens, seconds, clock.elapsed, scale, not stepped)
            history.steps.append(info)
            if eval_every and step % eval_every == 0:
                hooks.evaluate(info)  # the held-out loss, outside the clock
            hooks.step_done(info)
            if checkpoint_every and step % checkpoint_every == 0:
                hooks.checkpoint(step, position, clock.elapsed)
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM, where the caller turns it into one): keep the last step
        optimizer.zero_grad(set_to_none=True)  # the interrupted step's partial gradients
        hooks.checkpoint(step, position, clock.elapsed)
        raise
    hooks.checkpoint(step, position, clock.elapsed)  # the final state
    history.stop_reason = stop
    return history
