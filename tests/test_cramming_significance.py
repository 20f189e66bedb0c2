"""The paired t-test of a gap over seeds: Student's t tails against mpmath's incomplete beta, and by hand."""

import math

import mpmath
import pytest

from llmedu.cramming.studies.significance import paired_gap, sign_flip_p, student_t_two_sided, t_quantile


@pytest.mark.parametrize("dof", [1, 2, 3, 4, 5, 8, 9, 30])
@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.2, 4.303, 12.0])
def test_the_tail_is_the_incomplete_beta(t, dof):
    # P(|T| >= t) = I_{dof / (dof + t^2)}(dof / 2, 1 / 2), the regularized incomplete beta function
    reference = float(mpmath.betainc(dof / 2, 0.5, 0, dof / (dof + t * t), regularized=True))
    assert student_t_two_sided(t, dof) == pytest.approx(reference, abs=1e-12)
    assert student_t_two_sided(-t, dof) == student_t_two_sided(t, dof)


def test_the_table_quantiles():
    # two-sided 5% points of every t table: 12.706 (1), 4.303 (2), 2.776 (4), 2.571 (5), 2.042 (30)
    for dof, value in [(1, 12.706), (2, 4.303), (4, 2.776), (5, 2.571), (30, 2.042)]:
        assert t_quantile(0.05, dof) == pytest.approx(value, abs=5e-4)


def test_paired_gap_by_hand():
    gaps = [0.022, 0.019, 0.073]  # lesson 25's hour, per seed
    r = paired_gap(gaps)
    mean, std = sum(gaps) / 3, math.sqrt(sum((g - sum(gaps) / 3) ** 2 for g in gaps) / 2)
    assert r["mean"] == pytest.approx(mean) and r["std"] == pytest.approx(std)
    assert r["se"] == pytest.approx(std / math.sqrt(3)) and r["dof"] == 2
    assert r["p"] == pytest.approx(1 - r["t"] / math.sqrt(r["t"] ** 2 + 2))  # dof 2: P(|T| < t) = t / sqrt(t^2 + 2)
    low, high = r["interval95"]
    assert (high - low) / 2 == pytest.approx(4.303 * r["se"], rel=1e-3)


def test_the_sign_flip_test_by_hand():
    # three positive gaps: only the all-plus pattern reaches their mean (1 of 8), and its mirror in |mean| (2 of 8)
    assert sign_flip_p([1.0, 2.0, 3.0]) == {"two_sided": 0.25, "one_sided": 0.125}
    # five positive gaps: the floor of 5 seeds, 1/32 one-sided
    assert sign_flip_p([0.022, 0.019, 0.073, 0.047, 0.048]) == {"two_sided": 2 / 32, "one_sided": 1 / 32}
    # (1, -2, 4), sum 3: the signed sums are 3, 7, 1, 5, -5, -1, -7, -3; >= 3 three times, |.| >= 3 six times
    assert sign_flip_p([1.0, -2.0, 4.0]) == {"two_sided": 0.75, "one_sided": 0.375}
    assert sign_flip_p([-1.0, -2.0, -3.0])["one_sided"] == 0.125  # the direction of the measured mean
    assert paired_gap([1.0, 2.0, 3.0])["sign_flip"] == sign_flip_p([1.0, 2.0, 3.0])


def test_bad_input():
    with pytest.raises(ValueError, match="at least two seeds"):
        paired_gap([0.03])
    with pytest.raises(ValueError, match="same gap"):
        paired_gap([0.01, 0.01, 0.01])
    with pytest.raises(ValueError, match="positive integer"):
        student_t_two_sided(1.0, 0)
    with pytest.raises(ValueError, match="1 to 20 gaps"):
        sign_flip_p([0.1] * 21)
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        t_quantile(1.5, 3)
