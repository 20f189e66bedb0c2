"""Graders for lesson 00 (hardware): FLOP counts, arithmetic intensity, the roofline, a probe.

    check_matmul_flops(fn)          fn(m, k, n) -> FLOPs of an (m, k) @ (k, n) matmul
    check_arithmetic_intensity(fn)  fn(m, k, n, bytes_per_element) -> FLOP per byte of that matmul
    check_attainable_flops(fn)      fn(intensity, peak_flops, bandwidth) -> the roofline, in FLOP/s
    check_compute_bound_batch(fn)   fn(k, n, peak_flops, bandwidth, bytes_per_element) -> smallest batch b
                                    for which (b, k) @ (k, n) reaches the ridge point
    check_elementwise_intensity(fn) fn(n_inputs, bytes_per_element, write_allocate) -> FLOP/B of summing
                                    n_inputs tensors elementwise (the output counted once more when stores
                                    first read their cache line)
    check_decode_throughput(fn)     fn(n_params, bytes_per_param, batch, peak_flops, bandwidth) -> the roofline's
                                    bound on tokens/s of decoding (both roofs: a memory-only answer fails)
    check_read_probe(fn)            fn(nbytes) -> (bytes read per call, seconds of >= 5 timed calls): a read
                                    bandwidth probe, graded on the ops it runs (recorded), not on the clock
    check_gap_prediction(gap)       {line: factor}: how much of the buggy probe's gap each fault explains

Each compares the learner's answer with ``llmedu.hardware.roofline`` on a few cases, square and
not, small and GPT-3 sized, on both sides of a ridge point; the cases are not the lesson's own.
"""

from __future__ import annotations

import math

from ..hardware import roofline
from .core import CheckResult, Grader
from .read_probe import check_gap_prediction, check_read_probe

__all__ = [
    "check_matmul_flops",
    "check_arithmetic_intensity",
    "check_attainable_flops",
    "check_compute_bound_batch",
    "check_elementwise_intensity",
    "check_decode_throughput",
    "check_read_probe",
    "check_gap_prediction",
]

_SHAPES = [(2, 3, 4), (1, 1, 1), (64, 128, 32), (4096, 12288, 12288)]  # last: a GPT-3 projection


def check_matmul_flops(fn) -> CheckResult:
    """``fn(m, k, n)`` must return the FLOPs of an (m, k) @ (k, n) matmul (a multiply-add is 2 FLOPs)."""
    g = Grader("check_matmul_flops")
    for m, k, n in _SHAPES:
        got = g.call(fn, m, k, n)
        if isinstance(got, (int, float)) and got == m * k * n:  # the most common slip, named
            g.expect(
                f"({m}x{k})@({k}x{n})",
                False,
                f"got {got}, which counts multiply-adds; each is 2 FLOPs (a multiply and an add)",
            )
        if isinstance(got, (int, float)) and got == m * n * (2 * k - 1) != m * k * n:
            g.expect(
                f"({m}x{k})@({k}x{n})",
                False,
                f"got {got}, the exact count m*n*(2k-1); the convention (also torch.utils.flop_counter's) "
                "counts k multiply-adds per output, 2 FLOPs each",
            )
        g.compare(f"({m}x{k})@({k}x{n})", got, roofline.matmul_flops(m, k, n), rtol=1e-12)
    return g.result()


def check_arithmetic_intensity(fn) -> CheckResult:
    """``fn(m, k, n, bytes_per_element)``: FLOPs / bytes of the matmul, each matrix moved once."""
    g = Grader("check_arithmetic_intensity")
    for m, k, n in _SHAPES:
        for size in (2, 4):  # bf16, fp32
            expected = roofline.matmul(m, k, n, bytes_per_element=size).intensity
            # a float to 1e-9 relative: the answer is a ratio of integers, only rounding may differ
            g.compare(f"({m}x{k})@({k}x{n}) with {size}-byte elements", g.call(fn, m, k, n, size), expected, rtol=1e-9)
    return g.result()


def check_attainable_flops(fn) -> CheckResult:
    """``fn(intensity, peak_flops, bandwidth)`` must return ``min(peak, intensity * bandwidth)``."""
    g = Grader("check_attainable_flops")
    peak, bandwidth = 989e12, 3.35e12  # H100 SXM: ridge point at ~295 FLOP/B
    for intensity in (0.25, 1.25, 60.8, 295.0, 1365.3):
        g.compare(
            f"intensity {intensity} FLOP/B on a {peak:.3g} FLOP/s, {bandwidth:.3g} B/s chip",
            g.call(fn, intensity, peak, bandwidth),
            roofline.attainable_flops(intensity, peak, bandwidth),
            rtol=1e-9,
        )
    return g.result()


def _smallest_compute_bound_batch(k: int, n: int, peak: float, bandwidth: float, size: int) -> int:
    """By search, not by formula: the first b whose matmul's intensity reaches peak / bandwidth."""
    ridge, b = peak / bandwidth, 1
    while roofline.matmul(b, k, n, bytes_per_element=size).intensity < ridge:
        b += 1
    return b


def check_compute_bound_batch(fn) -> CheckResult:
    """``fn(k, n, peak_flops, bandwidth, bytes_per_element)``: the smallest batch that is compute-bound."""
    g = Grader("check_compute_bound_batch")
    chips = {  # name: (peak, bandwidth, bytes per element); the CPU's in fp32, so a hard-wired 2 fails
        "H100 SXM": (989e12, 3.35e12, 2),
        "A100 SXM": (312e12, 2.039e12, 2),
        "IPU GC200": (250e12, 47.5e12, 2),
        "a CPU at 150 GFLOP/s and 30 GB/s": (150e9, 30e9, 4),
    }
    shapes = ((12288, 12288), (4096, 11008), (12288, 12288), (4096, 4096))
    for (chip, (peak, bw, size)), (k, n) in zip(chips.items(), shapes):
        expected = _smallest_compute_bound_batch(k, n, peak, bw, size)
        got = g.call(fn, k, n, peak, bw, size)
        if isinstance(got, (int, float)) and got == math.ceil(peak / bw) != expected:
            g.expect(
                f"{chip}, (b x {k}) @ ({k} x {n})",
                False,
                f"got {got}, the ridge point itself; the weights' bytes count too, so the batch must be larger",
            )
        g.compare(f"{chip}, (b x {k}) @ ({k} x {n}), {size}-byte elements", got, expected)
    return g.result()


def check_elementwise_intensity(fn) -> CheckResult:
    """Summing n tensors: n - 1 adds per element; n reads, one write, and one more read of the output's
    cache line when the cache allocates on a write."""
    g = Grader("check_elementwise_intensity")
    for n_inputs, size, write_allocate in ((2, 2, False), (2, 4, True), (3, 4, False), (8, 2, True)):
        expected = (n_inputs - 1) / ((n_inputs + 1 + int(write_allocate)) * size)
        case = f"{n_inputs} inputs, {size}-byte elements, write-allocate {write_allocate}"
        g.compare(case, g.call(fn, n_inputs, size, write_allocate), expected, rtol=1e-9)
    return g.result()


def _decode_bound(n_params: float, bytes_per_param: float, batch: int, peak: float, bandwidth: float) -> float:
    """Tokens/s: one step reads every weight once and does 2 * n_params FLOPs per token; the slower roof wins."""
    step = max(2 * n_params * batch / peak, n_params * bytes_per_param / bandwidth)
    return batch / step


def check_decode_throughput(fn) -> CheckResult:
    """``fn(n_params, bytes_per_param, batch, peak_flops, bandwidth)``: the roofline's bound on decoding tokens/s.

    One decoding step multiplies ``batch`` tokens by every weight: 2 * n_params FLOPs per token, and the
    weights read once per step (the KV cache and activations left out). Cases on both sides of the
    ridge, so an answer with one roof fails where the other one binds.
    """
    g = Grader("check_decode_throughput")
    cases = [  # (what, n_params, bytes per parameter, batch, peak FLOP/s, bandwidth B/s)
        ("7B in bf16 on an H100, batch 1", 7e9, 2, 1, 989e12, 3.35e12),
        ("7B in bf16 on an H100, batch 1024", 7e9, 2, 1024, 989e12, 3.35e12),
        ("70B in bf16 on a TPU v5p, batch 64", 70e9, 2, 64, 459e12, 2.765e12),
        ("7B in int8 on an A100, batch 512", 7e9, 1, 512, 312e12, 2.039e12),
    ]
    for what, n_params, size, batch, peak, bw in cases:
        expected = _decode_bound(n_params, size, batch, peak, bw)
        got = g.call(fn, n_params, size, batch, peak, bw)
        if isinstance(got, (int, float)) and not isinstance(got, bool):
            memory_only = batch * bw / (n_params * size)
            compute_only = peak / (2 * n_params)
            if math.isclose(got, memory_only, rel_tol=1e-6) and not math.isclose(got, expected, rel_tol=1e-6):
                g.expect(
                    what,
                    False,
                    f"got {got:.4g}, the memory roof alone: at batch {batch} the step's {2 * n_params * batch:.3g} FLOPs "
                    "take longer than reading the weights once, so the compute roof binds",
                )
            if math.isclose(got, compute_only, rel_tol=1e-6) and not math.isclose(got, expected, rel_tol=1e-6):
                g.expect(
                    what,
                    False,
                    f"got {got:.4g}, the compute roof alone: at batch {batch} reading the "
                    f"{n_params * size:.3g} bytes of weights takes longer than the arithmetic",
                )
            if math.isclose(got, expected / batch, rel_tol=1e-6) and batch > 1:
                g.expect(what, False, f"got {got:.4g}, the steps per second; each step makes {batch} tokens")
        g.compare(what, got, expected, rtol=1e-6)
    return g.result()
