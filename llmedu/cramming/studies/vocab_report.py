"""Reading a vocabulary study (``vocab_study.py``'s JSON): the table, the verdict in numbers, the plots.

Every comparison here is across vocabularies, so it uses the measures that survive a change of tokenizer
(``vocab_study``'s docstring says what each is and is not): tokens per character, nats per character of
masked text, the gap below each run's own unigram line, characters read per second, and the linear probe's
dev accuracy beside the same probe on random weights. The verdict reads them; the noise it quotes for the
probe is the binomial standard error of a dev accuracy, sqrt(p (1 - p) / n), which says how far apart two
vocabularies must be before one seed's difference means anything.

Left out: seeds (one run per vocabulary; the binomial error is the dev split's noise, not the training's).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .report import check_runs, read_results

__all__ = ["RECORDED_VOCAB", "load_vocab_study", "probe_mean", "vocab_table", "vocab_verdict", "plot_vocab"]

RECORDED_VOCAB = Path(__file__).resolve().parents[3] / "data" / "results" / "cramming_vocab_cpu.json"
_KEYS = ("provenance", "config", "runs")
_RUN_KEYS = (
    "vocab_size",
    "parameters",
    "tokens_per_char",
    "tokens_per_s",
    "chars_per_s",
    "passes",
    "val_loss",
    "unigram_cross_entropy",
    "below_unigram",
    "nats_per_char",
    "probe",
    "probe_control",
)


def load_vocab_study(path) -> dict:
    """The results of ``run_vocab_study`` read from ``path``; a clear error for a file that is not one."""
    absent = f"no vocabulary study here (python -m llmedu.cramming vocab --budget 3m --out {path})"
    results = read_results(path, _KEYS, absent, "the output of a vocabulary study")
    check_runs(results, path, _RUN_KEYS)
    return results


def _runs(results: dict) -> list[dict]:
    return sorted(results["runs"].values(), key=lambda r: r["vocab_size"])


def probe_mean(run: dict, key: str = "probe") -> float | None:
    """The mean over tasks of a run's probe accuracy (``key``: "probe" or "probe_control"); None without one."""
    return statistics.fmean(run[key].values()) if run.get(key) else None


def _probe_noise(results: dict, run: dict) -> float:
    """The binomial standard error of ``probe_mean(run)``: each task's sqrt(p (1 - p) / n_dev), averaged in
    quadrature over the tasks."""
    sizes = results["config"]["probe"]["sizes"]
    variances = [p * (1 - p) / sizes[t]["dev"] for t, p in run["probe"].items()]
    return math.sqrt(sum(variances)) / len(variances)


def _trend(points: list[tuple[int, float]], what: str, best: str, fmt: str = ".3f") -> str:
    """'... falls at every step up in vocabulary', '... rises ...', or where ``best`` ("lowest"/"highest") sits."""
    values = [v for _, v in points]
    if len(values) > 1 and all(b < a for a, b in zip(values, values[1:])):
        return f"{what} falls at every step up in vocabulary"
    if len(values) > 1 and all(b > a for a, b in zip(values, values[1:])):
        return f"{what} rises at every step up in vocabulary"
    pick = min if best == "lowest" else max
    vocab, value = pick(points, key=lambda p: p[1])
    return f"{what} is {best} at {vocab} ({value:{fmt}})"


def vocab_table(results: dict) -> str:
    """One line per vocabulary: compression, size, speed, passes, MLM loss and its unigram line, nats per
    character, and the probe's mean dev accuracy (%) beside the random-weights control."""
    head = (
        f"{'vocab':>7}{'tok/char':>10}{'params':>11}{'non-emb':>10}{'tokens/s':>10}{'chars/s':>10}{'passes':>8}"
        f"{'MLM loss':>10}{'unigram':>9}{'below':>7}{'nats/char':>11}{'probe':>7}{'control':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in _runs(results):
        probe, control = probe_mean(r), probe_mean(r, "probe_control")
        lines.append(
            f"{r['vocab_size']:>7}{r['tokens_per_char']:>10.3f}{r['parameters']['total']:>11,}"
            f"{r['parameters']['non_embedding']:>10,}{r['tokens_per_s']:>10,.0f}{r['chars_per_s']:>10,.0f}"
            f"{r['passes']:>8.2f}{r['val_loss']:>10.3f}{r['unigram_cross_entropy']:>9.3f}{r['below_unigram']:>7.3f}"
            f"{r['nats_per_char']:>11.3f}{'-' if probe is None else f'{100 * probe:.1f}':>7}"
            f"{'-' if control is None else f'{100 * control:.1f}':>9}"
        )
    config = results["config"]
    lines += [
        "",
        f"budget: {_budget(config)} per run; MLM loss, unigram line and 'below' (unigram - loss) in nats per masked "
        "token of each run's own tokenizer, not comparable across rows; nats/char = MLM loss x tok/char",
    ]
    if config.get("probe"):
        tasks = config["probe"]["tasks"]
        lines.append(
            f"probe: dev accuracy (%) of a linear probe on the frozen encoder, mean over {', '.join(tasks)}; "
            "control: the same probe on random weights of the same shape and tokenizer. Per task (probe / control):"
        )
        for r in _runs(results):
            cells = [f"{t} {100 * r['probe'][t]:.1f} / {100 * r['probe_control'][t]:.1f}" for t in tasks]
            lines.append(f"  {r['vocab_size']:>6}: " + ", ".join(cells))
    return "\n".join(lines)


def _budget(config: dict) -> str:
    parts = [f"{config['budget_seconds']:g} s"] if config.get("budget_seconds") is not None else []
    return " or ".join(parts + ([f"{config['max_steps']} steps"] if config.get("max_steps") is not None else []))


def vocab_verdict(results: dict) -> str:
    """The numbers read against the paper's finding (the downstream score rises with the vocabulary up to
    32768): compression, speed in tokens and in characters, nats per character, and the probe with its noise."""
    runs = _runs(results)
    low, high = runs[0], runs[-1]
    span = f"from {low['vocab_size']} to {high['vocab_size']}"
    lines = [
        f"{span}: {low['tokens_per_char']:.3f} -> {high['tokens_per_char']:.3f} tokens per character "
        f"({low['tokens_per_char'] / high['tokens_per_char']:.2f}x fewer tokens for the same text); tokens/s "
        f"x{high['tokens_per_s'] / low['tokens_per_s']:.2f}, characters/s x{high['chars_per_s'] / low['chars_per_s']:.2f}",
        "  "
        + _trend([(r["vocab_size"], r["chars_per_s"]) for r in runs], "characters read per second", "highest", ",.0f"),
        "  "
        + _trend([(r["vocab_size"], r["nats_per_char"]) for r in runs], "nats per character", "lowest")
        + " (a measure that favours small vocabularies: a masked piece is guessed from its word's other pieces)",
        "  "
        + _trend(
            [(r["vocab_size"], r["below_unigram"] * r["tokens_per_char"]) for r in runs],
            "what the model learnt beyond its unigram line, per character (nats/char),",
            "highest",
        ),
    ]
    if not all(r.get("probe") for r in runs):
        lines.append("no linear probe recorded: the downstream half of the paper's claim is not tested here")
        return "\n".join(lines)
    probes = [(r["vocab_size"], 100 * probe_mean(r)) for r in runs]  # in %
    gains = [(r["vocab_size"], 100 * (probe_mean(r) - probe_mean(r, "probe_control"))) for r in runs]
    lines.append("  " + _trend(probes, "the probe's mean dev accuracy (%)", "highest", ".1f"))
    ranked = sorted(runs, key=probe_mean, reverse=True)
    separated = True
    if len(ranked) > 1:
        first, second = ranked[0], ranked[1]
        margin = probe_mean(first) - probe_mean(second)
        noise = math.hypot(_probe_noise(results, first), _probe_noise(results, second))
        separated = margin > 2 * noise
        lines.append(
            f"  best probe {first['vocab_size']} ({100 * probe_mean(first):.1f}%), {100 * margin:.1f} points above "
            f"{second['vocab_size']}: {'beyond' if separated else 'within'} 2 standard errors of that difference "
            f"(one is {100 * noise:.1f} points: the binomial noise of the dev splits, the runs taken as independent)"
        )
    top = max(gains, key=lambda g: g[1])[0]
    lines.append(
        "  pretraining's gain over random weights (probe - control, points): "
        + ", ".join(f"{v} {g:+.1f}" for v, g in gains)
        + f"; largest at {top}"
    )
    best = max(probes, key=lambda p: p[1])[0]
    if len(runs) == 1:
        reading = "was measured at one vocabulary only: no trend to compare"
    elif best == high["vocab_size"]:
        reading = f"is best at the largest vocabulary tried ({best}), in line with the paper's rise up to 32768"
    elif best == low["vocab_size"]:
        reading = f"is best at the smallest vocabulary tried ({best}), against the paper's trend"
    else:
        reading = f"peaks at {best}, inside the range, where the paper's rises up to 32768"
    if not separated:
        reading += "; but the best is within noise of the runner-up, so the probe does not separate them"
    lines.append(f"against the paper: the downstream score (here the probe) {reading}")
    return "\n".join(lines)


# -- the plots -----------------------------------------------------------------------------------
def _vocab_axis(ax, vocabs: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(vocabs, [str(v) for v in vocabs])
    ax.minorticks_off()
    ax.set_xlabel("vocabulary size (log2 scale)")


def plot_vocab(results: dict, axes=None):
    """Left: nats per character of masked text, with each run's unigram line in the same unit (dashed).
    Right: the probe's dev accuracy per task and its mean (bars: one binomial standard error), the
    random-weights control dashed; the legend sits below the axes, where it hides no point."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    runs = _runs(results)
    vocabs = [r["vocab_size"] for r in runs]
    left, right = axes
    left.plot(vocabs, [r["nats_per_char"] for r in runs], marker="o", label="held-out MLM loss x tokens/char")
    unigram = [r["unigram_cross_entropy"] * r["tokens_per_char"] for r in runs]
    left.plot(vocabs, unigram, color="grey", ls="--", marker=".", label="its unigram line")
    left.set_ylabel("nats per character of masked text")
    left.set_title("loss per character (favours small vocabularies)")
    left.legend(fontsize=8)
    _vocab_axis(left, vocabs)
    if all(r.get("probe") for r in runs):
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, task in enumerate(results["config"]["probe"]["tasks"]):
            c = colours[(i + 1) % len(colours)]
            right.plot(vocabs, [100 * r["probe"][task] for r in runs], color=c, marker=".", lw=1, label=task)
            right.plot(vocabs, [100 * r["probe_control"][task] for r in runs], color=c, ls="--", lw=1)
        means = [100 * probe_mean(r) for r in runs]
        noise = [100 * _probe_noise(results, r) for r in runs]
        right.errorbar(vocabs, means, yerr=noise, color="black", marker="o", lw=2, capsize=3, label="mean, +-1 s.e.")
        right.plot(vocabs, [100 * probe_mean(r, "probe_control") for r in runs], color="black", ls="--", lw=1.5)
        right.plot([], [], color="grey", ls="--", lw=1, label="dashed: random weights (same colour: same task)")
        right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    else:
        right.text(0.5, 0.5, "no linear probe recorded", ha="center", transform=right.transAxes)
    right.set_ylabel("linear-probe dev accuracy (%)")
    right.set_title("downstream: a linear probe on the frozen encoder")
    _vocab_axis(right, vocabs)
    return axes
