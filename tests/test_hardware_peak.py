"""llmedu.hardware.peak: the datasheet peak from /proc/cpuinfo texts of known cores, its refusals, the sweep.

The cpuinfo texts are trimmed copies of real layouts (an AMD EPYC Genoa VM, an Intel Xeon with SMT);
speeds are never asserted, only which size the sweep picks. The kernel's cpufreq files are hidden (as in
a VM) unless a test provides them, so the host's own do not leak into these cases.
"""

import pytest
import torch

from llmedu.hardware import peak
from llmedu.hardware.probe import Measurement


@pytest.fixture(autouse=True)
def no_cpufreq(monkeypatch):
    real = peak._read
    monkeypatch.setattr(peak, "_read", lambda path: None if "cpufreq" in path else real(path))


def cpuinfo(
    vendor="AuthenticAMD",
    family=25,
    model=17,
    flags="fma avx2 avx512f avx512_bf16 hypervisor",
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
    assert "cpu MHz" in spec.clock_source and "a VM" in spec.clock_source and "at base clock" in str(spec)


def test_zen4_bf16_doubles_through_avx512_bf16():
    spec = peak.datasheet_peak("bf16", cpuinfo=cpuinfo(), cpus={0, 1})
    assert spec.flop_per_cycle == 64 and "avx512_bf16" in spec.core_kind


def test_zen3_without_avx512_is_32():
    spec = peak.datasheet_peak(cpuinfo=cpuinfo(model=1, flags="fma avx2 hypervisor"), cpus={0, 1})
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
    with pytest.raises(peak.PeakUnknown, match="no base clock found.*no 'cpu MHz' line"):
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


def test_zen5_raises_because_mobile_parts_have_half_the_pipe_width():
    with pytest.raises(peak.PeakUnknown, match="family 26 .*mobile parts 256-bit"):
        peak.datasheet_peak(cpuinfo=cpuinfo(family=26, model=36, name="AMD Ryzen AI 9 HX 370"), cpus={0, 1})


@pytest.mark.parametrize(
    "model, name",
    [
        (85, "Intel(R) Xeon(R) Silver 4114 CPU @ 2.20GHz"),
        (85, "Intel(R) Xeon(R) Gold 5218 CPU @ 2.30GHz"),
        (140, "11th Gen Intel(R) Core(TM) i7-1165G7 @ 2.80GHz"),
        (167, "11th Gen Intel(R) Core(TM) i9-11900K @ 3.50GHz"),
    ],
)
def test_intel_avx512_with_one_fma_unit_is_32(model, name):
    text = cpuinfo("GenuineIntel", 6, model, "fma avx2 avx512f", name)
    spec = peak.datasheet_peak(cpuinfo=text, cpus={0, 1})
    assert spec.flop_per_cycle == 32 and "one 512-bit FMA unit" in spec.core_kind


def test_intel_avx512_two_units_by_model_and_by_xeon_tier():
    spr = cpuinfo("GenuineIntel", 6, 143, "fma avx2 avx512f hypervisor", "Intel(R) Xeon(R) Platinum 8480+")
    gold = cpuinfo("GenuineIntel", 6, 85, "fma avx2 avx512f", "Intel(R) Xeon(R) Gold 5122 CPU @ 3.60GHz")
    for text in (spr, gold):
        assert peak.datasheet_peak(cpuinfo=text, cpus={0, 1}).flop_per_cycle == 64


def test_intel_avx512_part_the_table_does_not_list_raises_naming_the_fma_units():
    text = cpuinfo("GenuineIntel", 6, 85, "fma avx2 avx512f", "Intel Xeon Processor (Cascadelake)")
    with pytest.raises(peak.PeakUnknown, match="Cascadelake.*one or two 512-bit FMA units"):
        peak.datasheet_peak(cpuinfo=text, cpus={0, 1})


def test_intel_hybrid_raises_by_flag_and_by_model():
    by_flag = cpuinfo("GenuineIntel", 6, 999, "fma avx2 hybrid_cpu", "Intel(R) Core(TM) Ultra 7 @ 1.40GHz")
    by_model = cpuinfo("GenuineIntel", 6, 151, "fma avx2", "12th Gen Intel(R) Core(TM) i9-12900K")
    for text in (by_flag, by_model):
        with pytest.raises(peak.PeakUnknown, match="hybrid CPU: its P-cores do 32 fp32 FLOP/cycle, its E-cores 16"):
            peak.datasheet_peak(cpuinfo=text, cpus={0, 1})


def test_intel_e_core_only_part_is_16():
    text = cpuinfo("GenuineIntel", 6, 190, "fma avx2 hypervisor", "Intel(R) N100")
    spec = peak.datasheet_peak(cpuinfo=text, cpus={0, 1})
    assert spec.flop_per_cycle == 16 and "Gracemont" in spec.core_kind


def test_bare_metal_cpu_mhz_is_not_a_base_clock(monkeypatch):
    bare = cpuinfo(flags="fma avx2 avx512f", name="AMD Ryzen 9 7950X 16-Core Processor", mhz="4712.000")
    with pytest.raises(peak.PeakUnknown, match="on bare metal, the clock of the moment"):
        peak.datasheet_peak(cpuinfo=bare, cpus={0, 1})
    nominal = "/sys/devices/system/cpu/cpu0/cpufreq/amd_pstate_nominal_freq"
    monkeypatch.setattr(peak, "_read", lambda path: "4500000\n" if path == nominal else None)
    spec = peak.datasheet_peak(cpuinfo=bare, cpus={0, 1})
    assert spec.clock_hz == pytest.approx(4.5e9) and "amd_pstate_nominal_freq" in spec.clock_source


def test_implied_clock_is_the_measurement_over_cores_and_flop_per_cycle():
    spec = peak.datasheet_peak(cpuinfo=cpuinfo(), cpus={0, 1})  # 2 cores x 32 fp32 FLOP/cycle
    assert spec.implied_clock_hz(199e9) == pytest.approx(199e9 / 64)
    assert spec.implied_clock_hz(spec.flops) == pytest.approx(spec.clock_hz)
