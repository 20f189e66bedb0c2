"""llmedu.hardware.peak: the datasheet peak from /proc/cpuinfo texts of known cores, its refusals, the sweep.

The cpuinfo texts are trimmed copies of real layouts (an AMD EPYC Genoa VM, an Intel Xeon with SMT);
speeds are never asserted, only which size the sweep picks.
"""

import pytest
import torch

from llmedu.hardware import peak
from llmedu.hardware.probe import Measurement


def cpuinfo(
    vendor="AuthenticAMD",
    family=25,
    model=17,
    flags="fma avx2 avx512f avx512_bf16",
    name="AMD EPYC",
    mhz="2596.150",
    cpus=2,
    threads_per_core=1,
):
    blocks = []
    for p in range(cpus):
        lines = [
            f"processor\t: {p}",
            f"vendor_id\t: {vendor}",
            f"cpu family\t: {family}",
            f"model\t\t: {model}",
            f"model name\t: {name}",
            "physical id\t: 0",
            f"core id\t\t: {p // threads_per_core}",
            f"flags\t\t: fpu sse {flags}",
        ]
        if mhz is not None:
            lines.insert(5, f"cpu MHz\t\t: {mhz}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def test_zen4_fp32_is_32_flop_per_cycle_double_pumped():
    spec = peak.datasheet_peak(torch.float32, cpuinfo=cpuinfo(), cpus={0, 1})
    assert (spec.cores, spec.flop_per_cycle, spec.dtype) == (2, 32, "fp32")
    assert spec.clock_hz == pytest.approx(2596.15e6)
    assert spec.flops == pytest.approx(2 * 2596.15e6 * 32)
    assert "Zen 4" in spec.core_kind and "double-pumped" in spec.core_kind
    assert "cpu MHz" in spec.clock_source and "boost" in str(spec)


def test_zen4_bf16_doubles_through_avx512_bf16():
    spec = peak.datasheet_peak("bf16", cpuinfo=cpuinfo(), cpus={0, 1})
    assert spec.flop_per_cycle == 64 and "avx512_bf16" in spec.core_kind


def test_zen3_without_avx512_is_32():
    spec = peak.datasheet_peak(cpuinfo=cpuinfo(model=1, flags="fma avx2"), cpus={0, 1})
    assert spec.flop_per_cycle == 32 and "Zen 3" in spec.core_kind


def test_intel_avx512_is_64_and_clock_from_model_name_and_smt_counted_once():
    text = cpuinfo(
        "GenuineIntel",
        6,
        85,
        "fma avx2 avx512f",
        "Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz",
        mhz="3100.000",
        cpus=4,
        threads_per_core=2,
    )
    spec = peak.datasheet_peak(cpuinfo=text, cpus={0, 1, 2, 3})
    assert (spec.cores, spec.flop_per_cycle) == (2, 64)  # 4 hardware threads on 2 cores
    assert spec.clock_hz == pytest.approx(2.4e9) and "model name" in spec.clock_source


def test_intel_avx2_is_32_and_only_allowed_cpus_count():
    text = cpuinfo("GenuineIntel", 6, 60, "fma avx2", "Intel(R) Core(TM) i7-4770 CPU @ 3.40GHz", cpus=4)
    spec = peak.datasheet_peak(cpuinfo=text, cpus={0})
    assert (spec.cores, spec.flop_per_cycle) == (1, 32)


def test_amx_bf16_is_1024():
    text = cpuinfo("GenuineIntel", 6, 143, "fma avx2 avx512f avx512_bf16 amx_bf16", "Intel Xeon @ 2.00GHz")
    assert peak.datasheet_peak("bf16", cpuinfo=text, cpus={0, 1}).flop_per_cycle == 1024


def test_unknown_core_raises_naming_what_it_lacks():
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n"
    with pytest.raises(peak.PeakUnknown, match="vendor_id"):
        peak.datasheet_peak(cpuinfo=arm, cpus={0})
    with pytest.raises(peak.PeakUnknown, match="no FLOP/cycle table row for vendor 'HygonGenuine'"):
        peak.datasheet_peak(cpuinfo=cpuinfo(vendor="HygonGenuine"), cpus={0, 1})


def test_missing_clock_and_missing_dtype_raise():
    with pytest.raises(peak.PeakUnknown, match="no clock found"):
        peak.datasheet_peak(cpuinfo=cpuinfo(mhz=None), cpus={0, 1})
    with pytest.raises(peak.PeakUnknown, match="no native fp16"):
        peak.datasheet_peak(torch.float16, cpuinfo=cpuinfo(), cpus={0, 1})
    with pytest.raises(peak.PeakUnknown, match="cpu family 'x'"):
        peak.datasheet_peak(cpuinfo=cpuinfo(family="x"), cpus={0, 1})
    with pytest.raises(peak.PeakUnknown, match="none of the CPUs"):
        peak.datasheet_peak(cpuinfo=cpuinfo(), cpus={7})


def test_this_machine_gives_a_peak_or_says_why():
    try:
        spec = peak.datasheet_peak()
    except peak.PeakUnknown as reason:
        assert str(reason)
    else:
        assert spec.flops > 0 and spec.cores >= 1


def test_best_matmul_peak_picks_the_highest_median(monkeypatch):
    times = {8: (2.0, 1.0, 3.0), 16: (1.0, 0.5, 2.0), 32: (40.0, 40.0, 40.0)}

    def fake(dtype, n, device=None, repeats=5):
        return Measurement(f"matmul {n}", 2.0 * n**3, "FLOP/s", times[n])

    monkeypatch.setattr(peak, "measure_matmul_flops", fake)
    result = peak.best_matmul_peak(sizes=(8, 16, 32))
    assert result.best.what == "matmul 16" and len(result.sweep) == 3
    assert result.flops == pytest.approx(2 * 16**3 / 1.0)
    assert result.spread == pytest.approx((2 * 16**3 / 2.0, 2 * 16**3 / 0.5))


def test_best_matmul_peak_runs_and_rejects_bad_sizes():
    result = peak.best_matmul_peak(sizes=(16, 32), repeats=2)
    assert result.flops > 0 and str(result).startswith("best of 2 sizes")
    with pytest.raises(ValueError, match="sizes must be positive ints"):
        peak.best_matmul_peak(sizes=(0,))
