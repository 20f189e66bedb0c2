"""Reading lesson 19's recorded study (``llmedu.peft.study``): its table, and two methods compared.

A method's row is the mean and the standard deviation of its test accuracy over seeds. Two methods A
and B are compared by the difference of their means and the standard error of that **difference**, from
both sources of noise, added in quadrature:

* seeds (two-sample): ``sqrt(sd_A^2 / k_A + sd_B^2 / k_B)``, from the spread over the ``k`` seeds of each;
* test snippets (paired): the same snippets score both methods, so per snippet j the difference
  ``d_j = (share of A's seeds right on j) - (share of B's seeds right on j)``; its standard error is
  ``sd(d) / sqrt(n)``. Pairing removes the snippets both get right (or wrong) from the noise, so it is
  smaller than the unpaired ``sqrt(2 p (1 - p) / n)`` of two independent test sets.

A baseline (one deterministic fit) has no seed spread; its per-snippet answers still pair.

The snippet term is conservative: ``d_j`` is taken over seed means, so it also holds the seeds' flips on
each snippet, which the seed term already counts. A gap is *resolved* when ``|diff| / se`` reaches the
two-sided 95% quantile of Student's t at the Welch-Satterthwaite degrees of freedom of the three variance
terms, ``df = (sum v_i)^2 / sum(v_i^2 / df_i)`` (each seed term has ``k - 1``, the snippet term ``n - 1``):
with 3 seeds a gap carried by the seed spread has df near 2, and needs about 4.3 standard errors, not 2.
Left out: a joint bootstrap over seeds and snippets, which would count the seed noise once.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

__all__ = ["RESULT", "load", "rows", "compare", "t_quantile", "sweeps", "table", "merge"]

RESULT = Path(__file__).resolve().parents[2] / "data" / "results" / "peft_protocol_cpu.json"  # lesson 19's table


def load(path: str | Path) -> dict:
    """A study's JSON, checked for the keys the lesson reads; an error names the file and what is missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no study at {path}: run `python -m llmedu.peft.study run --out {path}`")
    study = json.loads(path.read_text())
    missing = [k for k in ("config", "methods", "baselines", "provenance") if k not in study]
    if missing:
        raise ValueError(f"{path} is not a finished study: it has no {', '.join(missing)}")
    absent = [m for m in study["config"]["methods"] if m not in study["methods"]]
    if absent:
        raise ValueError(f"{path} is not finished: no result for {absent}; run the same command again to resume")
    return study


def rows(study: dict) -> dict[str, dict]:
    """{name: {"mean", "std", "k", "correct": [one 0/1 string per seed], ...}}: baselines first, then methods."""
    out = {}
    for name, b in study["baselines"].items():
        out[name] = {"mean": b["test"], "std": 0.0, "k": 1, "correct": [b["correct"]], "lr": None}
    for name, m in study["methods"].items():
        out[name] = {**m["test"], "k": len(m["correct"]), "correct": m["correct"], "lr": m["lr"]}
        out[name].update(trainable=m["trainable"], train_loss=m["train_loss"])
    return out


def _per_snippet(correct: list[str]) -> list[float]:
    """The share of runs that got each snippet right."""
    n = {len(c) for c in correct}
    if len(n) != 1:
        raise ValueError(f"the runs scored different numbers of snippets: {sorted(n)}")
    return [sum(c[j] == "1" for c in correct) / len(correct) for j in range(n.pop())]


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile for ``0.5 <= p < 1`` at ``df >= 1`` (fractional df allowed), by bisection on its CDF.

    The CDF is 1/2 plus Simpson's rule over the density from 0; accurate to about 1e-6 for the quantiles used here.
    """
    if not 0.5 <= p < 1:
        raise ValueError(f"t_quantile takes 0.5 <= p < 1, got p={p}")
    if not df >= 1:
        raise ValueError(f"t_quantile needs df >= 1, got df={df}: compare rows with at least 2 seeds")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, n: int = 2000) -> float:  # n even: Simpson's rule on [0, x]
        f = [math.exp(log_c - (df + 1) / 2 * math.log1p((x * i / n) ** 2 / df)) for i in range(n + 1)]
        return 0.5 + x / (3 * n) * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:  # df >= 1: the 97.5% quantile is at most 12.71
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def compare(a: dict, b: dict) -> dict:
    """A - B for two rows of ``rows``: the difference, its standard errors (seeds, snippets, both), the ratio,
    the Welch-Satterthwaite ``df``, the two-sided 95% t critical value ``t_crit`` at it, and ``resolved``."""
    pa, pb = _per_snippet(a["correct"]), _per_snippet(b["correct"])
    if len(pa) != len(pb):
        raise ValueError(f"the two rows scored {len(pa)} and {len(pb)} test snippets: not the same test split")
    d = [x - y for x, y in zip(pa, pb)]
    diff = statistics.fmean(d)  # equals mean_A - mean_B
    se_seeds = math.sqrt(a["std"] ** 2 / a["k"] + b["std"] ** 2 / b["k"])
    se_snippets = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    se = math.hypot(se_seeds, se_snippets)
    terms = [(row["std"] ** 2 / row["k"], row["k"] - 1) for row in (a, b)] + [(se_snippets**2, len(d) - 1)]
    terms = [(v, n) for v, n in terms if v > 0]  # a baseline has no seed term; identical rows, no term at all
    df = se**4 / sum(v**2 / n for v, n in terms) if terms else math.inf
    t_crit = t_quantile(0.975, df) if terms else math.inf
    ratio = diff / se if se else 0.0
    out = {"diff": diff, "se_seeds": se_seeds, "se_snippets": se_snippets, "se": se, "ratio": ratio}
    return {**out, "df": df, "t_crit": t_crit, "resolved": abs(ratio) >= t_crit}


def sweeps(study: dict) -> str:
    """Each swept method's dev accuracy per rate; the chosen rate in [ ], and a mark when the choice is a
    tie (several rates share the best dev score: the lowest wins) or at an edge of the grid (no optimum)."""
    lines = ["dev accuracy per rate (chosen in [ ]); tie: the best dev score at several rates; edge: top or bottom"]
    for name, m in study["methods"].items():
        if "dev" not in m:
            lines.append(f"  {name:<18} no sweep: the rate of {m['same_rate_as']}")
            continue
        dev, best = m["dev"], max(m["dev"].values())
        cells = [
            f"[{float(k):g} {v:.1%}]" if float(k) == m["lr"] else f" {float(k):g} {v:.1%} " for k, v in dev.items()
        ]
        marks = ["tie: the choice is a tie-break"] if sum(v == best for v in dev.values()) > 1 else []
        if m["lr"] in (min(m["rates"]), max(m["rates"])) and not marks:
            marks.append(f"edge: the {'top' if m['lr'] == max(m['rates']) else 'bottom'} of the grid")
        lines.append(f"  {name:<18}{''.join(cells)}  {'; '.join(marks)}".rstrip())
    return "\n".join(lines)


def table(study: dict) -> str:
    """The lesson's table: each row's test accuracy over seeds, its rate, and its gap to TF-IDF."""
    r = rows(study)
    ref = r["TF-IDF + logistic regression"]
    n = len(r[next(iter(r))]["correct"][0])
    lines = [
        f"test accuracy on {n:,} held-out snippets (mean +- sd over seeds); vs TF-IDF: difference / its SE",
        f"{'':<30}{'rate':>8}{'seeds':>6}{'accuracy':>17}{'vs TF-IDF':>18}",
    ]
    for name, row in r.items():
        rate = "-" if row["lr"] is None else f"{row['lr']:.0e}"
        acc = f"{row['mean']:.1%} +- {row['std']:.1%}" if row["k"] > 1 else f"{row['mean']:.1%}"
        vs = "" if row is ref else "{diff:+.1%} / {se:.1%}".format(**compare(row, ref))
        lines.append(f"{name:<30}{rate:>8}{row['k']:>6}{acc:>17}{vs:>18}")
    return "\n".join(lines)


def merge(parts: list[Path], out: Path) -> dict:
    """One study from parts run with the same config but different ``--methods`` (each on its own machine slot)."""
    studies = [load(p) for p in parts]
    same = [{k: v for k, v in s["config"].items() if k != "methods"} for s in studies]
    if any(c != same[0] for c in same):
        raise ValueError(f"{', '.join(map(str, parts))}: the parts were run with different configs, they cannot merge")
    if any(s["digests"] != studies[0]["digests"] or s["baselines"] != studies[0]["baselines"] for s in studies):
        raise ValueError("the parts saw different splits or baselines: they cannot merge")
    merged = {**studies[0], "methods": {}, "config": {**studies[0]["config"], "methods": []}}
    for s in studies:
        twice = set(merged["methods"]) & set(s["methods"])
        if twice:
            raise ValueError(f"method(s) {sorted(twice)} are in more than one part")
        merged["methods"].update(s["methods"])
        merged["config"]["methods"] += s["config"]["methods"]
    merged["provenance"] = {**studies[0]["provenance"], "parts": [s["provenance"] for s in studies]}
    merged["provenance"]["command"] = " ; ".join(s["provenance"]["command"] for s in studies)
    merged["provenance"].pop("runs", None)
    runs = [r for s in studies for r in s["provenance"].get("runs", [])]
    merged["provenance"]["cpu_seconds"] = round(sum(r["cpu_seconds"] for r in runs), 1)
    merged["provenance"]["wall_seconds_of_parts"] = [
        round(sum(r["wall_seconds"] for r in s["provenance"]["runs"]), 1) for s in studies
    ]
    out.write_text(json.dumps(merged, indent=1) + "\n")
    return merged
