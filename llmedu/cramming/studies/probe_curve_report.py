"""Reading a probe curve (``probe_curve.run_probe_curve``'s JSON): load, the study's reference rows, where the
gap first reaches its threshold, a computed verdict, a table and a plot. Lesson 25 reads the recorded curve
(``RECORDED_CURVE``) through these.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from .report import RECORDED, load_study, read_results

__all__ = [
    "RECORDED_CURVE",
    "RECORDED_CURVE_HOUR",
    "CONTROL",
    "REFERENCE_ROWS",
    "load_probe_curve",
    "study_references",
    "first_crossing",
    "curve_table",
    "curve_verdict",
    "plot_probe_curve",
    "average_noise",
]

RECORDED_CURVE = Path(__file__).resolve().parents[3] / "data" / "results" / "cramming_probe_curve_cpu_30m.json"
RECORDED_CURVE_HOUR = RECORDED_CURVE.with_name("cramming_probe_curve_cpu_60m.json")  # a 60-minute run's
CONTROL = "random init, linear probe"  # the study's name for the control row
REFERENCE_ROWS = ("TF-IDF + logistic regression", "MiniLM-L6, linear probe")  # study rows worth a line on the plot
_KEYS = ("provenance", "config", "control", "points")
_POINT_KEYS = ("step", "tokens_seen", "seconds", "tasks", "average", "gap")


def load_probe_curve(path) -> dict:
    """The output of ``run_probe_curve`` read from ``path``; a clear error for a file that is not one."""
    results = read_results(
        path, _KEYS, "no probe curve here (run_probe_curve(run, out=...) writes one)", "a probe curve's output"
    )
    control = results["control"]
    if not isinstance(control, dict) or "average" not in control or "tasks" not in control:
        raise ValueError(f"{path} is not a probe curve's output: its control has no task scores")
    if not isinstance(results["points"], list):
        raise ValueError(f"{path} is not a probe curve's output: points is not a list")
    for i, p in enumerate(results["points"]):
        missing = [k for k in _POINT_KEYS if not isinstance(p, dict) or k not in p]
        if missing:
            raise ValueError(f"{path}: point {i} lacks {', '.join(missing)}")
    return results


def study_references(path=RECORDED, rows: Sequence[str] = REFERENCE_ROWS) -> dict[str, float]:
    """{row: task-average accuracy} of a study's JSON (default: lesson 25's recorded run), for the plot's lines.

    Comparable with a curve only when the study used the same tasks and caps (``config`` of both)."""
    study = load_study(path)
    missing = [r for r in rows if r not in study["average"]]
    if missing:
        raise KeyError(f"{path} has no row {missing}; it has {', '.join(study['average'])}")
    return {r: study["average"][r]["mean"] for r in rows}


def first_crossing(points: list[dict], threshold: float) -> tuple[dict | None, bool]:
    """(the first point whose average gap is at least ``threshold``, whether every later point's is too)."""
    for i, p in enumerate(points):
        if p["gap"]["average"] >= threshold:
            return p, all(q["gap"]["average"] >= threshold for q in points[i:])
    return None, False


def _where(p: dict) -> str:
    return (
        f"step {p['step']:,} ({p['seconds'] / 60:.1f} min on the budget's clock, {p['tokens_seen'] / 1e6:.1f}M tokens)"
    )


def curve_verdict(results: dict, threshold: float | None = None) -> str:
    """One sentence computed from the curve: where the probe's gap over random init first reaches ``threshold``
    (default: the curve's own), and whether it holds; or that it does not within the run."""
    threshold = results["config"]["threshold"] if threshold is None else threshold
    points, control = results["points"], results["control"]["average"]["mean"]
    if not points:
        return "No checkpoint has been probed yet."
    pts = 100 * threshold
    last = points[-1]
    best = max(points, key=lambda p: p["gap"]["average"])
    crossing, holds = first_crossing(points, threshold)
    best_gap, last_gap = 100 * best["gap"]["average"], 100 * last["gap"]["average"]
    if crossing is None:
        probed = f"{len(points)} checkpoint{'s' if len(points) > 1 else ''} probed"
        return (
            f"Within this run ({last['seconds'] / 60:.1f} min, {last['tokens_seen'] / 1e6:.1f}M tokens, {probed}) "
            f"the linear probe's task average never leads random init's ({100 * control:.1f}%) by {pts:.1f} "
            f"points: the largest gap is {best_gap:+.1f} points, at {_where(best)}, and the last checkpoint's "
            f"{last_gap:+.1f}."
        )
    if crossing is last:
        after = "the last checkpoint probed"
    elif holds:
        after = "and stays at least that far ahead at every later checkpoint"
    else:
        after = f"but does not hold: the last checkpoint's gap is {last_gap:+.1f} points"
    lr = crossing.get("lr_factor")
    caveat = (
        f" A checkpoint is not a run of that budget: its learning rate had not annealed (lr factor {lr:.2f} there)."
        if lr
        else ""
    )
    return (
        f"The linear probe's task average first leads random init's ({100 * control:.1f}%) by {pts:.1f} points "
        f"or more at {_where(crossing)}: {100 * crossing['average']['mean']:.1f}%, "
        f"{100 * crossing['gap']['average']:+.1f} points, {after} (largest gap {best_gap:+.1f} points, at step "
        f"{best['step']:,}).{caveat}"
    )


def curve_table(results: dict) -> str:
    """One line per checkpoint: step, minutes, tokens, held-out loss, lr factor, probe accuracy per task and
    average (%), gap to random init (points); the control and references below."""
    tasks = results["config"]["tasks"]
    head = f"{'step':>7} {'min':>6} {'tokens':>8} {'val loss':>8} {'lr x':>5}" + "".join(f"{t:>17}" for t in tasks)
    head += f"{'average':>9}{'gap':>7}"
    lines = [head, "-" * len(head)]
    for p in results["points"]:
        loss = "-" if p.get("val_loss") is None else f"{p['val_loss']:.3f}"
        lr = "-" if p.get("lr_factor") is None else f"{p['lr_factor']:.2f}"
        row = f"{p['step']:>7,} {p['seconds'] / 60:>6.1f} {p['tokens_seen'] / 1e6:>7.2f}M {loss:>8} {lr:>5}"
        row += "".join(f"{100 * p['tasks'][t]['test']['mean']:>17.1f}" for t in tasks)
        row += f"{100 * p['average']['mean']:>9.1f}{100 * p['gap']['average']:>+7.1f}"
        lines.append(row)
    c = results["control"]
    row = f"{CONTROL:<36}" + "".join(f"{100 * c['tasks'][t]['test']['mean']:>17.1f}" for t in tasks)
    lines.append(row + f"{100 * c['average']['mean']:>9.1f}")
    for name, value in (results.get("references") or {}).items():
        lines.append(f"{name:<36}" + " " * 17 * len(tasks) + f"{100 * value:>9.1f}")
    return "\n".join(lines)


def average_noise(point: dict) -> float:
    """The binomial standard error of a point's task average: each task's sqrt(p (1 - p) / n_test), in quadrature
    over the tasks, divided by their number. A gap to the control, measured the same way, has about sqrt(2)
    times it (the control's own error, the two taken as independent)."""
    tasks = point["tasks"].values()
    variances = [t["test"]["mean"] * (1 - t["test"]["mean"]) / t["sizes"]["test"] for t in tasks]
    return sum(variances) ** 0.5 / len(variances)


def plot_probe_curve(
    results: dict, axes=None, label: str = "pretrained, linear probe", calibration: bool = True, colour: str = "black"
):
    """Left: the probe's task average (%) against tokens seen in ``colour``, a band of one binomial standard
    error, random init's probe as a line (the threshold above it dotted), the references dashed. Right: each
    task's gap to random init (points), coloured by task. Called again on the same axes with
    ``calibration=False``, another ``label`` and ``colour``, it adds a second run's curve (dotted, square
    markers on the right)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    left, right = axes
    points = results["points"]
    x = [p["tokens_seen"] / 1e6 for p in points]
    ys = [100 * p["average"]["mean"] for p in points]
    noise = [100 * average_noise(p) for p in points]
    marker = "o" if calibration else "s"
    left.plot(x, ys, color=colour, marker=marker, label=f"{label} (band: +-1 s.e.)")
    left.fill_between(x, [y - e for y, e in zip(ys, noise)], [y + e for y, e in zip(ys, noise)], alpha=0.15,
                      color=colour)  # fmt: skip
    if calibration:
        control = 100 * results["control"]["average"]["mean"]
        threshold = 100 * results["config"]["threshold"]
        left.axhline(control, color="grey", label=CONTROL)
        left.axhline(control + threshold, color="grey", ls=":", label=f"random init + {threshold:.0f} points")
        references = (results.get("references") or {}).items()
        for (name, value), c in zip(references, itertools.cycle(("tab:cyan", "tab:purple", "tab:olive"))):
            left.axhline(100 * value, ls="--", color=c, alpha=0.8, label=name)
        right.axhline(0, color="grey", lw=1)
        left.set_xlabel("tokens seen (millions; a checkpoint, not a run of that budget)")
        left.set_ylabel("test accuracy, task average (%)")
        right.set_xlabel("tokens seen (millions)")
        right.set_ylabel("probe minus random init (points)")
        left.set_title("linear probe along pretraining", fontsize=10, loc="left")
        right.set_title("per task", fontsize=10, loc="left")
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    style = "-" if calibration else ":"
    for task, c in zip(results["config"]["tasks"], itertools.cycle(colours)):
        gaps = [100 * p["gap"]["tasks"][task] for p in points]
        right.plot(x, gaps, color=c, ls=style, marker=marker, ms=4, label=f"{task} ({label})")
    for ax in axes:  # below the axes, where they hide no point; long handles show the line styles
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, handlelength=3)
    return axes
