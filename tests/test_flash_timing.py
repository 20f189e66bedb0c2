"""llmedu.kernels.flash_timing: lesson 17's peak-memory and turn-taking timing loop."""

import pytest

from llmedu.kernels.flash_timing import Measured, measure


def test_measure_takes_turns_and_reads_the_rounds():
    impls = {"a": lambda q, k, v: q * k * v, "b": lambda q, k, v: (q @ k.mT) @ v}
    lines = []
    found = measure(impls, [8, 16], repeats=3, heads=1, head_dim=4, echo=lines.append)
    assert [len(r) for r in found.ms["a"]] == [3, 3] and len(lines) == 2 and lines[0].startswith("T=    8")
    assert all(p > 0 for peaks in found.peak_mib.values() for p in peaks)
    # a ratio is resolved only when every round falls on the same side of 1
    rounds = Measured([8], {}, {"a": [[1.0, 1.0, 1.0]], "b": [[2.0, 0.5, 2.0]], "c": [[2.0, 3.0, 4.0]]})
    assert rounds.verdict("a", "b", 0).endswith("(not resolved)")
    assert rounds.verdict("a", "c", 0).endswith("(resolved)")


def test_measure_refuses_nothing_to_measure():
    with pytest.raises(ValueError, match="at least one"):
        measure({"a": lambda q, k, v: q}, [8], repeats=0)
    with pytest.raises(ValueError, match="at least one"):
        measure({}, [8])
