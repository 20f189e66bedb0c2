"""Reading a study's JSON (``study.run_study``): the headline, the tables and the plots of lesson 25.

``run_study`` writes one JSON: the pretraining summaries, and per task and model the rate chosen on
dev, the test scores over seeds and the label-efficiency curve. This module turns it into what a
reader needs to judge the result:

* ``headline``: the study's figure: the pretrained encoder minus random init on the task average,
  each at its own dev-chosen rate (best against best), per seed, then mean and spread;
* ``task_table``: every model on every task as mean +- standard deviation over seeds, with the
  rate dev chose, calibration rows included, and the task average;
* ``reference_table``: the pretrained encoder between the floor (random init) and a reference (MiniLM
  fine-tuned under the same protocol), with its gap to each and their 95% intervals;
* ``plot_pretraining``: the held-out MLM loss against the budget's minutes, beside the unigram line (the
  loss of a model that knows only word frequencies);
* ``plot_label_efficiency``: test accuracy against labels per task, fine-tuned models as curves
  (mean, min-max band over seeds), the calibration rows as horizontal lines at the full label count.

``load_study`` reads the file and says what is missing when it is not a study's output.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..evaluate import summarize, task_average
from .significance import paired_gap

__all__ = [
    "RECORDED",
    "RECORDED_FIVE_SEEDS",
    "RECORDED_WIDE",
    "per_seed_average",
    "load_study",
    "headline",
    "task_table",
    "budget_table",
    "reference_table",
    "pretraining_table",
    "plot_pretraining",
    "plot_label_efficiency",
]

RECORDED = Path(__file__).resolve().parents[3] / "data" / "results" / "cramming_study_cpu_30m.json"  # lesson 25's run
# the same protocol after an hour of pretraining (its control rows borrowed from RECORDED's)
RECORDED_HOUR = RECORDED.with_name("cramming_study_cpu_60m.json")
# both, with seeds 3 and 4 added to their fine-tuned rows (more_seeds.py; the control's new seeds measured once)
RECORDED_FIVE_SEEDS = {
    "30 min": RECORDED.with_name("cramming_study_cpu_30m_5seeds.json"),
    "60 min": RECORDED.with_name("cramming_study_cpu_60m_5seeds.json"),
}
# both again, their sweep widened to 1e-4..3.2e-3 for every fine-tuned row (widen_sweep.py)
RECORDED_WIDE = {label: path.with_name(path.stem + "_wide.json") for label, path in RECORDED_FIVE_SEEDS.items()}
# both widened studies with MiniLM fine-tuned under their protocol added as a row (minilm_row.py)
RECORDED_MINILM = {label: path.with_name(path.stem + "_minilm.json") for label, path in RECORDED_WIDE.items()}
_KEYS = ("config", "pretraining", "tasks", "average")
CALIBRATION = ("majority class", "TF-IDF + logistic regression")


def read_results(path, keys, absent: str, kind: str) -> dict:
    """The JSON object at ``path``, which must hold ``keys``: a clear error for a missing file (``absent``
    says what is missing and how to make it), a file that is not JSON, or one that is not ``kind``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {absent}")
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON: {error}") from None
    missing = [k for k in keys if not isinstance(results, dict) or k not in results]
    if missing:
        raise ValueError(f"{path} is not {kind}: it lacks {', '.join(missing)}")
    return results


def check_runs(results: dict, path, run_keys) -> dict:
    """``results["runs"]``: a non-empty mapping of run name -> dict holding ``run_keys``; else a clear error."""
    if not isinstance(results["runs"], dict) or not results["runs"]:
        raise ValueError(f"{path} holds no finished run")
    for name, run in results["runs"].items():
        lacking = [k for k in run_keys if not isinstance(run, dict) or k not in run]
        if lacking:
            raise ValueError(f"{path}: the run {name!r} lacks {', '.join(lacking)}")
    return results["runs"]


def load_study(path) -> dict:
    """The results of ``run_study`` read from ``path``; a clear error for a file that is not one."""
    results = read_results(
        path, _KEYS, "no study results here (python -m llmedu.cramming evaluate --out ...)", "a study's output"
    )
    if not results["tasks"]:
        raise ValueError(f"{path} holds no finished task")
    return results


def per_seed_average(results: dict, model: str) -> list[float]:
    """A model's task average for each seed (the headline's unit), from its test scores on every task."""
    tasks = results["tasks"].values()
    for t in tasks:
        if model not in t["models"]:
            raise KeyError(f"no model {model!r} in the study; it has {', '.join(t['models'])}")
    return task_average({name: t["models"][model] for name, t in results["tasks"].items()})["scores"]


def headline(results: dict, pretrained: str = "crammed", control: str = "random init") -> dict:
    """Task average of ``pretrained`` minus ``control``, per seed (both at their dev-chosen rates), and the
    paired t-test of those gaps (``significance.paired_gap``; None with one seed)."""
    ours, theirs = per_seed_average(results, pretrained), per_seed_average(results, control)
    if len(ours) != len(theirs):
        raise ValueError(f"{pretrained!r} has {len(ours)} seeds and {control!r} {len(theirs)}: pair them first")
    gaps = [a - b for a, b in zip(ours, theirs)]
    return {
        "tasks": list(results["tasks"]),
        pretrained: statistics.fmean(ours),
        control: statistics.fmean(theirs),
        "gap_per_seed": gaps,
        "gap": statistics.fmean(gaps),
        "gap_std": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
        "paired": paired_gap(gaps) if len(gaps) > 1 else None,
    }


def _cell(result: dict) -> str:
    t = result["test"]
    return f"{100 * t['mean']:5.1f} +- {100 * t['std']:3.1f}"


def task_table(results: dict) -> str:
    """Models x tasks: test accuracy (%) mean +- std over seeds, the rate dev chose, and the task average."""
    tasks = list(results["tasks"])
    models = list(next(iter(results["tasks"].values()))["models"])
    width = max(len(m) for m in models) + 2
    head = f"{'model':<{width}}" + "".join(f"{t:>24}" for t in tasks) + f"{'average':>16}"
    lines = [head, "-" * len(head)]
    for m in models:
        row = f"{m:<{width}}"
        for t in tasks:
            r = results["tasks"][t]["models"][m]
            rate = "" if r["lr"] is None else f" ({r['lr']:.0e})"
            row += f"{_cell(r) + rate:>24}"
        avg = results["average"].get(m)
        row += f"{100 * avg['mean']:9.1f} +- {100 * avg['std']:3.1f}" if avg else f"{'-':>16}"
        lines.append(row)
    return "\n".join(lines)


def _shared_rows(studies: dict[str, dict], rows) -> tuple[dict, list[str]]:
    """(the first study, its tasks), once every study was scored on those tasks and holds the same test scores in
    ``rows`` (as when borrowed from one study): else the rows would be different baselines, a clear error."""
    first = next(iter(studies.values()))
    tasks = list(first["tasks"])
    for label, results in studies.items():
        if list(results["tasks"]) != tasks:
            raise ValueError(f"{label!r} was scored on {list(results['tasks'])}, the first study on {tasks}")
        for row in rows:
            if any(
                results["tasks"][t]["models"][row]["test"]["scores"]
                != first["tasks"][t]["models"][row]["test"]["scores"]
                for t in tasks
            ):
                raise ValueError(f"{label!r} has other {row!r} scores than the first study: compare each alone")
    return first, tasks


def budget_table(studies: dict[str, dict], pretrained: str = "crammed", control: str = "random init") -> str:
    """Studies of one recipe at several budgets (``{label: results}``), one line each: its pretraining
    (minutes, tokens read, passes, held-out MLM loss), the pretrained row's test accuracy (%) per task and on
    average, and the headline gap to the control (points, mean +- std over seeds). The control's line comes
    last; every study must hold the same control scores (as when one borrowed it from another), else the
    gaps would be measured against different baselines and a clear error says so."""
    first, tasks = _shared_rows(studies, (control,))
    head = f"{'budget':<10}{'min':>6}{'tokens':>8}{'passes':>8}{'loss':>7}" + "".join(f"{t:>18}" for t in tasks)
    head += f"{'average':>15}{'gap (points)':>16}"
    lines = [head, "-" * len(head)]
    for label, results in studies.items():
        s = results["pretraining"][pretrained]["summary"]
        row = f"{label:<10}{s['elapsed_seconds'] / 60:>6.1f}{s['tokens_seen'] / 1e6:>7.1f}M{s['passes']:>8.2f}"
        row += f"{s['val_loss']:>7.3f}" + "".join(
            f"{_cell(results['tasks'][t]['models'][pretrained]):>18}" for t in tasks
        )
        average = summarize(per_seed_average(results, pretrained))
        h = headline(results, pretrained, control)
        row += f"{100 * average['mean']:>8.1f} +- {100 * average['std']:3.1f}"
        lines.append(row + f"{100 * h['gap']:>+9.1f} +- {100 * h['gap_std']:3.1f}")
    average = summarize(per_seed_average(first, control))
    row = f"{control:<39}" + "".join(f"{_cell(first['tasks'][t]['models'][control]):>18}" for t in tasks)
    lines.append(row + f"{100 * average['mean']:>8.1f} +- {100 * average['std']:3.1f}")
    return "\n".join(lines)


def _gap(results: dict, model: str, minus: str) -> str:
    """``model`` minus ``minus`` on the task average, paired by seed: mean [95% interval], in points."""
    t = paired_gap([a - b for a, b in zip(per_seed_average(results, model), per_seed_average(results, minus))])
    low, high = t["interval95"]
    return f"{100 * t['mean']:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def reference_table(
    studies: dict[str, dict], pretrained: str = "crammed", floor: str = "random init", reference: str = "MiniLM-L6"
) -> str:
    """The pretrained row of each study (``{label: results}``) between the floor (random init) and a reference
    (MiniLM fine-tuned under the same protocol): test accuracy (%) per task and on average, mean +- std over
    seeds, and on the average the gaps to both, paired by seed: mean [95% t interval], in points. The floor and
    the reference must hold the same scores in every study (borrowed, or read from one journal)."""
    first, tasks = _shared_rows(studies, (floor, reference))
    width = max(len(m) for m in (*(f"{pretrained}, {label}" for label in studies), floor, reference)) + 2
    head = f"{'model':<{width}}" + "".join(f"{t:>18}" for t in tasks) + f"{'average':>15}"
    head += f"{f'vs {floor}':>24}{f'vs {reference}':>24}"
    lines = [head, "-" * len(head)]

    def line(name: str, results: dict, model: str, gaps: tuple[str, str]) -> str:
        row = f"{name:<{width}}" + "".join(f"{_cell(results['tasks'][t]['models'][model]):>18}" for t in tasks)
        average = summarize(per_seed_average(results, model))
        return row + f"{100 * average['mean']:>8.1f} +- {100 * average['std']:3.1f}" + "".join(f"{g:>24}" for g in gaps)

    lines.append(line(floor, first, floor, ("", "")))
    for label, results in studies.items():
        gaps = (_gap(results, pretrained, floor), _gap(results, pretrained, reference))
        lines.append(line(f"{pretrained}, {label}", results, pretrained, gaps))
    lines.append(line(reference, first, reference, (_gap(first, reference, floor), "")))
    return "\n".join(line.rstrip() for line in lines)


def pretraining_table(results: dict) -> str:
    """One line per pretraining run: budget, steps, tokens, passes over the data, loss vs the unigram line."""
    lines = []
    for name, p in results["pretraining"].items():
        s = p["summary"] or {}
        last = s.get("val_loss") or float("nan")
        lines.append(
            f"{name}: {s.get('steps', 0):,} steps in {s.get('elapsed_seconds', 0) / 60:.1f} min, "
            f"{s.get('tokens_seen', 0) / 1e6:.1f}M tokens ({s.get('passes', 0):.2f} passes over "
            f"{s.get('corpus_tokens', 0) / 1e6:.2f}M), held-out MLM loss {last:.3f} "
            f"against the unigram line {p['unigram_cross_entropy']:.3f} nats"
        )
    return "\n".join(lines)


def plot_pretraining(results: dict, ax=None):
    """Held-out MLM loss against the budget's clock per run, with each run's unigram line dashed.

    The clock is the trainer's (the held-out evaluations are outside it), so the x-axis is the budget.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    for name, p in results["pretraining"].items():
        history = (p["summary"] or {}).get("val_history") or []
        if not history:
            continue
        (line,) = ax.plot([h["elapsed"] / 60 for h in history], [h["val_loss"] for h in history], label=name)
        ax.axhline(p["unigram_cross_entropy"], ls="--", color=line.get_color(), alpha=0.7)
        ax.text(0, p["unigram_cross_entropy"], " unigram line: word frequencies only", va="bottom", fontsize=8)
    ax.set_xlabel("minutes of the budget")
    ax.set_ylabel("held-out MLM loss (nats per masked token)")
    ax.legend(loc="upper right", fontsize=8)
    return ax


def plot_label_efficiency(results: dict, models=("crammed", "random init"), axes=None):
    """Per task: test accuracy against training labels (log x), bands = min-max over seeds."""
    import matplotlib.pyplot as plt

    tasks = list(results["tasks"])
    if axes is None:
        _, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
        axes = axes[0]
    for ax, task in zip(axes, tasks):
        rows = results["tasks"][task]["models"]
        n_all = results["tasks"][task]["sizes"]["train"]
        for m in models:
            curve = rows[m].get("label_efficiency") or {}
            xs = sorted(curve, key=int)
            ax.plot([int(x) for x in xs], [100 * curve[x]["mean"] for x in xs], marker="o", label=m)
            ax.fill_between(
                [int(x) for x in xs],
                [100 * min(curve[x]["scores"]) for x in xs],
                [100 * max(curve[x]["scores"]) for x in xs],
                alpha=0.2,
            )
        for m, style in ((CALIBRATION[0], ":"), (CALIBRATION[1], "--")):
            if m in rows:
                ax.axhline(100 * rows[m]["test"]["mean"], ls=style, color="grey", label=f"{m} ({n_all} labels)")
        for m, r in rows.items():
            if m.endswith("linear probe"):
                ax.plot([n_all], [100 * r["test"]["mean"]], marker="x", ls="none", label=m)
        ax.set_xscale("log")
        ax.set_title(task)
        ax.set_xlabel("training labels")
    axes[0].set_ylabel("test accuracy (%)")
    axes[-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    return axes
