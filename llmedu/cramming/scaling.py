"""Size against shape under one budget: the paper's central figure at our scale (Geiping & Goldstein 2022, sec. 3).

    results = run_scaling(GRIDS["cpu"], parse_budget("3m"), out="data/results/cramming_scaling_cpu.json")
    plot_scaling(results); print(scaling_table(results))

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
import statistics
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
from .study import unigram_line

__all__ = [
    "RECORDED_SCALING",
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
    "load_scaling",
    "loss_at_tokens",
    "common_tokens",
    "size_and_shape_gaps",
    "scaling_table",
    "scaling_verdict",
    "plot_loss_vs_tokens",
    "plot_loss_vs_time",
    "plot_scaling",
]

RECORDED_SCALING = Path(__file__).resolve().parents[2] / "data" / "results" / "cramming_scaling_cpu.json"  # lesson 22
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
            say(f"[{i}/{len(grid)}] {e.name}: pretraining for {_budget_words(budget_seconds, max_steps)}")
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


def _budget_words(budget_seconds, max_steps) -> str:
    parts = [f"{budget_seconds:g} s"] if budget_seconds is not None else []
    return " or ".join(parts + ([f"{max_steps} steps"] if max_steps is not None else []))


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
_KEYS = ("provenance", "config", "unigram_cross_entropy", "runs")
_RUN_KEYS = ("size", "shape", "parameters", "tokens_per_s", "tokens_seen", "val_loss", "val_history")
_POINT_KEYS = ("step", "tokens", "elapsed", "val_loss")


def load_scaling(path) -> dict:
    """The results of ``run_scaling`` read from ``path``; a clear error for a file that is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no scaling results here (python -m llmedu.cramming scaling --budget 3m --out {path})"
        )
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON: {error}") from None
    missing = [k for k in _KEYS if not isinstance(results, dict) or k not in results]
    if missing:
        raise ValueError(f"{path} is not the output of a scaling study: it lacks {', '.join(missing)}")
    if not isinstance(results["runs"], dict) or not results["runs"]:
        raise ValueError(f"{path} holds no finished run")
    for name, run in results["runs"].items():
        lacking = [k for k in _RUN_KEYS if not isinstance(run, dict) or k not in run]
        if lacking:
            raise ValueError(f"{path}: the run {name!r} lacks {', '.join(lacking)}")
        if not run["val_history"] or any(
            not isinstance(p, dict) or any(k not in p for k in _POINT_KEYS) for p in run["val_history"]
        ):
            raise ValueError(f"{path}: the run {name!r} has no held-out history of {', '.join(_POINT_KEYS)}")
    return results


def loss_at_tokens(val_history: Sequence[dict], tokens: float) -> float | None:
    """The held-out loss after ``tokens`` tokens, linearly interpolated between evaluations; None outside them."""
    points = sorted((p["tokens"], p["val_loss"]) for p in val_history)
    if not points or not points[0][0] <= tokens <= points[-1][0]:
        return None
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if t0 <= tokens <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return points[0][1]  # a single evaluation, at exactly ``tokens``


def common_tokens(results: dict) -> int:
    """The token count every run reached: the last evaluation of the run that read the fewest tokens."""
    return min(run["val_history"][-1]["tokens"] for run in results["runs"].values())


def size_and_shape_gaps(results: dict, tokens: float | None = None) -> dict:
    """The claim in numbers, at a token count all runs reached (default ``common_tokens``).

    ``shape_spread``: per size, the largest minus the smallest loss of its shapes; ``size_steps``: between
    consecutive sizes (in grid order), the drop of their mean loss over shapes. Shape matters less than
    size per token when every spread is smaller than every step.
    """
    tokens = common_tokens(results) if tokens is None else tokens
    by_size: dict[str, dict[str, float]] = {}
    for run in results["runs"].values():
        loss = loss_at_tokens(run["val_history"], tokens)
        if loss is not None:
            by_size.setdefault(run["size"], {})[run["shape"]] = loss
    spread = {s: max(v.values()) - min(v.values()) for s, v in by_size.items() if len(v) > 1}
    sizes = list(by_size)
    steps = {
        f"{a} -> {b}": statistics.fmean(by_size[a].values()) - statistics.fmean(by_size[b].values())
        for a, b in zip(sizes, sizes[1:])
    }
    return {"tokens": tokens, "loss": by_size, "shape_spread": spread, "size_steps": steps}


def scaling_verdict(results: dict) -> str:
    """The claim read from the numbers: at the common token count, the gap between the shapes of each size
    against the step between sizes; at the end of the budget, the lowest loss and the fastest run."""
    gaps = size_and_shape_gaps(results)
    runs = results["runs"]
    lines = [f"at {gaps['tokens'] / 1e6:.2f}M tokens, the most that every run read (interpolated held-out loss):"]
    if gaps["shape_spread"]:
        spread = ", ".join(f"{size} {gap:.3f}" for size, gap in gaps["shape_spread"].items())
        lines.append(f"  the shapes of one size differ by (nats): {spread}")
    if gaps["size_steps"]:
        steps = ", ".join(f"{pair} {step:+.3f}" for pair, step in gaps["size_steps"].items())
        lines.append(f"  one size up lowers the mean loss by (nats): {steps}")
    if gaps["shape_spread"] and gaps["size_steps"]:
        widest, narrowest = max(gaps["shape_spread"].values()), min(gaps["size_steps"].values())
        lines.append(
            f"  every shape gap smaller than every size step: {'yes' if widest < narrowest else 'no'} "
            f"(widest shape gap {widest:.3f}, smallest size step {narrowest:+.3f})"
        )
    best = min(runs, key=lambda n: runs[n]["val_loss"])
    fastest = max(runs, key=lambda n: runs[n]["tokens_per_s"])
    lines.append(
        f"at the end of the budget: lowest held-out loss {best} ({runs[best]['val_loss']:.3f}, "
        f"{runs[best]['tokens_seen'] / 1e6:.2f}M tokens); most tokens/s {fastest} ({runs[fastest]['tokens_per_s']:,.0f})"
    )
    for size in dict.fromkeys(r["size"] for r in runs.values()):
        members = {n: r for n, r in runs.items() if r["size"] == size}
        if len(members) > 1:
            quick = max(members, key=lambda n: members[n]["tokens_per_s"])
            low = min(members, key=lambda n: members[n]["val_loss"])
            lines.append(f"  {size}: faster shape {quick}, lower final loss {low}")
    return "\n".join(lines)


def scaling_table(results: dict) -> str:
    """One line per run: shape, parameters, speed, tokens read in the budget, final loss, and the loss at the
    token count all runs reached (interpolated), beside the unigram line."""
    config, runs = results["config"], results["runs"]
    tokens = common_tokens(results)
    smallest = min(runs, key=lambda n: runs[n]["val_history"][-1]["tokens"])
    ref = config.get("reference") or {}
    per = ref.get("non_embedding")
    width = max(len(n) for n in runs) + 2
    at = f"loss @ {tokens / 1e6:.2f}M"
    head = (
        f"{'config':<{width}}{'d x layers (heads)':>19}{'non-emb':>11}{'x base':>8}{'total':>11}"
        f"{'tokens/s':>10}{'tokens read':>13}{'final loss':>12}{at:>16}"
    )
    lines = [head, "-" * len(head)]
    for name, r in runs.items():
        loss = loss_at_tokens(r["val_history"], tokens)
        shape = f"{r.get('d_model', '?')} x {r.get('n_layers', '?')} ({r.get('n_heads', '?')})"
        ratio = f"{r['parameters']['non_embedding'] / per:.2f}" if per else "-"
        lines.append(
            f"{name:<{width}}{shape:>19}{r['parameters']['non_embedding']:>11,}{ratio:>8}{r['parameters']['total']:>11,}"
            f"{r['tokens_per_s']:>10,.0f}{r['tokens_seen'] / 1e6:>12.2f}M{r['val_loss']:>12.3f}"
            f"{'-' if loss is None else f'{loss:.3f}':>16}"
        )
    lines.append("")
    line = f"budget: {_budget_words(config.get('budget_seconds'), config.get('max_steps'))} per run"
    if per:
        line += f"; 'x base': non-embedding parameters over those of d {ref['d_model']} x {ref['n_layers']} layers ({per:,})"
    lines += [
        line,
        f"unigram line (word frequencies only): {results['unigram_cross_entropy']:.3f} nats; "
        f"'{at}': interpolated at the last evaluation of {smallest}, the run that read the fewest tokens",
        "caveats: minutes on a CPU, one seed: a small-scale check, not a scaling law; each run's learning rate "
        "follows its own budget, so at a common token count a fast run is earlier in its schedule than a slow one",
    ]
    return "\n".join(lines)


# -- the plots -----------------------------------------------------------------------------------
_STYLES = ("-", "--", ":", "-.")


def _styles(results: dict) -> tuple[dict, dict]:
    """{size: colour}, {shape: line style}, in the order the grid lists them."""
    import matplotlib.pyplot as plt

    runs = results["runs"].values()
    sizes = list(dict.fromkeys(r["size"] for r in runs))
    shapes = list(dict.fromkeys(r["shape"] for r in runs))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return (
        {s: colours[i % len(colours)] for i, s in enumerate(sizes)},
        {s: _STYLES[i % len(_STYLES)] for i, s in enumerate(shapes)},
    )


def _plot(results: dict, ax, x: str, scale: float):
    colour, style = _styles(results)
    for name, r in results["runs"].items():
        h = r["val_history"]
        label = (
            f"{name}: {r.get('d_model', '?')} x {r.get('n_layers', '?')}, {r['parameters']['non_embedding'] / 1e6:.2f}M"
        )
        ax.plot(
            [p[x] / scale for p in h],
            [p["val_loss"] for p in h],
            color=colour[r["size"]],
            ls=style[r["shape"]],
            marker=".",
            ms=4,
            label=label,
        )
    ax.axhline(results["unigram_cross_entropy"], color="grey", ls=":", lw=1)
    ax.text(
        ax.get_xlim()[0],
        results["unigram_cross_entropy"],
        " unigram line: word frequencies only",
        va="bottom",
        fontsize=8,
        color="grey",
    )
    ax.set_ylabel("held-out MLM loss (nats per masked token)")
    return ax


def plot_loss_vs_tokens(results: dict, ax=None):
    """Held-out loss against tokens read (log scale): colour = size, line style = shape; the dashed
    vertical line is the token count every run reached."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    ax.set_xscale("log")
    _plot(results, ax, "tokens", 1.0)
    ax.axvline(common_tokens(results), color="grey", lw=0.8, ls="--")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 1, 2, 5 per decade: labels at any range
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 200k, 1M, 5M
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("tokens read (log scale)")
    ax.set_title("per token: size matters, shape little?")
    ax.legend(fontsize=7)
    return ax


def plot_loss_vs_time(results: dict, ax=None):
    """Held-out loss against seconds of the budget's clock (evaluations excluded): size against speed."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    _plot(results, ax, "elapsed", 1.0)
    ax.set_xlabel("seconds of training (the budget's clock)")
    ax.set_title("per second: size against speed")
    ax.legend(fontsize=7)
    return ax


def plot_scaling(results: dict, axes=None):
    """Both plots side by side, on the same loss axis."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    plot_loss_vs_tokens(results, axes[0])
    plot_loss_vs_time(results, axes[1])
    axes[1].get_legend().remove()
    return axes
