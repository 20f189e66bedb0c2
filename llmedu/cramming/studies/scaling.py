"""Size against shape under one budget: the paper's central figure at our scale (Geiping & Goldstein 2022, sec. 3).

    results = run_scaling(GRIDS["cpu"], parse_budget("3m"), out="data/results/cramming_scaling_cpu.json")
    plot_scaling(results); print(scaling_table(results))      # from scaling_report

Cramming's argument for its recipe (their sec. 3 and figs. 1-2, after the scaling laws of Kaplan et al. 2020,
sec. 3.1): plotted against the tokens it has read, a transformer's MLM loss depends mostly on its size (the
non-embedding parameters) and little on its shape (deep and narrow or shallow and wide) or type. So, under a
wall-clock budget, the question is how many tokens a shape reads per second: pick the size the budget can
feed, then the shape, and every other change, by throughput. Plotted against seconds, size trades against
speed: a larger model learns more per token but reads fewer of them.

The study pretrains every entry of a grid (sizes x shapes, ``scaling_grid.py``: ``GRIDS``, ``check_grid``)
with the crammed recipe (``crammed(**overrides)``) through ``pretrain`` itself, each under the same budget,
on the same data and tokenizer, with the held-out MLM loss measured outside the clock (``eval_every``), and
writes one JSON: per run the architecture, the parameters (non-embedding and total,
``llmedu.models.counting``), FLOPs per token, tokens/s, and the held-out history as (step, tokens seen,
seconds on the clock, loss); beside them the unigram line of the held-out text (``study.unigram_line``, the
calibration of the rest of the capstone).

Every run goes through the machinery of ``budget_runs.py``, shared with the vocabulary study: ``StudyBudget``
(what every run shares), ``plan_runs`` (a probe of each model's speed places its held-out evaluations, so
that the slowest run is evaluated about ``evals`` times and faster ones more often, and every curve has
points below the token count all runs reach, where ``scaling_report.loss_at_tokens`` interpolates),
``pretrain_recorded`` and ``run_record`` (one run and its figures), ``study_results`` and ``write_results``
(the JSON, rewritten after every run).

Read the per-token comparison with its confound: each run's learning rate follows its own budget (the
one-cycle schedule of ``recipe.budget_schedule``), so at a common token count a fast run is still early in its
schedule while a slow one has annealed. The comparison is also a few minutes on a CPU: a small-scale check
of the paper's claim, not a scaling law.

Left out: fitting power laws (three sizes cannot support one), learning rates tuned per size (every run
uses the recipe's), and the paper's other architectures (funnel transformers, recurrent layers and so on):
here "shape" means depth against width.
"""

from __future__ import annotations

import datetime
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ... import runtime
from ..data import CORPORA, prepare_data
from ..recipe import crammed
from .budget_runs import (
    StudyBudget,
    plan_evaluations,
    plan_runs,
    pretrain_recorded,
    probe_tokens_per_s,
    run_record,
    study_results,
    write_results,
)
from .scaling_grid import BASES, GRIDS, PARAM_TOLERANCE, GridEntry, check_grid, parameter_counts, parse_entry
from .scaling_report import budget_words
from .study import unigram_line

__all__ = [
    "run_scaling",
    # importable from here as before: the grid (scaling_grid.py) and the evaluation plan (budget_runs.py)
    "PARAM_TOLERANCE",
    "GridEntry",
    "GRIDS",
    "BASES",
    "parse_entry",
    "parameter_counts",
    "check_grid",
    "StudyBudget",
    "probe_tokens_per_s",
    "plan_evaluations",
]


# -- the study -----------------------------------------------------------------------------------
def run_scaling(
    grid: Sequence[GridEntry],
    budget_seconds: float | None,
    out=None,
    *,
    base: dict | None = None,
    max_steps: int | None = None,
    corpora: Sequence[str] = CORPORA,
    max_chars: int | None = None,
    seed: int = 0,
    evals: int = 12,
    eval_every: int | None = None,
    eval_batches: int = 20,
    tokenizer_chars: int = 400_000,
    runs_dir=None,
    device=None,
    command: str | None = None,
    progress: bool = True,
    stream=None,
) -> dict:
    """Pretrain every entry of ``grid`` (overrides of ``crammed(**base)``) under the same budget; write ``out``.

    ``budget_seconds`` per run (and/or ``max_steps``); ``eval_every`` fixes the evaluation interval for
    every run, else ``plan_runs`` sets it per run from ``evals``. ``runs_dir`` keeps the run folders
    (default: a temporary folder, removed at the end). The JSON is rewritten after every run, so a
    stopped study keeps what it finished. Progress lines go to ``stream`` (default stdout).
    """
    stream = stream or sys.stdout
    say = (lambda *a: print(*a, file=stream, flush=True)) if progress else (lambda *a: None)
    base = dict(base or {})
    # checked before anything runs or is written: the budget, the evaluation settings, the grid
    budget = StudyBudget(
        budget_seconds, max_steps, tuple(corpora), max_chars, seed, evals, eval_every, eval_batches, tokenizer_chars
    )
    counts = check_grid(grid, base)
    recipes = {e.name: crammed(**{**base, **e.overrides()}) for e in grid}
    reference = crammed(**base)
    device = device or runtime.device()
    start = datetime.datetime.now(datetime.timezone.utc)

    say(f"Preparing the data once for all {len(grid)} runs (cached after the first time); no clock is running.")
    data = prepare_data(reference, corpora, max_chars, tokenizer_chars, progress=False)
    tokenizer, train_rows = data.tokenizer, data.train
    plan = plan_runs(recipes, dict.fromkeys(recipes, (tokenizer, train_rows)), budget, device)
    for e in grid:
        say(
            f"  {e.name:<14} d {e.d_model} x {e.n_layers} layers, {counts[e.name]['non_embedding']:,} non-embedding "
            f"parameters: evaluated every {plan[e.name]} step{'s' if plan[e.name] > 1 else ''}"
        )

    config = {
        "budget_seconds": budget_seconds,
        "max_steps": max_steps,
        "grid": [asdict(e) for e in grid],
        "base": base,
        "reference": {
            **{k: getattr(reference.model, k) for k in ("d_model", "n_layers", "n_heads", "vocab_size")},
            **parameter_counts(reference),
        },
        "param_tolerance": PARAM_TOLERANCE,
        "recipe": reference.name,
        "corpora": list(corpora),
        "max_chars": max_chars,
        "seed": seed,
        "evals": evals,
        "eval_batches": eval_batches,
    }
    command = command or "llmedu.cramming.studies.scaling.run_scaling (from Python)"
    results = study_results(command, device, start, config, unigram_cross_entropy=None)
    with tempfile.TemporaryDirectory(prefix="cramming-scaling-") as scratch:
        folders = Path(runs_dir) if runs_dir is not None else Path(scratch)
        for i, e in enumerate(grid, 1):
            say(f"[{i}/{len(grid)}] {e.name}: pretraining for {budget_words(budget_seconds, max_steps)}")
            folder = folders / e.name
            summary = pretrain_recorded(folder, e.name, recipes[e.name], budget, plan[e.name], device)
            if results["unigram_cross_entropy"] is None:  # every run reads the same text with the same tokenizer
                results["unigram_cross_entropy"] = round(unigram_line(folder), 4)
            shape = {**asdict(e), "d_ff": recipes[e.name].model.d_ff}  # size, shape, d_model, n_layers, n_heads
            record = results["runs"][e.name] = {**shape, **run_record(summary, counts[e.name], plan[e.name])}
            write_results(out, results, start)
            say(
                f"[{i}/{len(grid)}] {e.name}: {record['steps']:,} steps, {record['tokens_seen'] / 1e6:.2f}M tokens at "
                f"{record['tokens_per_s']:,.0f} tokens/s, held-out loss {record['val_loss']:.3f} "
                f"({record['wall_seconds']:.0f} s with the evaluations)"
            )
    return results
