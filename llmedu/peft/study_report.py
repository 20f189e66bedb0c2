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
Left out: a t-distribution for 3 seeds (the ratio is read as "about k standard errors", not a p-value).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

__all__ = ["RESULT", "load", "rows", "compare", "table", "merge"]

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


def compare(a: dict, b: dict) -> dict:
    """A - B for two rows of ``rows``: the difference, its standard errors (seeds, snippets, both), the ratio."""
    pa, pb = _per_snippet(a["correct"]), _per_snippet(b["correct"])
    if len(pa) != len(pb):
        raise ValueError(f"the two rows scored {len(pa)} and {len(pb)} test snippets: not the same test split")
    d = [x - y for x, y in zip(pa, pb)]
    diff = statistics.fmean(d)  # equals mean_A - mean_B
    se_seeds = math.sqrt(a["std"] ** 2 / a["k"] + b["std"] ** 2 / b["k"])
    se_snippets = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    se = math.hypot(se_seeds, se_snippets)
    return {"diff": diff, "se_seeds": se_seeds, "se_snippets": se_snippets, "se": se, "ratio": diff / se if se else 0}


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
