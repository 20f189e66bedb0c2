"""Measure this machine: matmul FLOP/s per dtype, and memory bandwidth.

Two micro-benchmarks give the two numbers a roofline needs (see ``roofline.py``):

* compute: an (n, n) @ (n, n) matmul, which does 2n^3 FLOPs on 3n^2 elements, so for large n it
  is limited by arithmetic, not by memory;
* bandwidth: a copy of a buffer several times larger than the last-level cache, counted as
  ``2 * nbytes`` (every byte read once and written once, as the roofline counts bytes).

Timing follows ``timeit``'s rules: a warm-up (first calls pay for allocation, page faults and
kernel selection), then enough calls per repeat that one repeat lasts at least ``min_seconds``
(so that the clock and, on a GPU, the synchronisation are negligible), then several repeats,
reported as the best (the machine's capability) and the median (what a loop typically sees).
``llmedu.runtime.Timer`` synchronises the device, so kernels are counted where they run.

What is left out: the CPU's write-allocate traffic (a copy on a CPU really moves ~3x nbytes
unless the library uses streaming stores), clock boost and thermal throttling, and the noise of
other processes, which the best-of-repeats only partly removes. On a busy CPU that noise can be
large: a parallel kernel waits for its slowest thread, so a thread descheduled by the OS stalls
every call, and small kernels, which last less than a scheduler time slice, suffer most.
"""

from __future__ import annotations

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
    "machine_summary",
    "measure_machine",
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

    def __str__(self) -> str:
        return f"{self.what}: best {si(self.best, self.unit)}, median {si(self.median, self.unit)}"


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
    generator = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, generator=generator, device=dev, dtype=torch.float32).to(dtype)  # (n, n)
    b = torch.randn(n, n, generator=generator, device=dev, dtype=torch.float32).to(dtype)  # (n, n)
    c = torch.empty(n, n, device=dev, dtype=dtype)  # (n, n), reused: no allocation is timed

    def call():
        torch.matmul(a, b, out=c)

    seconds = _time_calls(call, dev, repeats, warmup, min_seconds)
    what = f"matmul ({n}x{n})@({n}x{n}) {_short(dtype)} on {dev.type}"
    return Measurement(what, float(matmul_flops(n, n, n)), "FLOP/s", seconds)


def measure_bandwidth(
    nbytes: int | None = None, *, device=None, repeats: int = 5, warmup: int = 2, min_seconds: float = 0.02
) -> Measurement:
    """Memory bandwidth in bytes/s, from copying an ``nbytes`` fp32 buffer into another.

    The default size is 64 MiB on a CPU in fast mode (source and destination together, 128 MiB,
    outgrow the last-level cache of most CPUs), 512 MiB on a CPU otherwise, 1 GiB on a GPU.
    """
    dev = torch.device(device) if device is not None else runtime.device()
    if nbytes is None:
        nbytes = 2**30 if dev.type != "cpu" else 64 * 2**20 if runtime.FAST else 512 * 2**20
    _check_positive(nbytes=nbytes, repeats=repeats)
    elements = nbytes // 4
    if elements == 0:
        raise ValueError(f"nbytes={nbytes} is smaller than one fp32 element (4 bytes)")
    src = torch.ones(elements, device=dev)  # touched now, so no page fault is timed
    dst = torch.zeros(elements, device=dev)

    def call():
        dst.copy_(src)

    seconds = _time_calls(call, dev, repeats, warmup, min_seconds)
    return Measurement(f"copy of {si(elements * 4, 'B')} on {dev.type}", 2.0 * elements * 4, "B/s", seconds)


def _time_calls(call, dev: torch.device, repeats: int, warmup: int, min_seconds: float) -> tuple[float, ...]:
    """Seconds per call, one entry per repeat; each repeat runs enough calls to last min_seconds."""
    for _ in range(warmup):
        call()
    calls = 1
    while True:  # as timeit's autorange: double the batch until one batch lasts min_seconds
        with runtime.Timer(dev) as batch:
            for _ in range(calls):
                call()
        if batch.seconds >= min_seconds:
            break
        calls *= 2
    per_call = []
    for _ in range(repeats):
        with runtime.Timer(dev) as t:
            for _ in range(calls):
                call()
        per_call.append(t.seconds / calls)
    return tuple(per_call)


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

    The peaks are the best of ``repeats`` (n, n) matmuls, the bandwidth the best copy of ``nbytes``
    (default sizes as in ``measure_matmul_flops`` and ``measure_bandwidth``); memory is the GPU's
    memory, or the host's RAM on a CPU.
    """
    dev = torch.device(device) if device is not None else runtime.device()
    bf16 = measure_matmul_flops("bf16", n, device=dev, repeats=repeats).best
    fp32 = measure_matmul_flops("fp32", n, device=dev, repeats=repeats).best
    bandwidth = measure_bandwidth(nbytes, device=dev, repeats=repeats).best
    if dev.type == "cuda":
        memory = torch.cuda.get_device_properties(dev).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    kind = "GPU" if dev.type == "cuda" else dev.type.upper()
    return Accelerator(
        f"this machine ({dev.type})",
        kind,
        bf16,
        "bf16",
        fp32,
        float(memory),
        bandwidth,
        source=f"measured by llmedu.hardware.probe: {machine_summary(dev)}",
    )


def _short(dtype: torch.dtype) -> str:
    return next(name for name, dt in DTYPES.items() if dt is dtype)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
