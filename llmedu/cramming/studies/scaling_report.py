"""Reading a scaling study (``scaling.py``'s JSON): loss at a common token count, the size and shape gaps,
the table, the verdict in numbers, and the two plots (loss vs tokens seen, loss vs seconds on the clock).

The per-token comparison interpolates each run's held-out history at the token count every run reached (the
fewest-token run's last point; ``loss_at_tokens`` never extrapolates). Read it with the confound that
``scaling.py``'s docstring states: each run's learning rate follows its own budget.

Left out: fits of power laws (three sizes cannot support one).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from .report import check_runs, read_results

__all__ = [
    "budget_words",
    "RECORDED_SCALING",
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

RECORDED_SCALING = Path(__file__).resolve().parents[3] / "data" / "results" / "cramming_scaling_cpu.json"  # lesson 25


def budget_words(budget_seconds, max_steps) -> str:
    """'180 s', '40 steps' or '180 s or 40 steps': a run's budget in words."""
    parts = [f"{budget_seconds:g} s"] if budget_seconds is not None else []
    return " or ".join(parts + ([f"{max_steps} steps"] if max_steps is not None else []))


_KEYS = ("provenance", "config", "unigram_cross_entropy", "runs")
_RUN_KEYS = ("size", "shape", "parameters", "tokens_per_s", "tokens_seen", "val_loss", "val_history")
_POINT_KEYS = ("step", "tokens", "elapsed", "val_loss")


def load_scaling(path) -> dict:
    """The results of ``run_scaling`` read from ``path``; a clear error for a file that is not one."""
    absent = f"no scaling results here (python -m llmedu.cramming scaling --budget 3m --out {path})"
    results = read_results(path, _KEYS, absent, "the output of a scaling study")
    for name, run in check_runs(results, path, _RUN_KEYS).items():
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
    line = f"budget: {budget_words(config.get('budget_seconds'), config.get('max_steps'))} per run"
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
