"""Studies that pretrain several recipes under one budget each: the machinery ``scaling.py`` (sizes x
shapes) and ``vocab_study.py`` (vocabulary sizes) share (Geiping & Goldstein 2022, sec. 3).

    budget = StudyBudget(parse_budget("3m"))                     # what every run shares, checked
    plan = plan_runs(recipes, {name: (tokenizer, train_rows)}, budget, device)   # {name: eval_every}
    summary = pretrain_recorded(folder, name, recipes[name], budget, plan[name], device)
    results["runs"][name] = run_record(summary, counts, plan[name]); write_results(out, results, start)

Every run goes through ``pretrain`` itself, under the same budget, seed and text, with the held-out MLM loss
measured outside the clock (``eval_every``); only its final checkpoint is kept. ``run_record`` keeps what a
plot needs: parameters, FLOPs per token, tokens/s, passes over the data, and the held-out history as
(step, tokens seen, seconds on the clock, loss).

Evaluations: a run is evaluated every ``eval_every`` steps, and runs differ ten-fold in speed. A short probe of
each model's speed (``probe_tokens_per_s``, a few micro-batches; it only places the evaluations) sets each
run's ``eval_every`` so that the slowest run is evaluated about ``evals`` times and faster runs more often (up
to 4x), so that every curve has points below the token count that all runs reach, where
``scaling_report.loss_at_tokens`` interpolates. The last point of each history is the final evaluation at
the end of the budget.

The results file (``study_results``, ``write_results``): provenance (command, date, machine, torch, wall
time), the study's config, its runs; rewritten after every run, so a stopped study keeps what it finished.

Left out: running several runs at once (the runs share the machine, and their speeds are part of the result).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import runtime
from ...data.packing import MLMBatches
from ...hardware import machine_summary
from ...models import MaskedLM
from ..data import CORPORA
from ..pretrain import PretrainRun, check_budget, mlm_loss_fn, pretrain
from ..recipe import BudgetClock, Recipe, budget_accumulation

__all__ = [
    "StudyBudget",
    "probe_tokens_per_s",
    "plan_evaluations",
    "plan_runs",
    "pretrain_recorded",
    "run_record",
    "study_results",
    "write_results",
]

MAX_EXTRA_EVALS = 4  # a fast run is evaluated at most this many times as often as the slowest


@dataclass(frozen=True)
class StudyBudget:
    """What every run of a study shares: the budget, the text, the seed and the held-out evaluations.

    ``budget_seconds`` per run (and/or ``max_steps``); ``eval_every`` fixes the evaluation interval for every
    run, else ``plan_runs`` sets it per run so that the slowest is evaluated about ``evals`` times, each time
    on ``eval_batches`` held-out batches. Checked on construction, before anything runs or is written.
    """

    budget_seconds: float | None
    max_steps: int | None = None
    corpora: tuple[str, ...] = CORPORA
    max_chars: int | None = None  # of each corpus; None: all of it
    seed: int = 0
    evals: int = 12
    eval_every: int | None = None
    eval_batches: int = 20
    tokenizer_chars: int = 400_000

    def __post_init__(self):
        check_budget(self.budget_seconds, self.max_steps)
        if self.eval_every is not None and (not isinstance(self.eval_every, int) or self.eval_every < 1):
            raise ValueError(f"eval_every must be an int >= 1, got {self.eval_every!r}")
        if not isinstance(self.evals, int) or self.evals < 1:
            raise ValueError(f"evals must be an int >= 1, got {self.evals!r}")
        object.__setattr__(self, "corpora", tuple(self.corpora))


# -- placing the evaluations ---------------------------------------------------------------------
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def probe_tokens_per_s(recipe: Recipe, batches: MLMBatches, device, micro_batches: int = 2) -> float:
    """Training tokens/s of a fresh model over a few micro-batches (forward, backward, AdamW step) after
    one warm-up. Rough on purpose: it only places a run's evaluations; the run measures its own speed."""
    model = MaskedLM(recipe.model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    loss_fn, precision = mlm_loss_fn(recipe.sparse_prediction), recipe.resolved_precision(device)

    def step(i: int) -> None:
        batch = {k: v.to(device) for k, v in batches(i).items()}
        with torch.autocast(device.type, dtype=_DTYPES.get(precision, torch.float32), enabled=precision in _DTYPES):
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(0)
    with runtime.Timer(device) as timer:
        for i in range(1, 1 + micro_batches):
            step(i)
    return micro_batches * recipe.micro_batch * recipe.model.max_seq_len / timer.seconds


def _expected_steps(recipe: Recipe, budget_seconds: float, tokens_per_s: float) -> float:
    """Optimizer steps that fit the budget at ``tokens_per_s``, with the batch ramp of ``budget_accumulation``."""
    clock = BudgetClock(1.0)
    micro_batches = budget_accumulation(recipe, clock)
    inverse = 0.0
    for i in range(1000):  # the mean of 1 / (micro-batches per step) over the budget
        clock.elapsed = (i + 0.5) / 1000
        inverse += 1 / (micro_batches(0) if callable(micro_batches) else micro_batches) / 1000
    seconds_per_micro_batch = recipe.micro_batch * recipe.model.max_seq_len / tokens_per_s
    return budget_seconds / seconds_per_micro_batch * inverse


def plan_evaluations(tokens_per_s: dict[str, float], steps: dict[str, float], evals: int) -> dict[str, int]:
    """{name: eval_every}: the run that reads the fewest tokens is evaluated about ``evals`` times; a run
    reading r times as many tokens, r times as often (at most ``MAX_EXTRA_EVALS`` times), so that every
    curve has points below the token count all runs reach. In effect one interval in steps for every run
    (the slowest run's steps / ``evals``), stretched for runs more than ``MAX_EXTRA_EVALS`` times faster."""
    if evals < 1:
        raise ValueError(f"evals must be >= 1, got {evals}")
    slowest = min(tokens_per_s.values())
    plan = {}
    for name, speed in tokens_per_s.items():
        ratio = max(slowest / speed, 1 / MAX_EXTRA_EVALS)
        plan[name] = max(1, int(steps[name] * ratio / evals))
    return plan


def plan_runs(recipes: Mapping[str, Recipe], data: Mapping[str, tuple], budget: StudyBudget, device) -> dict[str, int]:
    """{name: eval_every}: the budget's fixed interval for all, or one per run from a probe of its speed.

    ``data[name]`` is the run's (tokenizer, training rows), what the probe reads: one pair for every run of
    the scaling study, one per vocabulary in the vocabulary study."""
    if budget.eval_every is not None:
        return dict.fromkeys(recipes, budget.eval_every)
    if budget.budget_seconds is None:  # steps alone: every run takes the same steps
        return dict.fromkeys(recipes, max(1, budget.max_steps // budget.evals))
    speeds, steps = {}, {}
    for name, recipe in recipes.items():
        tokenizer, train_rows = data[name]
        masking = dict(rate=recipe.mask_rate, mask=recipe.mask_fraction, random=recipe.random_fraction)
        batches = MLMBatches(train_rows, recipe.micro_batch, tokenizer, seed=budget.seed, **masking)
        speeds[name] = probe_tokens_per_s(recipe, batches, device)
        steps[name] = _expected_steps(recipe, budget.budget_seconds, speeds[name])
        if budget.max_steps is not None:
            steps[name] = min(steps[name], budget.max_steps)
    return plan_evaluations(speeds, steps, budget.evals)


# -- one run, and the results file ----------------------------------------------------------------
def pretrain_recorded(folder, name: str, recipe: Recipe, budget: StudyBudget, eval_every: int, device) -> dict:
    """``pretrain``'s summary of one run of a study in ``folder``: only the final checkpoint is kept, the
    held-out loss is measured every ``eval_every`` steps; a clear error when there is no held-out loss."""
    run = PretrainRun(recipe, budget.budget_seconds, budget.max_steps, budget.corpora, budget.max_chars, budget.seed)
    summary = pretrain(
        folder,
        run,
        device=device,
        tokenizer_chars=budget.tokenizer_chars,
        checkpoint_every=10**9,  # only the final state: the study keeps no intermediate checkpoint
        eval_batches=budget.eval_batches,
        eval_every=eval_every,
        progress=False,
    )
    if summary["val_loss"] is None:
        raise ValueError(
            f"{name}: the held-out text is smaller than one micro-batch of {recipe.micro_batch} rows, "
            f"so the study has no loss to plot: use more text (max_chars) or a smaller micro_batch"
        )
    return summary


def run_record(summary: dict, counts: dict, eval_every: int) -> dict:
    """The figures of one run as plain data; the held-out history gains the tokens read by each evaluation."""
    seen, tokens_at = 0, {}
    for step in summary["history"].steps:  # every optimizer step of the run, in order
        seen += step.tokens
        tokens_at[step.step] = seen
    history = [
        {"step": h["step"], "tokens": tokens_at[h["step"]], "elapsed": h["elapsed"], "val_loss": h["val_loss"]}
        for h in summary["val_history"]
    ]
    if summary["val_loss"] is not None and (not history or history[-1]["step"] != summary["steps"]):
        history.append(  # the final evaluation, at the end of the budget
            {
                "step": summary["steps"],
                "tokens": seen,
                "elapsed": summary["elapsed_seconds"],
                "val_loss": summary["val_loss"],
            }
        )
    return {
        "parameters": dict(counts),
        **{k: summary[k] for k in ("flops_per_token", "precision", "tokens_per_s", "steps", "stop_reason")},
        **{k: summary[k] for k in ("elapsed_seconds", "wall_seconds", "tokens_seen", "corpus_tokens", "passes")},
        "val_loss": summary["val_loss"],
        "eval_every": eval_every,
        "val_history": history,
    }


def study_results(command: str, device, start: datetime.datetime, config: dict, **fields) -> dict:
    """A study's JSON before its first run: provenance (command, date, machine, torch), config, ``fields``, runs."""
    provenance = {
        "command": command,
        "date": start.strftime("%Y-%m-%d"),
        "started_utc": start.strftime("%H:%M:%S"),
        "machine": machine_summary(device),
        "torch": torch.__version__,
    }
    return {"provenance": provenance, "config": config, **fields, "runs": {}}


def write_results(out, results: dict, start: datetime.datetime) -> None:
    """Stamp the wall time since ``start`` and write ``out`` (if given): called after every run."""
    now = datetime.datetime.now(datetime.timezone.utc)
    results["provenance"]["wall_seconds"] = round((now - start).total_seconds(), 1)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1))
