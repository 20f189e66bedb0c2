"""Lesson 15's apparatus (``llmedu.parallel.zero_study``): the check pads every unit and agrees with one process
and torch's peers; the measurement's counts follow the formulas, Offload's peak is the device's alone, and the
bytes sent are DDP's (ZeRO-3: 1.5 times)."""

import pytest

from llmedu.parallel import launch
from llmedu.parallel.zero_study import CLIP, WRAPPERS, compare_with_peers, fp32_formula, measure


def test_compare_with_peers_pads_every_unit_clips_every_step_and_agrees():
    out = launch(compare_with_peers, 2, echo=False, timeout=120)[0]
    assert out["units"] == [(43, 1), (43, 1), (57, 1)]
    moved = out["diff"].pop("(distance moved from the start)")
    assert min(moved) > 1e-3
    for name, diffs in out["diff"].items():
        assert max(diffs) < 1e-6, (name, diffs)
    want = out["norm"]["one process"]
    assert min(want) > CLIP
    for name, norms in out["norm"].items():
        assert norms == pytest.approx(want, rel=1e-5), name


def test_measure_counts_the_formulas_and_offload_peaks_on_the_device_alone():
    world = 2
    res = launch(measure, world, 32, 1, echo=False, timeout=120)[0]
    n = res["DDP"]["params"]
    for w in WRAPPERS:
        states = sum(res[w]["states"].values())
        assert states == pytest.approx(sum(fp32_formula(w, n, world)), rel=0.01), w  # padding, Adam's step counters
        ratio = res[w]["sent"] / res["DDP"]["sent"]
        assert ratio == pytest.approx(1.5 if w == "ZeRO-3" else 1.0, rel=0.01), (w, ratio)
    offload = res["Offload"]
    assert offload["peak_by"]["optimizer"] == offload["peak_by"]["gradients"] == 0
    assert offload["placement"]["device"]["parameters"] == pytest.approx(4 * n, rel=0.01)
    # the device keeps the fp32 parameters and the activations, and none of AdamW's moments: below ZeRO-2's peak
    assert offload["peak"] < res["ZeRO-2"]["peak"] - 0.5 * res["ZeRO-2"]["states"]["optimizer"]
