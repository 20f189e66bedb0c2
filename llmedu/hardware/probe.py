"""Measure this machine: matmul FLOP/s per dtype, and memory bandwidth read-only and as a copy.

Two micro-benchmarks give the two numbers a roofline needs (see ``roofline.py``):

* compute: an (n, n) @ (n, n) matmul, which does 2n^3 FLOPs on 3n^2 elements, so for large n it
  is limited by arithmetic, not by memory;
* bandwidth, two ways, each on a buffer several times larger than the last-level cache:
  a *read* (``x.sum()``: every byte read once, one number written), counted as ``nbytes``, and a
  *copy* (``dst.copy_(src)``), counted as ``2 * nbytes`` (every byte read once and written once).
  The two differ because a write costs the memory bus more than a read: a cache that allocates
  on a write first reads the line it will overwrite (unless the copy uses streaming stores), and
  DRAM loses cycles each time it turns from reading to writing. A kernel that mostly reads (a
  matrix-vector product) has the read roof; one that writes as much as it reads, the copy roof.

Timing follows ``timeit``'s rules: a warm-up (first calls pay for allocation, page faults and
kernel selection), then enough calls per repeat that one repeat lasts at least ``min_seconds``
(so that the clock and, on a GPU, the synchronisation are negligible), then several repeats.
A ``Measurement`` keeps every repeat: its median is the figure to quote, its range the spread.
``llmedu.runtime.Timer`` synchronises the device, so kernels are counted where they run.

A small buffer measures the fixed cost of a call (Python, dispatch, waking torch's threads, a few
microseconds), not a bandwidth: read its seconds per call (``Measurement.seconds``) before its rate.
And a read probe run on a few cores measures what those cores can pull, not what the DRAM can give:
by Little's law, bandwidth = bytes in flight / latency, and each core keeps only so many cache misses
in flight (as one GPU SM cannot saturate HBM alone).

What is left out: clock boost and thermal throttling, NUMA (a buffer on the other socket's memory),
and the noise of other processes and, in a VM, of other tenants of the same memory; the spread shows it.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass

import torch

from .. import runtime
from .roofline import matmul_flops
from .specs import Accelerator, si

__all__ = [
    "DTYPES",
    "Measurement",
    "as_dtype",
    "measure_matmul_flops",
    "measure_bandwidth",
    "measure_read_bandwidth",
    "measure_kernel",
    "cache_sizes",
    "last_level_cache_bytes",
    "default_nbytes",
    "machine_summary",
    "measure_machine",
    "machine_row",
]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Measurement:
    """Seconds per call of one benchmark, and the work (FLOPs or bytes) that one call does."""

    what: str
    work: float
    unit: str  # "FLOP/s" or "B/s"
    seconds: tuple[float, ...]  # one entry per repeat: seconds per call

    @property
    def best(self) -> float:
        return self.work / min(self.seconds)

    @property
    def median(self) -> float:
        return self.work / statistics.median(self.seconds)

    @property
    def spread(self) -> tuple[float, float]:
        """(slowest, fastest) repeat, as rates: the range the median sits in."""
        return self.work / max(self.seconds), self.work / min(self.seconds)

    def brief(self) -> str:
        """``"14.3 GFLOP/s (13.2-17.1)"``: the median, and the range of the repeats in the median's units."""
        low, high = self.spread
        scale = 1000 ** min(max(int(math.floor(math.log10(self.median) / 3)), 0), 8)
        return f"{si(self.median, self.unit)} ({low / scale:.3g}-{high / scale:.3g})"

    def __str__(self) -> str:
        low, high = self.spread
        return (
            f"{self.what}: median {si(self.median, self.unit)} of {len(self.seconds)} repeats, "
            f"range {si(low, self.unit)} to {si(high, self.unit)}"
        )


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` or ``torch.bfloat16`` -> ``torch.bfloat16``; anything unknown is a ValueError."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    accepted = ", ".join(f"{name!r} ({str(dt)})" for name, dt in DTYPES.items())
    raise ValueError(f"unknown dtype {dtype!r} for the FLOP/s probe; accepted: {accepted}")


def measure_matmul_flops(
    dtype: str | torch.dtype = "fp32",
    n: int | None = None,
    *,
    device=None,
    repeats: int = 5,
    warmup: int = 2,
    min_seconds: float = 0.02,
) -> Measurement:
    """FLOP/s of an (n, n) @ (n, n) matmul in ``dtype`` (fp32, bf16 or fp16) on ``device``.

    The default ``n`` is 1024 on a CPU in fast mode, 2048 on a CPU otherwise, 8192 on a GPU.
    """
    dtype = as_dtype(dtype)
    dev = torch.device(device) if device is not None else runtime.device()
    if n is None:
        n = 8192 if dev.type != "cpu" else 1024 if runtime.FAST else 2048
    _check_positive(n=n, repeats=repeats)
    call, what = _matmul_call(dtype, n, dev)
    seconds = _time_calls(call, dev, repeats, warmup, min_seconds)
    return Measurement(what, float(matmul_flops(n, n, n)), "FLOP/s", seconds)


def _matmul_call(dtype: torch.dtype, n: int, dev: torch.device):
    """A call that runs one (n, n) @ (n, n) matmul into a reused output, and its description."""
    generator = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, generator=generator, device=dev, dtype=torch.float32).to(dtype)  # (n, n)
    b = torch.randn(n, n, generator=generator, device=dev, dtype=torch.float32).to(dtype)  # (n, n)
    c = torch.empty(n, n, device=dev, dtype=dtype)  # (n, n), reused: no allocation is timed

    def call():
        torch.matmul(a, b, out=c)

    return call, f"matmul ({n}x{n})@({n}x{n}) {_short(dtype)} on {dev.type}"


def measure_bandwidth(
    nbytes: int | None = None, *, device=None, repeats: int = 5, warmup: int = 2, min_seconds: float = 0.02
) -> Measurement:
    """Copy bandwidth in bytes/s: an ``nbytes`` fp32 buffer copied into another, counted as 2 * nbytes.

    The default size is the larger of 4x the last-level cache and 64 MiB (fast mode) or 512 MiB,
    on a CPU; 1 GiB on a GPU.
    """
    dev = torch.device(device) if device is not None else runtime.device()
    src = _touched_buffer(nbytes, dev, repeats)  # touched now, so no page fault is timed
    dst = torch.zeros_like(src)

    def call():
        dst.copy_(src)

    seconds = _time_calls(call, dev, repeats, warmup, min_seconds)
    return Measurement(f"copy of {si(src.nbytes, 'B')} on {dev.type}", 2.0 * src.nbytes, "B/s", seconds)


def measure_read_bandwidth(
    nbytes: int | None = None, *, device=None, repeats: int = 5, warmup: int = 2, min_seconds: float = 0.02
) -> Measurement:
    """Read bandwidth in bytes/s: the sum of an ``nbytes`` fp32 buffer, counted as nbytes (the sum is one number).

    The buffer is written before it is read: an allocated but untouched buffer is, on Linux and
    most systems, mapped page by page to one shared page of zeros, so its sum would read the cache.
    Default sizes as in ``measure_bandwidth``.
    """
    dev = torch.device(device) if device is not None else runtime.device()
    src = _touched_buffer(nbytes, dev, repeats)

    def call():
        src.sum()

    seconds = _time_calls(call, dev, repeats, warmup, min_seconds)
    return Measurement(f"read (sum) of {si(src.nbytes, 'B')} on {dev.type}", float(src.nbytes), "B/s", seconds)


def measure_kernel(
    what: str,
    call,
    work: float,
    unit: str = "FLOP/s",
    *,
    device=None,
    repeats: int = 5,
    warmup: int = 2,
    min_seconds: float = 0.02,
) -> Measurement:
    """Time ``call()`` (any kernel) as the probes time theirs; ``work`` is what one call does (FLOPs or bytes)."""
    dev = torch.device(device) if device is not None else runtime.device()
    _check_positive(repeats=repeats)
    if not work > 0:
        raise ValueError(f"work must be the positive FLOPs or bytes of one call, got {work!r}")
    return Measurement(what, float(work), unit, _time_calls(call, dev, repeats, warmup, min_seconds))


def cache_sizes() -> list[tuple[str, int]]:
    """CPU 0's data caches as (level, bytes), e.g. [("L1d", 32768), ("L2", 1048576), ...], as ``runtime.machine()``
    prints them (from Linux's sysfs; empty elsewhere)."""
    return [(level, _parse_size(size)) for level, size in runtime._cpu_caches()]


def last_level_cache_bytes() -> int | None:
    """The size of CPU 0's largest data cache, in bytes; None if unknown."""
    sizes = [size for _, size in cache_sizes()]
    return max(sizes) if sizes else None


def _parse_size(text: str) -> int:
    """``"32768K"`` -> 33554432, as Linux's sysfs writes cache sizes (K, M or G suffix, or plain bytes)."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KMGkmg")) * scale


def default_nbytes(device=None) -> int:
    """The bandwidth probes' buffer: 1 GiB on a GPU; on a CPU 4x its last-level cache, at least 64 MiB
    in fast mode and 512 MiB otherwise, so that the buffer is read from memory, not from a cache."""
    dev = torch.device(device) if device is not None else runtime.device()
    if dev.type != "cpu":
        return 2**30
    return max(4 * (last_level_cache_bytes() or 0), 64 * 2**20 if runtime.FAST else 512 * 2**20)


def _touched_buffer(nbytes: int | None, dev: torch.device, repeats: int) -> torch.Tensor:
    """An fp32 buffer of ``nbytes`` (or the default size), every page written once."""
    if nbytes is None:
        nbytes = default_nbytes(dev)
    _check_positive(nbytes=nbytes, repeats=repeats)
    elements = nbytes // 4
    if elements == 0:
        raise ValueError(f"nbytes={nbytes} is smaller than one fp32 element (4 bytes)")
    return torch.ones(elements, device=dev)  # (elements,)


def _time_calls(call, dev: torch.device, repeats: int, warmup: int, min_seconds: float) -> tuple[float, ...]:
    """Seconds per call, one entry per repeat; each repeat runs enough calls to last min_seconds."""
    calls = _calls_per_repeat(call, dev, warmup, min_seconds)
    return tuple(_seconds_per_call(call, dev, calls) for _ in range(repeats))


def _calls_per_repeat(call, dev: torch.device, warmup: int, min_seconds: float) -> int:
    """Warm up, then, as timeit's autorange, double the batch until one batch of calls lasts min_seconds."""
    for _ in range(warmup):
        call()
    calls = 1
    while _seconds_per_call(call, dev, calls) * calls < min_seconds:
        calls *= 2
    return calls


def _seconds_per_call(call, dev: torch.device, calls: int) -> float:
    """Time one batch of ``calls`` calls (the device synchronised at both ends): seconds per call."""
    with runtime.Timer(dev) as t:
        for _ in range(calls):
            call()
    return t.seconds / calls


def machine_summary(device=None) -> str:
    """One line naming the torch version, the device and, on a CPU, the model and thread count."""
    dev = torch.device(device) if device is not None else runtime.device()
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = runtime.cpu_model()
    return (
        f"torch {torch.__version__} | device {dev.type}: {name} | "
        f"{torch.get_num_threads()} CPU threads for torch, {os.cpu_count()} logical CPUs"
    )


def measure_machine(device=None, *, n: int | None = None, nbytes: int | None = None, repeats: int = 5) -> Accelerator:
    """This machine as a row of the spec table, with measured (not datasheet) numbers.

    The peaks are the medians of ``repeats`` (n, n) matmuls, the bandwidth the median read of
    ``nbytes`` (default sizes as in ``measure_matmul_flops`` and ``measure_read_bandwidth``): what the
    cores torch uses can read, which on a CPU is less than a datasheet's chip-wide memory bandwidth when
    few cores run (each keeps only so many misses in flight). See ``machine_row``.
    """
    dev = torch.device(device) if device is not None else runtime.device()
    bf16 = measure_matmul_flops("bf16", n, device=dev, repeats=repeats)
    fp32 = measure_matmul_flops("fp32", n, device=dev, repeats=repeats)
    return machine_row(bf16, fp32, measure_read_bandwidth(nbytes, device=dev, repeats=repeats), device=dev)


def machine_row(bf16: Measurement, fp32: Measurement, read: Measurement, device=None) -> Accelerator:
    """A spec-table row from measurements already made (e.g. the best of a size sweep): their medians as the
    peaks and the bandwidth; memory is the GPU's memory, or the host's RAM on a CPU; ``source`` lists the
    three measurements with their spread."""
    dev = torch.device(device) if device is not None else runtime.device()
    if dev.type == "cuda":
        memory = torch.cuda.get_device_properties(dev).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    kind = "GPU" if dev.type == "cuda" else dev.type.upper()
    return Accelerator(
        f"this machine ({dev.type})",
        kind,
        bf16.median,
        "bf16",
        fp32.median,
        float(memory),
        read.median,
        source=f"measured by llmedu.hardware.probe: {bf16}; {fp32}; {read}",
    )


def _short(dtype: torch.dtype) -> str:
    return next(name for name, dt in DTYPES.items() if dt is dtype)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
