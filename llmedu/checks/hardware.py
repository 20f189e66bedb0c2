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

Each compares the learner's answer with ``llmedu.hardware.roofline`` on a few cases, square and
not, small and GPT-3 sized, on both sides of a ridge point; the cases are not the lesson's own.
"""

from __future__ import annotations

import math
import statistics
import time
from unittest import mock

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..hardware import probe, roofline
from .core import CheckResult, Grader

__all__ = [
    "check_matmul_flops",
    "check_arithmetic_intensity",
    "check_attainable_flops",
    "check_compute_bound_batch",
    "check_elementwise_intensity",
    "check_decode_throughput",
    "check_read_probe",
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


# -- a read-bandwidth probe, graded by the ops it runs ----------------------------------------------
_UNWRITTEN = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")  # outputs hold garbage
_WRITE_ONLY = ("fill_", "zero_", "uniform_", "normal_", "random_", "bernoulli_", "exponential_", "copy_")


class _ReadRecorder(TorchDispatchMode):
    """Which storages were written, and each op that reads a tensor of at least ``nbytes``: (op name, whether
    every such input was written first, the bytes the op wrote, the bytes of those inputs, i.e. what it read)."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.nbytes, self.written, self.big_reads = nbytes, set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        read_args = args[1:] if name in _WRITE_ONLY else args  # a fill_ or copy_ does not read its destination
        inputs = [t for t in pytree.tree_leaves((read_args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        big = {_key(t): t.numel() * t.element_size() for t in inputs if t.numel() * t.element_size() >= self.nbytes}
        if big and not func.is_view:
            written = sum(t.numel() * t.element_size() for t in outputs)
            self.big_reads.append((name, all(key in self.written for key in big), written, sum(big.values())))
        if name in _WRITE_ONLY and args:
            self.written.add(_key(args[0]))
        elif name in _UNWRITTEN:  # a new buffer, perhaps at the address of a freed, written one
            self.written.difference_update(_key(t) for t in outputs)
        elif not func.is_view:
            self.written.update(_key(t) for t in outputs)
        return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _refuse_library_timing(*args, **kwargs):
    raise RuntimeError("llmedu's own probe was called: the exercise asks for your timing loop, not measure_*()")


def check_read_probe(fn, nbytes: int | None = None) -> CheckResult:
    """``fn(nbytes) -> (bytes_per_call, seconds)``: a read-bandwidth probe on the CPU.

    The method, from the ops the probe runs: the kernel it times reads a buffer of at least ``nbytes``
    that was written first (an untouched ``torch.empty`` reads the OS's shared zero page, from the
    cache), writes almost nothing (a copy measures a copy), and runs once more than it is timed (a
    warm-up); ``bytes_per_call`` is what one call of that kernel reads (the bytes of the tensor it reads, as
    recorded, not the ``nbytes`` asked for: ``torch.ones(nbytes)`` is 4x that); at least 5 repeats, which fit in the call's
    own duration. ``nbytes`` defaults to 4x the last-level cache, at least 64 MiB.
    """
    g = Grader("check_read_probe")
    if nbytes is None:
        nbytes = max(4 * (probe.last_level_cache_bytes() or 0), 64 * 2**20)
    nbytes -= nbytes % 4
    case = f"a probe of {nbytes / 2**20:g} MiB"
    recorder = _ReadRecorder(nbytes)
    start = time.perf_counter()
    with mock.patch.object(probe, "_time_calls", _refuse_library_timing), recorder:
        got = g.call(fn, nbytes)
    wall = time.perf_counter() - start
    if g.failure is not None:
        return g.result()
    shaped = isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[1], (tuple, list))
    if not g.expect(case, shaped, f"expected (bytes_per_call, [seconds, ...]), got {got!r:.80}"):
        return g.result()
    counted, seconds = got
    if not g.expect(
        case,
        len(seconds) >= 5 and all(isinstance(s, float) and s > 0 for s in seconds),
        f"expected at least 5 positive times in seconds, got {seconds!r:.80}",
    ):
        return g.result()
    if not g.expect(case, bool(recorder.big_reads), f"no op read a buffer of {nbytes:,} bytes; one in cache is faster"):
        return g.result()
    kernel = statistics.mode(name for name, *_ in recorder.big_reads)
    calls = [(initialised, written, read) for name, initialised, written, read in recorder.big_reads if name == kernel]
    g.expect(
        case,
        all(initialised for initialised, _, _ in calls),
        f"the timed {kernel} reads a buffer that nothing has written (torch.empty): the OS maps each page of such a "
        "buffer to one shared page of zeros, so it reads the cache, not memory. Write the buffer first",
    )
    g.expect(
        case,
        max(written for _, written, _ in calls) < nbytes // 2,
        f"the timed {kernel} writes as many bytes as it reads: that measures a copy, not a read. Reduce (x.sum())",
    )
    g.expect(case, len(calls) > len(seconds), f"{kernel} ran {len(calls)} times for {len(seconds)} timings: no warm-up")
    g.expect(
        case, sum(seconds) <= wall, f"the seconds add up to {sum(seconds):.3g} s, more than the call's {wall:.3g} s"
    )
    read = max(read for _, _, read in calls)  # the bytes of the buffer the timed kernel actually reads
    if isinstance(counted, (int, float)) and counted == 2 * read:
        g.expect(case, False, f"got {counted:,} bytes per call, 2x the buffer: a read moves each byte once")
    if isinstance(counted, (int, float)) and counted != read and read != nbytes:
        g.expect(
            case,
            False,
            f"got {counted:,} bytes per call, but the timed {kernel} reads a buffer of {read:,} bytes "
            f"({read / nbytes:g}x the {nbytes:,} asked for): count the bytes of the tensor, numel() * element_size()",
        )
    g.compare(f"{case}: bytes per call (what the timed {kernel} reads)", counted, read, rtol=1e-12)
    return g.result()
