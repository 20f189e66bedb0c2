"""Graders for lesson 00 (hardware): FLOP counts, arithmetic intensity, the roofline.

    check_matmul_flops(fn)          fn(m, k, n) -> FLOPs of an (m, k) @ (k, n) matmul
    check_arithmetic_intensity(fn)  fn(m, k, n, bytes_per_element) -> FLOP per byte of that matmul
    check_attainable_flops(fn)      fn(intensity, peak_flops, bandwidth) -> the roofline, in FLOP/s

Each compares the learner's answer with ``llmedu.hardware.roofline`` on a few cases, square and
not, small and GPT-3 sized, on both sides of a ridge point.
"""

from __future__ import annotations

from ..hardware import roofline
from .core import CheckResult, Grader

__all__ = ["check_matmul_flops", "check_arithmetic_intensity", "check_attainable_flops"]

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
