"""Measure several benchmarks in rounds, so that the machine's drift hits them all alike.

A shared machine drifts: other processes start and stop, clocks boost and throttle. Measure one size
after another, each with all its repeats, and a slow spell lands on whichever sizes it overlaps: a
sweep then shows a dip or a jump that belongs to the moment, not to the size. In rounds, every
benchmark runs one batch per round (the order reversed every other round, so that a steady drift is
shared evenly), each benchmark's median over the rounds sees the same spells as every other's, and
its range, slowest to fastest round, shows how far one round strays.

Each benchmark is warmed up and its batch sized (as ``timeit``'s autorange does, see ``probe.py``) once,
before the first round; a round then times one batch of that many calls. A ``Benchmark``'s timer can
also be another tool's (``torch.utils.benchmark``), so that two timers of one kernel share the rounds.

Left out: a random order within each round, and any test that the drift is gone: the range shows what
is left of it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from .. import runtime
from . import probe
from .probe import Measurement, _check_positive, _matmul_call, as_dtype
from .roofline import matmul_flops

__all__ = ["Benchmark", "benchmark", "matmul_benchmark", "measure_in_rounds"]


@dataclass(frozen=True)
class Benchmark:
    """What ``timer()`` measures: it times one batch of ``calls`` calls and returns seconds per call."""

    what: str
    timer: Callable[[], float]
    work: float  # FLOPs or bytes of one call
    unit: str = "FLOP/s"
    calls: int = 1


def benchmark(
    what: str, call, work: float, unit: str = "FLOP/s", *, device=None, warmup: int = 2, min_seconds: float = 0.02
) -> Benchmark:
    """Warm ``call`` up and size its batch now (enough calls to last ``min_seconds``); time it later, in rounds."""
    dev = torch.device(device) if device is not None else runtime.device()
    if not work > 0:
        raise ValueError(f"work must be the positive FLOPs or bytes of one call, got {work!r}")
    calls = probe._calls_per_repeat(call, dev, warmup, min_seconds)
    return Benchmark(what, lambda: probe._seconds_per_call(call, dev, calls), float(work), unit, calls)


def matmul_benchmark(
    dtype: str | torch.dtype, n: int, *, device=None, warmup: int = 2, min_seconds: float = 0.02
) -> Benchmark:
    """An (n, n) @ (n, n) matmul in ``dtype``, ready to be timed in rounds (as ``measure_matmul_flops`` times it)."""
    dtype = as_dtype(dtype)
    dev = torch.device(device) if device is not None else runtime.device()
    _check_positive(n=n)
    call, what = _matmul_call(dtype, n, dev)
    return benchmark(what, call, matmul_flops(n, n, n), device=dev, warmup=warmup, min_seconds=min_seconds)


def measure_in_rounds(benchmarks: dict[Hashable, Benchmark], rounds: int = 5) -> dict[Hashable, Measurement]:
    """Time every benchmark once per round, ``rounds`` times: one Measurement per benchmark, one entry per round."""
    _check_positive(rounds=rounds)
    if not benchmarks:
        raise ValueError("benchmarks is empty: give at least one {key: Benchmark}")
    order = list(benchmarks)
    seconds = {key: [] for key in order}
    for r in range(rounds):
        for key in order if r % 2 == 0 else reversed(order):  # reversed every other round: drift shared evenly
            seconds[key].append(benchmarks[key].timer())
    return {key: Measurement(b.what, b.work, b.unit, tuple(seconds[key])) for key, b in benchmarks.items()}
