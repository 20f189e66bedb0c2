"""How far a gap measured over a few seeds can be trusted: the paired t-test, with Student's t exactly.

A study scores the pretrained model and the control with the same seeds, so the question is about the
per-seed gaps d_1..d_n: is their mean far from zero compared with its standard error s / sqrt(n)? Under the
usual assumptions (the gaps independent and roughly normal) t = mean / (s / sqrt(n)) follows Student's t with
n - 1 degrees of freedom. With 3 seeds that is 2 degrees of freedom, whose tails are heavy: a mean two
standard errors from zero is not yet evidence (two-sided p about 0.18).

``student_t_two_sided(t, dof)`` is P(|T| >= |t|) from the closed forms for integer degrees of freedom
(Abramowitz & Stegun 1964, 26.7.3 and 26.7.4), with theta = atan(t / sqrt(dof)): for even dof,
P(|T| < t) = sin(theta) (1 + cos^2/2 + 1*3/(2*4) cos^4 + ... up to cos^(dof-2)), for odd dof
(2/pi) (theta + sin(theta) (cos + 2/3 cos^3 + ... up to cos^(dof-2))). ``t_quantile`` inverts it by
bisection, for the interval mean +- t_(0.975, dof) * standard error.

The t-test takes the gaps as normal; when one side sometimes fails (a control run that ends far below its
others) they are skewed. ``sign_flip_p`` drops that assumption: under "no difference" each gap's sign is a coin
flip, so the p-value is the share of the 2^n sign patterns whose mean is at least as far from zero as the one
measured (exact, no distribution assumed). It cannot go below 2 / 2^n two-sided: 0.25 with 3 seeds, 0.0625
with 5.

Left out: any correction for looking at several gaps, or at the same gap twice (seeds added after a first look).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

__all__ = ["student_t_two_sided", "t_quantile", "sign_flip_p", "paired_gap"]


def student_t_two_sided(t: float, dof: int) -> float:
    """P(|T| >= |t|) for Student's t with ``dof`` (a positive integer) degrees of freedom."""
    if not isinstance(dof, int) or dof < 1:
        raise ValueError(f"dof must be a positive integer, got {dof!r}")
    theta = math.atan(abs(t) / math.sqrt(dof))
    c2 = math.cos(theta) ** 2
    if dof % 2 == 0:  # sin(theta) * sum over k < dof/2 of (1*3*...*(2k-1)) / (2*4*...*2k) * cos^2k
        term, total = 1.0, 1.0
        for k in range(1, dof // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = math.sin(theta) * total
    else:  # (2/pi) (theta + sin(theta) cos(theta) * sum over k < (dof-1)/2 of (2*4*...*2k) / (3*5*...*(2k+1)) * cos^2k)
        term, total = 1.0, 0.0 if dof == 1 else 1.0
        for k in range(1, (dof - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    return max(0.0, 1.0 - inside)


def t_quantile(p_two_sided: float, dof: int) -> float:
    """The t > 0 with P(|T| >= t) = ``p_two_sided`` (e.g. 0.05 for a 95% interval), by bisection."""
    if not 0 < p_two_sided < 1:
        raise ValueError(f"p_two_sided must lie in (0, 1), got {p_two_sided!r}")
    lo, hi = 0.0, 1.0
    while student_t_two_sided(hi, dof) > p_two_sided:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if student_t_two_sided(mid, dof) > p_two_sided else (lo, mid)
    return (lo + hi) / 2


def sign_flip_p(gaps: Sequence[float]) -> dict:
    """{"two_sided", "one_sided"}: the exact sign-flip (permutation) p-values of the mean gap, the one-sided in
    the direction of the measured mean. Up to 20 gaps (2^20 patterns)."""
    gaps = [float(g) for g in gaps]
    if not 1 <= len(gaps) <= 20:
        raise ValueError(f"the sign-flip test enumerates 2^n patterns: give 1 to 20 gaps, got {len(gaps)}")
    observed, eps = statistics.fmean(gaps), 1e-12  # eps: a pattern equal to the measured one counts, as it should
    sign = 1.0 if observed >= 0 else -1.0
    means = [
        statistics.fmean(s * g for s, g in zip(signs, gaps)) for signs in itertools.product((1, -1), repeat=len(gaps))
    ]
    return {
        "two_sided": sum(abs(m) >= abs(observed) - eps for m in means) / len(means),
        "one_sided": sum(sign * m >= sign * observed - eps for m in means) / len(means),
    }


def paired_gap(gaps: Sequence[float]) -> dict:
    """{mean, std, se, t, dof, p, interval95, sign_flip} of per-seed gaps (at least two, not all equal): the
    t-test's figures and the exact sign-flip p-values beside them."""
    gaps = [float(g) for g in gaps]
    if len(gaps) < 2:
        raise ValueError(f"a paired test needs at least two seeds, got {len(gaps)}")
    mean, std = statistics.fmean(gaps), statistics.stdev(gaps)
    if std == 0:
        raise ValueError("every seed gives the same gap: its spread says nothing (a deterministic row?)")
    se, dof = std / math.sqrt(len(gaps)), len(gaps) - 1
    half = t_quantile(0.05, dof) * se
    return {
        "mean": mean,
        "std": std,
        "se": se,
        "t": mean / se,
        "dof": dof,
        "p": student_t_two_sided(mean / se, dof),
        "interval95": (mean - half, mean + half),
        "sign_flip": sign_flip_p(gaps),
    }
