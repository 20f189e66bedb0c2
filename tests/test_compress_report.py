"""Lesson 22's paired accuracy comparison: the difference of two accuracies on the same snippets, from the flips."""

import math

import pytest
import torch

from llmedu.compress import compare, report


def flipped(n=1000, correct=800, lost=6, gained=4):
    """Labels, a reference right on the first ``correct`` snippets, and a row that loses ``lost`` of them and
    gains ``gained`` of the others: two accuracies that agree on all but lost + gained snippets."""
    labels = torch.zeros(n, dtype=torch.long)
    reference = torch.ones(n, dtype=torch.long)
    reference[:correct] = 0
    row = reference.clone()
    row[:lost] = 1  # right -> wrong
    row[correct : correct + gained] = 0  # wrong -> right
    return row, reference, labels


def test_paired_se_is_from_the_flips_not_from_two_independent_accuracies():
    row, reference, labels = flipped()
    d = report.paired_difference(row, reference, labels)
    assert (d.lost, d.gained) == (6, 4) and d.difference == pytest.approx(-0.002)
    assert d.se == pytest.approx(math.sqrt(10) / 1000)  # 0.0032
    independent = math.sqrt(compare.accuracy_se(0.8, 1000) ** 2 + compare.accuracy_se(0.798, 1000) ** 2)  # 0.018
    assert d.se < independent / 5  # the independent-sample formula would fail here
    # McNemar's exact test by hand: 2 P(X <= 4), X ~ Bin(10, 1/2) = 2 * 386 / 1024
    assert d.p_value == pytest.approx(2 * 386 / 1024)


def test_a_difference_resolved_only_by_pairing():
    """0.6 points lost: inside the independent-sample noise (sqrt(2) * 1.3 points), far outside the paired one."""
    row, reference, labels = flipped(lost=6, gained=0)
    d = report.paired_difference(row, reference, labels)
    assert d.p_value == pytest.approx(2 / 64) and d.p_value < 0.05
    assert abs(d.difference) < math.sqrt(2) * compare.accuracy_se(0.8, 1000)
    none = report.paired_difference(reference, reference, labels)
    assert (none.difference, none.se, none.p_value) == (0.0, 0.0, 1.0)


def test_print_paired_prints_each_rows_flips_and_verdict(capsys):
    row, reference, labels = flipped(lost=6, gained=0)
    rows = [
        compare.Row("fp32", "32 bit", 100, 1.0, 1.0, 0.8, ratio=1, ratio_lo=1, ratio_hi=1, predictions=reference),
        compare.Row("int8", "8 bit", 25, 1.0, 1.0, 0.794, ratio=1, ratio_lo=1, ratio_hi=1, predictions=row),
    ]
    report.print_paired(rows, labels)
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("int8"))
    assert line.split()[1:6] == ["79.4%", "-0.6", "6", "0", "0.24"] and line.endswith("  resolved")
    with pytest.raises(ValueError, match="on the same snippets"):
        report.paired_difference(row[:-1], reference, labels)
    rows[0].predictions = None
    with pytest.raises(ValueError, match="holds no predictions"):
        report.print_paired(rows, labels)
