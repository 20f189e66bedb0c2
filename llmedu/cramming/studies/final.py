"""The capstone's recorded results as lesson 25 reads them: the final protocol, the recipes, the data lever.

    study = load_study(FINAL)          # an hour of pretraining, 5 seeds, the six-rate sweep, MiniLM fine-tuned
    print(final_table(study))          # the bag of words and random init first, then the crammed encoder
    print(welch(pretrained, control))  # a two-sample test: the control's seed also draws its weights

Why two-sample, not paired: seed s fine-tunes the pretrained encoder and, for the control, also draws the random
weights it starts from, so the two scores of one seed share no draw worth pairing on. Welch's t (Welch 1947)
compares the two means with the standard error sqrt(s_a^2 / n_a + s_b^2 / n_b) and the Welch-Satterthwaite degrees
of freedom, which need not be whole; the p-value comes from Student's t through the regularised incomplete beta
function (Numerical Recipes, 3rd ed., sec. 6.4, the continued fraction of sec. 6.4.1 by modified Lentz).

The data lever is the opposite case: seed s starts every treatment from the same weights (``data_lever``'s runs
call ``seed_everything(s)`` before building the model), so a treatment's gap to the baseline is paired by seed
(``paired``): the mean of the per-seed differences, its standard error s_d / sqrt(n) and t on n - 1 degrees of
freedom. What the seeds share cancels in each difference; a two-sample error would count it as noise.

Left out: any correction for several looks at one test split; the MiniLM row is a reference of another size,
vocabulary and training, not a point on a scale of pretraining compute.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from .report import load_study, per_seed_average

__all__ = ["FINAL", "RECIPES", "DATA_LEVER", "load_study", "load_recipes", "student_t_sf2", "welch", "final_table"]
__all__ += ["paired", "data_lever_gaps", "data_lever_table", "FINAL_ROWS"]

RESULTS = Path(__file__).resolve().parents[3] / "data" / "results"
FINAL = RESULTS / "cramming_study_cpu_60m_5seeds_wide_minilm.json"  # the final protocol, after an hour
RECIPES = RESULTS / "cramming_recipes_cpu.json"  # crammed against original, and the ablation rows
DATA_LEVER = RESULTS / "cramming_data_lever_cpu.json"  # the paper's dataset optimisations at course scale
FINAL_ROWS = (  # the order of the table: what needs no pretraining first
    ("majority class", "majority class"),
    ("TF-IDF + logistic regression", "TF-IDF + logistic regression"),
    ("random init", "random init (fine-tuned)"),
    ("random init, linear probe", "random init, linear probe"),
    ("crammed", "crammed 60 min (fine-tuned)"),
    ("crammed, linear probe", "crammed 60 min, linear probe"),
    ("MiniLM-L6", "reference: MiniLM-L6 (fine-tuned)"),
)


def load_recipes(path=RECIPES) -> dict:
    """The recorded recipe and ablation runs; a clear error when the file is missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: it ships with the course under data/results/")
    return json.loads(path.read_text())


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d, c = 1 + num * d, 1 + num / c
            d, c = 1 / (d if abs(d) > tiny else tiny), c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def student_t_sf2(t: float, dof: float) -> float:
    """P(|T| >= |t|) for Student's t with ``dof`` > 0 degrees of freedom, whole or not: I_x(dof/2, 1/2), x = dof/(dof+t^2)."""
    if not dof > 0:
        raise ValueError(f"dof must be positive, got {dof!r}")
    x, a, b = dof / (dof + t * t), dof / 2, 0.5
    if x <= 0:
        return 0.0
    if x >= 1:  # t = 0
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def welch(a: Sequence[float], b: Sequence[float]) -> dict:
    """Welch's two-sample t-test of mean(a) - mean(b): the difference, its standard error, t, dof and p (two-sided)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"each side needs at least 2 scores, got {len(a)} and {len(b)}")
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff, se = statistics.fmean(a) - statistics.fmean(b), math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    t = diff / se
    return {"diff": diff, "se": se, "t": t, "dof": dof, "p": student_t_sf2(t, dof)}


def paired(a: dict[int, float], b: dict[int, float]) -> dict:
    """mean(a[s] - b[s]) over the seeds both hold, paired seed by seed: the difference, its standard error
    stdev(d) / sqrt(n), t, dof = n - 1, p (two-sided), and n."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        raise ValueError(
            f"a paired difference needs at least 2 seeds in common, got {seeds} (of {sorted(a)} and {sorted(b)})"
        )
    d = [a[s] - b[s] for s in seeds]
    diff, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))
    t = diff / se if se > 0 else math.copysign(math.inf, diff) if diff else 0.0
    return {"diff": diff, "se": se, "t": t, "dof": len(d) - 1, "p": student_t_sf2(t, len(d) - 1), "n": len(d)}


def data_lever_gaps(results: dict) -> dict:
    """{treatment: ``paired`` gap to the baseline}, from the held-out loss of every run, matched by its seed."""
    by_seed = {name: {r["seed"]: r["val_loss"] for r in row["runs"]} for name, row in results["rows"].items()}
    return {name: paired(losses, by_seed["baseline"]) for name, losses in by_seed.items() if name != "baseline"}


def final_table(study: dict) -> str:
    """Test accuracy (%) per task and on the task average, mean +- std over seeds; rows in ``FINAL_ROWS`` order."""
    tasks = list(study["tasks"])
    lines = [f"{'model':<36}" + "".join(f"{t:>18}" for t in tasks) + f"{'task average':>16}   seeds"]
    lines.append("-" * len(lines[0]))
    for key, label in FINAL_ROWS:
        cells = []
        for task in tasks:
            test = study["tasks"][task]["models"][key]["test"]
            cells.append(f"{100 * test['mean']:>11.1f} +- {100 * test['std']:.1f}")
        scores = per_seed_average(study, key)
        spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
        mean = f"{100 * statistics.fmean(scores):>9.1f} +- {100 * spread:.1f}"
        seeds = str(len(scores)) if "fine-tuned" in label else "-"  # probes and baselines: deterministic
        lines.append(f"{label:<36}" + "".join(f"{c:>18}" for c in cells) + f"{mean:>16}   {seeds}")
    return "\n".join(lines)


def data_lever_table(results: dict) -> str:
    """Held-out MLM loss per treatment (mean +- std over seeds) and its gap to the baseline paired by seed (+- 1
    s.e., t on n - 1 dof and its two-sided p), computed from the runs' own losses by ``data_lever_gaps``."""
    gaps = data_lever_gaps(results)
    head = (
        f"{'treatment':<20}{'seeds':>6}{'held-out loss':>18}{'vs baseline (paired)':>23}{'t':>7}{'p':>7}{'passes':>8}"
    )
    lines = [head]
    for name, row in results["rows"].items():
        gap = gaps.get(name)
        vs = f"{gap['diff']:+.4f} +- {gap['se']:.4f}" if gap else "-"
        t, p = (f"{gap['t']:+.1f}", f"{gap['p']:.2f}") if gap else ("", "")
        lines.append(
            f"{name:<20}{row['n']:>6}{row['mean']:>11.4f} +- {row['std']:.4f}{vs:>23}{t:>7}{p:>7}{row['passes']:>8}"
        )
    return "\n".join(lines)
