"""llmedu.hardware: FLOP and byte counts, the roofline, the spec table, the probe, GPT-3's cost.

References: ``torch.utils.flop_counter`` (PyTorch's own FLOP counter) for the matmul and attention
FLOPs; hand-computed cases for the byte counts; Brown et al. 2020, Table D.1, for GPT-3's compute.
Speeds are never asserted: other processes share the CPU.
"""

import math
import statistics

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from llmedu import hardware as hw
from llmedu import runtime
from llmedu.hardware import probe


# -- FLOP counts against PyTorch's counter --------------------------------------------------------
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (5, 7, 3), (64, 128, 32)])
def test_matmul_flops_match_torch_flop_counter(m, k, n):
    a, b = torch.randn(m, k), torch.randn(k, n)
    with FlopCounterMode(display=False) as counter:
        a @ b
    assert hw.matmul_flops(m, k, n) == counter.get_total_flops() == 2 * m * k * n


def test_attention_matmul_flops_match_torch_sdpa_formula():
    b, h, t, d = 2, 3, 16, 8
    ours = hw.attention(b, h, t, d).flops - hw.softmax(b * h * t, t).flops  # the two matmuls only
    assert ours == sdpa_flop_count((b, h, t, d), (b, h, t, d), (b, h, t, d)) == 4 * b * h * t * t * d


# -- byte counts and intensities, by hand -----------------------------------------------------------
def test_square_matmul_intensity_is_n_over_3_in_bf16():
    w = hw.matmul(4096, 4096, 4096, bytes_per_element=2)
    assert w.flops == 2 * 4096**3
    assert w.bytes == 3 * 4096**2 * 2
    assert w.intensity == pytest.approx(4096 / 3, rel=1e-12)


def test_matrix_vector_product_is_memory_bound_everywhere():
    w = hw.matmul(1, 4096, 4096, bytes_per_element=2)  # one token through a layer: decoding
    assert w.intensity == pytest.approx(2 * 4096 * 4096 / ((4096 + 4096 * 4096 + 4096) * 2))
    assert w.intensity < 1.0
    assert all(hw.bound(w, a.peak_flops_16bit, a.memory_bandwidth) == "memory" for a in hw.ACCELERATORS)


def test_softmax_and_layernorm_counts():
    s = hw.softmax(3, 5, bytes_per_element=4)
    assert (s.flops, s.bytes) == (5 * 15, 2 * 15 * 4)
    assert s.intensity == pytest.approx(5 / 8)
    ln = hw.layernorm(3, 5, bytes_per_element=2)
    assert (ln.flops, ln.bytes) == (7 * 15, (2 * 15 + 2 * 5) * 2)


def test_attention_bytes_standard_and_fused():
    b, h, t, d = 1, 2, 4, 3
    std, fused = hw.attention(b, h, t, d), hw.attention(b, h, t, d, fused=True)
    assert std.flops == fused.flops == b * h * (4 * t * t * d + 5 * t * t)
    assert std.bytes == b * h * (4 * t * d + 4 * t * t) * 2
    assert fused.bytes == b * h * 4 * t * d * 2
    # GPT-3 sized heads on an H100: the standard kernel is memory-bound, the fused one is not
    h100 = hw.accelerator("H100 SXM")
    peak, bandwidth = h100.peak_flops_16bit, h100.memory_bandwidth
    assert hw.bound(hw.attention(1, 96, 2048, 128), peak, bandwidth) == "memory"
    assert hw.bound(hw.attention(1, 96, 2048, 128, fused=True), peak, bandwidth) == "compute"


def test_roofline_two_regimes_and_ridge():
    peak, bw = 100.0, 10.0
    assert hw.ridge_point(peak, bw) == 10.0
    assert hw.attainable_flops(2.0, peak, bw) == 20.0  # memory-bound: I * B
    assert hw.attainable_flops(10.0, peak, bw) == 100.0  # at the ridge both roofs meet
    assert hw.attainable_flops(50.0, peak, bw) == 100.0  # compute-bound: the peak


@pytest.mark.parametrize(
    "call",
    [
        lambda: hw.matmul_flops(0, 2, 2),
        lambda: hw.matmul(2, 2.5, 2),
        lambda: hw.softmax(2, 2, bytes_per_element=0),
        lambda: hw.attention(1, 1, -4, 8),
        lambda: hw.arithmetic_intensity(10, 0),
        lambda: hw.attainable_flops(-1, 1e12, 1e12),
        lambda: hw.ridge_point(1e12, float("nan")),
        lambda: hw.attainable_flops(1.0, None, 1e12),
    ],
)
def test_bad_sizes_are_errors(call):
    with pytest.raises(ValueError):
        call()


# -- the spec table ----------------------------------------------------------------------------
def test_every_row_cites_a_source_and_is_plausible():
    names = [a.name for a in hw.ACCELERATORS]
    assert len(set(names)) == len(names)
    for a in hw.ACCELERATORS:
        assert len(a.source) > 20, a.name
        assert a.kind in {"GPU", "TPU", "IPU"} and a.format_16bit in {"bf16", "fp16"}
        assert a.peak_flops_16bit > 0 and a.memory_bytes > 0 and a.memory_bandwidth > 0
        if a.peak_flops_fp32 is not None:  # fp32 is slower than 16-bit on every one of these chips
            assert a.peak_flops_fp32 < a.peak_flops_16bit
    for wanted in ["V100", "A100", "H100", "TPU v4", "TPU v5e", "TPU v5p", "GC200"]:
        assert any(wanted in n for n in names), wanted


def test_spec_table_lookup_and_text():
    assert hw.accelerator("h100 sxm").peak_flops_16bit == 989e12
    with pytest.raises(KeyError, match="known: V100"):
        hw.accelerator("B200")
    text = hw.spec_table()
    assert text.count("\n") == len(hw.ACCELERATORS) + 1
    assert "295" in text  # the H100's ridge point, 989e12 / 3.35e12
    assert hw.si(9.89e14, "FLOP/s") == "989 TFLOP/s" and hw.si(None, "B") == "-"


# -- GPT-3's cost ------------------------------------------------------------------------------
def test_gpt3_training_flops_agree_with_the_paper():
    flops = hw.training_flops(hw.GPT3_PARAMS, hw.GPT3_TOKENS)
    assert flops == 6 * 175e9 * 300e9 == pytest.approx(3.15e23)
    assert flops == pytest.approx(3.14e23, rel=0.01)  # Brown et al. 2020, Table D.1


def test_training_days_arithmetic():
    h100 = hw.accelerator("H100 SXM")
    flops = hw.training_flops(hw.GPT3_PARAMS, hw.GPT3_TOKENS)
    one = hw.training_days(flops, h100, mfu=0.4)
    assert one == pytest.approx(3.15e23 / (989e12 * 0.4) / 86400)  # ~9216 days, ~25 years
    assert hw.training_days(flops, h100, mfu=0.4, n_chips=1024) == pytest.approx(one / 1024)
    assert hw.training_days(flops, 989e12, mfu=0.8) == pytest.approx(one / 2)
    with pytest.raises(ValueError, match="mfu"):
        hw.training_days(flops, h100, mfu=40)
    with pytest.raises(ValueError, match="n_chips"):
        hw.training_days(flops, h100, n_chips=0)


def test_chips_to_hold_gpt3_training_state():
    assert hw.chips_to_hold(175e9, hw.accelerator("H100 SXM")) == math.ceil(175e9 * 16 / 80e9) == 35
    assert hw.chips_to_hold(175e9, hw.accelerator("IPU GC200 (Colossus MK2)")) == math.ceil(175e9 * 16 / 900e6)


# -- the probe ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16", torch.float32])
def test_matmul_probe_returns_positive_finite_flops(dtype):
    m = hw.measure_matmul_flops(dtype, n=32, device="cpu", repeats=2, warmup=1, min_seconds=0.001)
    assert m.work == 2 * 32**3 and m.unit == "FLOP/s" and len(m.seconds) == 2
    assert 0 < m.median <= m.best < math.inf
    assert str(m).startswith("matmul (32x32)@(32x32)") and str(m).endswith("FLOP/s")


def test_bandwidth_probe_counts_read_and_write():
    m = hw.measure_bandwidth(4096, device="cpu", repeats=2, warmup=1, min_seconds=0.001)
    assert m.work == 2 * 4096 and m.unit == "B/s"
    assert 0 < m.median <= m.best < math.inf


@pytest.mark.parametrize("dtype", ["int8", "float32", torch.int8, torch.float64, None])
def test_unknown_dtype_is_a_clear_error(dtype):
    with pytest.raises(ValueError, match=r"accepted: 'fp32' \(torch.float32\), 'bf16' \(torch.bfloat16\)"):
        hw.measure_matmul_flops(dtype, n=8, device="cpu")


def test_probe_rejects_bad_sizes():
    with pytest.raises(ValueError, match="n must be a positive int"):
        hw.measure_matmul_flops("fp32", n=0, device="cpu")
    with pytest.raises(ValueError, match="smaller than one fp32 element"):
        hw.measure_bandwidth(3, device="cpu")


def test_measure_machine_is_a_spec_row():
    row = hw.measure_machine("cpu", n=32, nbytes=4096, repeats=1)
    assert row.kind == "CPU" and row.name == "this machine (cpu)" and "measured" in row.source
    for value in (row.peak_flops_16bit, row.peak_flops_fp32, row.memory_bytes, row.memory_bandwidth):
        assert 0 < value < math.inf
    assert row.ridge_point > 0


def test_machine_row_takes_the_medians_it_is_given():
    from llmedu.hardware.probe import Measurement, machine_row

    bf16, fp32 = Measurement("bf16 best", 8.0, "FLOP/s", (1.0, 2.0, 4.0)), Measurement("fp32", 6.0, "FLOP/s", (3.0,))
    row = machine_row(bf16, fp32, Measurement("read", 10.0, "B/s", (5.0,)), device="cpu")
    assert (row.peak_flops_16bit, row.peak_flops_fp32, row.memory_bandwidth) == (4.0, 2.0, 2.0)
    assert "bf16 best" in row.source and row.kind == "CPU"


def test_machine_summary_names_torch_and_device():
    text = hw.machine_summary("cpu")
    assert torch.__version__ in text and "cpu" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_probe_runs_on_cuda():
    for dtype in ("fp32", "bf16"):
        m = hw.measure_matmul_flops(dtype, n=256, device="cuda", repeats=2, warmup=1, min_seconds=0.001)
        assert 0 < m.best < math.inf
    assert 0 < hw.measure_bandwidth(2**20, device="cuda", repeats=2, min_seconds=0.001).best < math.inf


# -- the read probe, the kernel timer, the cache and the spread ----------------------------------------
def test_read_probe_counts_each_byte_once():
    m = hw.measure_read_bandwidth(4096, device="cpu", repeats=5, warmup=1, min_seconds=0.001)
    assert m.work == 4096 and m.unit == "B/s" and len(m.seconds) == 5
    assert str(m).startswith("read (sum) of 4.1 kB on cpu: median")


def test_read_probe_reads_a_written_buffer(monkeypatch):
    """An untouched buffer reads the OS's zero page from the cache: the probe must write its buffer first."""
    made = []
    real_ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *a, **k: made.append(a) or real_ones(*a, **k))
    hw.measure_read_bandwidth(4096, device="cpu", repeats=1, warmup=0, min_seconds=0.0)
    assert made == [(1024,)]


def test_measurement_reports_median_and_range():
    m = hw.Measurement("k", 10.0, "FLOP/s", (1.0, 2.0, 5.0, 4.0, 2.5))
    assert m.median == 10.0 / 2.5 and m.best == 10.0 and m.spread == (2.0, 10.0)
    assert str(m) == "k: median 4 FLOP/s of 5 repeats, range 2 FLOP/s to 10 FLOP/s"
    fast = hw.Measurement("k", 2e10, "B/s", (1.0, 2.0, 1.25))
    assert fast.brief() == "16 GB/s (10-20)"


def test_measure_kernel_times_any_call_and_rejects_bad_work():
    x = torch.ones(1000)
    m = hw.measure_kernel("sum", x.sum, 4000, "B/s", device="cpu", repeats=5, min_seconds=0.001)
    assert m.work == 4000 and len(m.seconds) == 5 and 0 < m.median < math.inf
    with pytest.raises(ValueError, match="work must be the positive FLOPs or bytes of one call, got 0"):
        hw.measure_kernel("sum", x.sum, 0, device="cpu")


@pytest.mark.parametrize(
    "caches, expected",
    [([("L1d", "32K"), ("L2", "1024K"), ("L3", "32768K")], 32 * 2**20), ([("L2", "2M")], 2**21), ([], None)],
)
def test_last_level_cache_is_the_largest_data_cache(monkeypatch, caches, expected):
    monkeypatch.setattr(runtime, "_cpu_caches", lambda: caches)
    assert hw.last_level_cache_bytes() == expected


def test_default_buffer_outgrows_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(runtime, "FAST", True)
    monkeypatch.setattr(runtime, "_cpu_caches", lambda: [("L3", "32768K")])
    assert probe.default_nbytes("cpu") == 128 * 2**20  # 4x the L3, above the 64 MiB floor
    monkeypatch.setattr(runtime, "_cpu_caches", lambda: [("L3", "491520K")])  # a 480 MiB L3
    assert probe.default_nbytes("cpu") == 4 * 480 * 2**20
    monkeypatch.setattr(runtime, "_cpu_caches", lambda: [])
    assert probe.default_nbytes("cpu") == 64 * 2**20


def test_every_row_cites_its_interconnect():
    for row in hw.ACCELERATORS:
        assert row.link and row.link_source, row.name
        assert row.link_bandwidth is None or 100e9 <= row.link_bandwidth <= 2e12, row.name
    text = hw.interconnect_table()
    assert "H100 SXM" in text and "900" in text and "1,200" in text


# -- measuring in rounds -----------------------------------------------------------------------------
def _drifting(names):
    """Benchmarks of one identical kernel whose every timing is 1 s slower than the last: a steady drift."""
    log = []

    def timer(name):
        log.append(name)
        return float(len(log))

    return {name: hw.Benchmark(name, lambda name=name: timer(name), 1.0, "call/s") for name in names}, log


def test_rounds_time_every_benchmark_once_per_round_reversing_the_order():
    benchmarks, log = _drifting("abc")
    measured = hw.measure_in_rounds(benchmarks, rounds=4)
    assert "".join(log) == "abccbaabccba"
    assert [len(m.seconds) for m in measured.values()] == [4, 4, 4]


def test_rounds_give_a_steady_drift_to_every_benchmark_alike():
    """Timed one after another (all of a's repeats, then all of b's), b's median would be 4 s slower than a's for
    the same kernel, and in rounds of one order 1 s; with the order reversed every other round, the medians are equal."""
    benchmarks, _ = _drifting("ab")
    measured = hw.measure_in_rounds(benchmarks, rounds=4)
    assert measured["a"].seconds == (1.0, 4.0, 5.0, 8.0) and measured["b"].seconds == (2.0, 3.0, 6.0, 7.0)
    assert statistics.median(measured["a"].seconds) == statistics.median(measured["b"].seconds) == 4.5
    assert measured["a"].spread == (1 / 8, 1 / 1)


def test_matmul_benchmark_sizes_its_batch_and_rejects_bad_input():
    b = hw.matmul_benchmark("fp32", 32, device="cpu", warmup=1, min_seconds=0.001)
    assert b.work == 2 * 32**3 and b.calls >= 1 and b.what == "matmul (32x32)@(32x32) fp32 on cpu"
    (m,) = hw.measure_in_rounds({"m": b}, rounds=2).values()
    assert len(m.seconds) == 2 and 0 < m.median < math.inf
    with pytest.raises(ValueError, match="rounds must be a positive int, got 0"):
        hw.measure_in_rounds({"m": b}, rounds=0)
    with pytest.raises(ValueError, match="benchmarks is empty"):
        hw.measure_in_rounds({})
    with pytest.raises(ValueError, match="work must be the positive FLOPs or bytes of one call, got 0"):
        hw.benchmark("nothing", lambda: None, 0, device="cpu")
