"""Size against shape under one budget: the paper's central figure at our scale (Geiping & Goldstein 2022, sec. 3).

    results = run_scaling(GRIDS["cpu"], parse_budget("3m"), out="data/results/cramming_scaling_cpu.json")
    plot_scaling(results); print(scaling_table(results))      # from scaling_report

Cramming's argument for its recipe (their sec. 3 and figs. 1-2, after the scaling laws of Kaplan et al. 2020,
sec. 3.1): plotted against the tokens it has read, a transformer's MLM loss depends mostly on its size (the
non-embedding parameters) and little on its shape (deep and narrow or shallow and wide) or type. So, under a
wall-clock budget, the question is how many tokens a shape reads per second: pick the size the budget can
feed, then the shape, and every other change, by throughput. Plotted against seconds, size trades against
speed: a larger model learns more per token but reads fewer of them.

The study pretrains every entry of a grid (sizes x shapes) with the crammed recipe (``crammed(**overrides)``)
through ``pretrain`` itself, each under the same budget, on the same data and tokenizer, with the held-out
MLM loss measured outside the clock (``eval_every``), and writes one JSON: per run the architecture, the
parameters (non-embedding and total, ``llmedu.models.counting``), FLOPs per token, tokens/s, and the
held-out history as (step, tokens seen, seconds on the clock, loss); beside them the unigram line of the
held-out text (``study.unigram_line``, the calibration of the rest of the capstone).

The default grid at the CPU shape (``GRIDS["cpu"]``; d_model 128, 4 layers, vocabulary 4096 is
``crammed()``'s) has three sizes, about 0.3x, 1.1x and 4.5x the CPU shape's 677k non-embedding parameters,
each in two shapes with the same layers x width^2 (so the same weights in the blocks): deep and narrow, 8
layers, against shallow and wide, 2 layers at twice the width. Heads are 32 wide where the width allows.
``check_grid`` refuses a grid whose shapes of one size differ by more than ``PARAM_TOLERANCE`` in
non-embedding parameters.

Evaluations: a run is evaluated every ``eval_every`` steps, and runs differ ten-fold in speed. A short probe of
each model's speed (``probe_tokens_per_s``, a few micro-batches; it only places the evaluations) sets each
run's ``eval_every`` so that the slowest run is evaluated about ``evals`` times and faster runs more often (up
to 4x), so that every curve has points below the token count that all runs reach, where ``loss_at_tokens``
interpolates. The last point of each history is the final evaluation at the end of the budget.

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
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import runtime
from ..data.packing import MLMBatches
from ..hardware import machine_summary
from ..models import MaskedLM
from ..models.counting import count_parameters
from .pretrain import CORPORA, PretrainRun, mlm_loss_fn, prepare_data, pretrain
from .recipe import TINY_SHAPE, BudgetClock, Recipe, budget_accumulation, crammed
from .scaling_report import budget_words
from .study import unigram_line

__all__ = [
    "PARAM_TOLERANCE",
    "GridEntry",
    "GRIDS",
    "BASES",
    "parse_entry",
    "parameter_counts",
    "check_grid",
    "probe_tokens_per_s",
    "plan_evaluations",
    "run_scaling",
]

PARAM_TOLERANCE = 0.10  # the shapes of one size: non-embedding parameters within 10% (largest / smallest - 1)
MAX_EXTRA_EVALS = 4  # a fast run is evaluated at most this many times as often as the slowest


@dataclass(frozen=True)
class GridEntry:
    """One configuration of the study: a size (the colour of its curve) in a shape (the line style)."""

    size: str  # the group of about equal non-embedding parameters: "small", "medium", "large"
    shape: str  # "deep" (narrow) or "wide" (shallow); any label, the line style follows it
    d_model: int
    n_layers: int
    n_heads: int

    def __post_init__(self):
        for label, value in (("size", self.size), ("shape", self.shape)):
            if not isinstance(value, str) or not value or any(c in value for c in "=,- "):
                raise ValueError(f"{label} must be a non-empty label without '=', ',', '-' or spaces, got {value!r}")
        for name in ("d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{self.name}: {name} must be an int >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"{self.name}: n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                f"every head must be d_model / n_heads wide"
            )

    @property
    def name(self) -> str:
        return f"{self.size}-{self.shape}"

    def overrides(self) -> dict:
        """The fields of ``crammed(**overrides)`` this entry sets."""
        return {"d_model": self.d_model, "n_layers": self.n_layers, "n_heads": self.n_heads}


# The base shape each grid is built around: overrides of crammed() (the batch, the vocabulary).
BASES: dict[str, dict] = {"cpu": {}, "tiny": dict(TINY_SHAPE)}
# Per size, two shapes with the same n_layers * d_model^2: 8 layers against 2 layers at twice the width.
GRIDS: dict[str, tuple[GridEntry, ...]] = {
    "cpu": (
        GridEntry("small", "deep", 48, 8, 2),  # 192k non-embedding parameters (0.28x the CPU shape's 677k)
        GridEntry("small", "wide", 96, 2, 3),  # 198k
        GridEntry("medium", "deep", 96, 8, 3),  # 752k (1.1x)
        GridEntry("medium", "wide", 192, 2, 6),  # 780k
        GridEntry("large", "deep", 192, 8, 6),  # 2.99M (4.4x)
        GridEntry("large", "wide", 384, 2, 12),  # 3.10M
    ),
    "tiny": (  # for smoke runs, around TINY_SHAPE (d 64, 2 layers, vocabulary 1024)
        GridEntry("small", "deep", 32, 8, 2),  # 85k non-embedding parameters
        GridEntry("small", "wide", 64, 2, 2),  # 87k: TINY_SHAPE itself
        GridEntry("large", "deep", 64, 8, 2),  # 334k
        GridEntry("large", "wide", 128, 2, 4),  # 346k
    ),
}


def parse_entry(text: str, grid: str = "cpu") -> GridEntry:
    """A grid entry from the command line: a name of ``GRIDS[grid]`` ("medium-deep"), or
    "SIZE-SHAPE=D_MODEL,N_LAYERS,N_HEADS" for one of your own ("huge-wide=512,2,16")."""
    if grid not in GRIDS:
        raise ValueError(f"unknown grid {grid!r}; available: {', '.join(GRIDS)}")
    known = {e.name: e for e in GRIDS[grid]}
    if text in known:
        return known[text]
    if "=" not in text:
        raise ValueError(
            f"unknown grid entry {text!r}: the {grid} grid has {', '.join(known)}; "
            f"or write SIZE-SHAPE=D_MODEL,N_LAYERS,N_HEADS, e.g. huge-wide=512,2,16"
        )
    name, spec = text.split("=", 1)
    size, _, shape = name.partition("-")
    numbers = spec.split(",")
    if not shape or len(numbers) != 3 or not all(n.strip().isdigit() for n in numbers):
        raise ValueError(
            f"cannot read the grid entry {text!r}: write SIZE-SHAPE=D_MODEL,N_LAYERS,N_HEADS, e.g. huge-wide=512,2,16"
        )
    d_model, n_layers, n_heads = (int(n) for n in numbers)
    return GridEntry(size, shape, d_model, n_layers, n_heads)


def parameter_counts(recipe: Recipe) -> dict[str, int]:
    """{"total", "non_embedding"} of the MaskedLM the recipe builds (``count_parameters``; the tied decoder
    counts once, with the embeddings)."""
    model = MaskedLM(recipe.model)
    return {"total": count_parameters(model), "non_embedding": count_parameters(model, embeddings=False)}


def check_grid(grid: Sequence[GridEntry], base: dict | None = None, tolerance: float = PARAM_TOLERANCE) -> dict:
    """{name: parameter_counts} of the grid's models; a clear error for a grid that breaks the rules.

    The rules: at least one entry, distinct names, and the shapes of one size within ``tolerance`` of each
    other in non-embedding parameters (largest / smallest - 1), so that "same size" means something.
    """
    base = dict(base or {})
    if not grid:
        raise ValueError("the grid is empty: give at least one entry")
    names = [e.name for e in grid]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"the grid names {', '.join(repeated)} more than once")
    counts = {e.name: parameter_counts(crammed(**{**base, **e.overrides()})) for e in grid}
    for size in dict.fromkeys(e.size for e in grid):
        members = {e.name: counts[e.name]["non_embedding"] for e in grid if e.size == size}
        low, high = min(members.values()), max(members.values())
        if high / low - 1 > tolerance:
            listed = ", ".join(f"{n} {p:,}" for n, p in members.items())
            raise ValueError(
                f"the shapes of size {size!r} differ by {high / low - 1:.0%} in non-embedding parameters "
                f"({listed}), more than the tolerance of {tolerance:.0%}: change a width or a depth, or call "
                f"them different sizes"
            )
    return counts


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
    every run, else ``plan_evaluations`` sets it per run from ``evals``. ``runs_dir`` keeps the run folders
    (default: a temporary folder, removed at the end). The JSON is rewritten after every run, so a
    stopped study keeps what it finished. Progress lines go to ``stream`` (default stdout).
    """
    stream = stream or sys.stdout
    say = (lambda *a: print(*a, file=stream, flush=True)) if progress else (lambda *a: None)
    base = dict(base or {})
    # checked before anything runs or is written: the budget, the grid, the evaluation settings
    if budget_seconds is None and max_steps is None:
        raise ValueError("give a budget in seconds, max_steps, or both")
    if budget_seconds is not None and not budget_seconds > 0:
        raise ValueError(f"the budget must be a positive number of seconds, got {budget_seconds}")
    if eval_every is not None and (not isinstance(eval_every, int) or eval_every < 1):
        raise ValueError(f"eval_every must be an int >= 1, got {eval_every!r}")
    if not isinstance(evals, int) or evals < 1:
        raise ValueError(f"evals must be an int >= 1, got {evals!r}")
    counts = check_grid(grid, base)
    recipes = {e.name: crammed(**{**base, **e.overrides()}) for e in grid}
    reference = crammed(**base)
    device = device or runtime.device()
    start = datetime.datetime.now(datetime.timezone.utc)

    say(f"Preparing the data once for all {len(grid)} runs (cached after the first time); no clock is running.")
    tokenizer, train_rows, _ = prepare_data(reference, corpora, max_chars, tokenizer_chars, progress=False)
    plan = _plan(recipes, train_rows, tokenizer, device, budget_seconds, max_steps, evals, eval_every, seed)
    for e in grid:
        say(
            f"  {e.name:<14} d {e.d_model} x {e.n_layers} layers, {counts[e.name]['non_embedding']:,} non-embedding "
            f"parameters: evaluated every {plan[e.name]} step{'s' if plan[e.name] > 1 else ''}"
        )

    results = {
        "provenance": {
            "command": command or "llmedu.cramming.scaling.run_scaling (from Python)",
            "date": start.strftime("%Y-%m-%d"),
            "started_utc": start.strftime("%H:%M:%S"),
            "machine": machine_summary(device),
            "torch": torch.__version__,
        },
        "config": {
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
        },
        "unigram_cross_entropy": None,
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="cramming-scaling-") as scratch:
        folders = Path(runs_dir) if runs_dir is not None else Path(scratch)
        for i, e in enumerate(grid, 1):
            say(f"[{i}/{len(grid)}] {e.name}: pretraining for {budget_words(budget_seconds, max_steps)}")
            folder = folders / e.name
            run = PretrainRun(recipes[e.name], budget_seconds, max_steps, tuple(corpora), max_chars, seed)
            summary = pretrain(
                folder,
                run,
                device=device,
                tokenizer_chars=tokenizer_chars,
                checkpoint_every=10**9,  # only the final state: the study keeps no intermediate checkpoint
                eval_batches=eval_batches,
                eval_every=plan[e.name],
                progress=False,
            )
            if summary["val_loss"] is None:
                raise ValueError(
                    f"{e.name}: the held-out text is smaller than one micro-batch of {recipes[e.name].micro_batch} rows, "
                    f"so the study has no loss to plot: use more text (max_chars) or a smaller micro_batch"
                )
            if results["unigram_cross_entropy"] is None:  # every run reads the same text with the same tokenizer
                results["unigram_cross_entropy"] = round(unigram_line(folder), 4)
            record = _record(e, recipes[e.name], summary, counts[e.name], plan[e.name])
            results["runs"][e.name] = record
            results["provenance"]["wall_seconds"] = round(
                (datetime.datetime.now(datetime.timezone.utc) - start).total_seconds(), 1
            )
            _write(out, results)
            say(
                f"[{i}/{len(grid)}] {e.name}: {record['steps']:,} steps, {record['tokens_seen'] / 1e6:.2f}M tokens at "
                f"{record['tokens_per_s']:,.0f} tokens/s, held-out loss {record['val_loss']:.3f} "
                f"({record['wall_seconds']:.0f} s with the evaluations)"
            )
    return results


def _plan(recipes, train_rows, tokenizer, device, budget_seconds, max_steps, evals, eval_every, seed) -> dict:
    """{name: eval_every}: the given interval for all, or one per run from a probe of its speed."""
    if eval_every is not None:
        return dict.fromkeys(recipes, eval_every)
    if budget_seconds is None:  # steps alone: every run reads the same tokens
        return dict.fromkeys(recipes, max(1, max_steps // evals))
    speeds, steps = {}, {}
    for name, recipe in recipes.items():
        masking = dict(rate=recipe.mask_rate, mask=recipe.mask_fraction, random=recipe.random_fraction)
        batches = MLMBatches(train_rows, recipe.micro_batch, tokenizer, seed=seed, **masking)
        speeds[name] = probe_tokens_per_s(recipe, batches, device)
        steps[name] = _expected_steps(recipe, budget_seconds, speeds[name])
        if max_steps is not None:
            steps[name] = min(steps[name], max_steps)
    return plan_evaluations(speeds, steps, evals)


def _record(entry: GridEntry, recipe: Recipe, summary: dict, counts: dict, eval_every: int) -> dict:
    """One run of the study as plain data; the held-out history gains the tokens read by each evaluation."""
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
        "size": entry.size,
        "shape": entry.shape,
        "d_model": entry.d_model,
        "n_layers": entry.n_layers,
        "n_heads": entry.n_heads,
        "d_ff": recipe.model.d_ff,
        "parameters": dict(counts),
        "flops_per_token": summary["flops_per_token"],
        "precision": summary["precision"],
        "tokens_per_s": summary["tokens_per_s"],
        "steps": summary["steps"],
        "stop_reason": summary["stop_reason"],
        "elapsed_seconds": summary["elapsed_seconds"],
        "wall_seconds": summary["wall_seconds"],
        "tokens_seen": summary["tokens_seen"],
        "corpus_tokens": summary["corpus_tokens"],
        "passes": summary["passes"],
        "val_loss": summary["val_loss"],
        "eval_every": eval_every,
        "val_history": history,
    }


def _write(out, results: dict) -> None:
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1))


# -- reading the results -------------------------------------------------------------------------
