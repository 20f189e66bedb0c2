"""How lessons 22 and 23 print and draw their tables of ``compare.Row``: one format for both.

``print_rows`` prints method, bits or sparsity, MB, size against fp32, latency (each row's own median
and its median ratio to fp32 over the pairs, with the smallest and largest pair ratio), accuracy with
its binomial standard error, and ``latency_verdict``, then the baselines' accuracies. ``plot_rows`` draws accuracy against size
and against the paired latency ratio, with error bars (one standard error; the range of the pair ratios),
the Pareto front of size and accuracy, and the baselines as horizontal lines.

The first row with a latency is taken as the reference (fp32 paired with itself). Nothing is computed
here that the rows do not hold, except the standard errors: one accuracy's (``compare.accuracy_se``) and
that of a row's difference from the reference, paired over the same snippets (``paired_difference``,
printed by ``print_paired``: the snippets that flip, b lost and c gained, give SE = sqrt(b + c) / n and
McNemar's exact test, McNemar 1947).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch

from .compare import Row, accuracy_se, pareto_front

__all__ = ["latency_verdict", "print_rows", "PairedDifference", "paired_difference", "print_paired", "plot_rows"]


def _reference(rows: list[Row]) -> Row:
    timed = [r for r in rows if r.bytes and r.ratio is not None]
    if not timed:
        raise ValueError("no row has bytes and a paired latency: measure fp32 with compare.measure(reference=base)")
    return timed[0]


def latency_verdict(row: Row, reference: Row) -> str:
    """'faster' or 'slower' only when every pair ratio of ``row`` lies outside the reference's own range
    (fp32 paired with itself: the noise of the method), else 'not resolved'."""
    if row.ratio is None or reference.ratio is None:
        return ""
    if row is reference:
        return "(the noise)"
    if row.ratio_hi < reference.ratio_lo:
        return "faster"
    if row.ratio_lo > reference.ratio_hi:
        return "slower"
    return "not resolved"


def print_rows(rows: list[Row], n_val: int, baselines: dict[str, float]) -> None:
    """One line per row, then one per baseline (name -> accuracy on the same ``n_val`` snippets)."""
    fp32 = _reference(rows)
    print(
        f"{'method':<30}{'bits / sparsity':<19}{'MB':>7}{'x fp32':>8}{'ms/batch':>10}{'x fp32':>8}{'pairs':>12}"
        f"{'accuracy':>10}{'± se':>6}  latency vs fp32"
    )
    for r in rows:
        if r.ratio is None:
            lat = f"{'-':>10}{'-':>8}{'':>12}"
        else:
            lat = f"{r.latency_s * 1e3:>10.1f}{r.ratio:>8.2f}{r.ratio_lo:>7.2f}-{r.ratio_hi:<4.2f}"
        se = 100 * accuracy_se(r.accuracy, n_val)
        print(
            f"{r.method:<30}{r.detail:<19}{r.bytes / 1e6:>7.1f}{r.bytes / fp32.bytes:>8.3f}{lat}"
            f"{r.accuracy:>10.1%}{se:>6.1f}  {latency_verdict(r, fp32):<14}{r.note}"
        )
    for name, acc in baselines.items():
        print(f"{name:<30}{'-':<19}{'':>45}{acc:>10.1%}{100 * accuracy_se(acc, n_val):>6.1f}")
    print(
        "x fp32 (latency): the median over the pairs of (the row's time / fp32's time in the same pair); pairs: the "
        "smallest and largest pair ratio; ± se: one accuracy's binomial standard error, in points; latency vs fp32: "
        "faster or slower only when all the row's pair ratios lie outside fp32's own range"
    )


@dataclass
class PairedDifference:
    difference: float  # accuracy of the row minus the reference's, on the same snippets
    lost: int  # b: snippets the reference gets right and the row wrong
    gained: int  # c: the reverse
    se: float  # sqrt(b + c) / n: the standard error of the difference under McNemar's null
    p_value: float  # McNemar's exact two-sided test: b ~ Binomial(b + c, 1/2)


def paired_difference(predicted: torch.Tensor, reference: torch.Tensor, labels) -> PairedDifference:
    """The difference of two accuracies measured on the same n snippets, from the flips alone: snippets
    both get right (or both wrong) add nothing to its noise. Independent samples would give
    sqrt(se_1^2 + se_2^2), which ignores that the two
    models agree on most snippets."""
    labels = torch.as_tensor(labels)
    if predicted.shape != reference.shape or predicted.shape != labels.shape or labels.dim() != 1:
        raise ValueError(
            f"predictions and labels must be (n,) each, on the same snippets: got {tuple(predicted.shape)}, "
            f"{tuple(reference.shape)} and {tuple(labels.shape)}"
        )
    n = labels.numel()
    right, ref_right = predicted == labels, reference == labels
    b, c = int((ref_right & ~right).sum()), int((right & ~ref_right).sum())
    k = min(b, c)
    tail = sum(math.comb(b + c, i) for i in range(k + 1)) / 2 ** (b + c)  # P(X <= k), X ~ Bin(b + c, 1/2)
    return PairedDifference((c - b) / n, b, c, math.sqrt(b + c) / n, min(1.0, 2 * tail))


def print_paired(rows: list[Row], labels, level: float = 0.05) -> None:
    """Each row's accuracy against the reference's (the first timed row, fp32), paired over the same snippets:
    the difference, the flips, the paired standard error and McNemar's p; 'resolved' when p < ``level``."""
    fp32 = _reference(rows)
    if fp32.predictions is None:
        raise ValueError("the reference row holds no predictions: measure it with compare.measure")
    print(
        f"{'method':<30}{'accuracy':>9}{'- fp32':>8}{'lost':>6}{'gained':>7}{'paired se':>10}{'McNemar p':>11}  verdict"
    )
    for r in rows:
        if r is fp32 or r.predictions is None:
            continue
        d = paired_difference(r.predictions, fp32.predictions, labels)
        verdict = "resolved" if d.p_value < level else "not resolved"
        print(
            f"{r.method:<30}{r.accuracy:>9.1%}{100 * d.difference:>+8.1f}{d.lost:>6}{d.gained:>7}"
            f"{100 * d.se:>10.2f}{d.p_value:>11.3f}  {verdict}"
        )
    print(
        f"- fp32 and paired se: in points; lost (gained): snippets fp32 gets right (wrong) and the row wrong (right); "
        f"paired se = sqrt(lost + gained) / n; resolved: McNemar's exact two-sided p < {level:g}"
    )


def plot_rows(rows: list[Row], n_val: int, baselines: dict[str, float], title: str) -> None:
    """Accuracy against bytes (left) and against the paired latency ratio (right), one marker per row."""
    rows = [r for r in rows if r.bytes and r.ratio is not None]
    fig, (ax, ax_t) = plt.subplots(1, 2, figsize=(15, 5), sharey=True)
    markers = list("osD^v<>pPX*d") + list("osD^v<>pPX")  # the last rows hollow: no two share shape and fill
    spread = max(r.bytes for r in rows) / 1e6 / 75  # rows of (nearly) the same size are spread sideways
    offset, group = {}, []
    for r in sorted(rows, key=lambda r: r.bytes) + [None]:
        if group and (r is None or r.bytes - group[-1].bytes > 1.5e6):
            for j, g in enumerate(group):
                offset[g.method] = spread * (j - (len(group) - 1) / 2)
            group = []
        if r is not None:
            group.append(r)
    for k, r in enumerate(rows):
        colour, hollow = plt.cm.tab20(k % 20), k >= 12
        style = dict(fmt=markers[k % len(markers)], ms=7, color=colour, mfc="none" if hollow else colour)
        style.update(mew=1.8 if hollow else 1.0, elinewidth=0.8, capsize=2)
        se = 100 * accuracy_se(r.accuracy, n_val)  # one standard error, in points
        ax.errorbar(r.bytes / 1e6 + offset[r.method], 100 * r.accuracy, yerr=se, label=r.method, **style)
        xerr = [[r.ratio - r.ratio_lo], [r.ratio_hi - r.ratio]]  # the smallest and largest pair ratio
        ax_t.errorbar(r.ratio, 100 * r.accuracy, xerr=xerr, yerr=se, **style)
    front = pareto_front(rows)
    ax.plot([r.bytes / 1e6 for r in front], [100 * r.accuracy for r in front], "-", color="tab:red", lw=1)
    ax.lines[-1].set_label("Pareto front")
    for a in (ax, ax_t):
        for (name, acc), ls in zip(baselines.items(), ("--", ":", "-.")):
            a.axhline(100 * acc, color="grey", ls=ls, lw=1, label=name if a is ax else None)
    ax_t.axvline(1.0, color="black", lw=0.8)  # fp32's own time
    ax_t.set_xscale("log")
    lo, hi = min(r.ratio_lo for r in rows), max(r.ratio_hi for r in rows)
    ticks = [t for t in (0.25, 0.35, 0.5, 0.7, 1, 1.4, 2, 3, 4, 6) if lo <= t <= hi]
    ax_t.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax_t.minorticks_off()
    ax.set(xlabel="bytes on disk (MB; rows of one size spread sideways)", ylabel="validation accuracy (%)", title=title)
    ax_t.set(
        xlabel="latency per batch, x fp32 (median of the ratios paired with fp32)", title="accuracy against latency"
    )
    ax_t.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    plt.show()
