"""Graders for lesson 13 (pipeline parallelism): a bubble predicted by hand, and a number of micro-batches chosen.

``check_slow_stage_bubble`` wants the idle share of a GPipe step with one slow stage worked out with pen and
paper: it fails a function that asks the library's schedules or simulator (``llmedu.parallel``) for it.
``check_micro_batches`` wants the m that gives the shortest 1F1B step within a memory budget, when each
micro-batch also pays a fixed cost; its cases are built so that ignoring the memory, the fixed cost, or
the bubble each picks a wrong m somewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..parallel.pipeline_schedules import bubble_fraction, schedule, simulate
from .core import CheckResult, Grader, call_watching

__all__ = ["check_slow_stage_bubble", "check_micro_batches", "slow_stage_bubble", "best_micro_batches"]

_LIBRARY = Path(__file__).resolve().parents[1] / "parallel"


def slow_stage_bubble(n_stages: int, n_micro: int, slow_stage: int, slowdown: float) -> float:
    """The reference, by simulation: GPipe, t_b = 2 t_f, stage ``slow_stage`` ``slowdown`` times slower."""
    times = [{"F": slowdown, "B": 2 * slowdown} if r == slow_stage else {} for r in range(n_stages)]
    return bubble_fraction(simulate([schedule("gpipe", n_micro, n_stages, r) for r in range(n_stages)], times))


def check_slow_stage_bubble(fn: Callable[[int, int, int, float], float]) -> CheckResult:
    """``fn(n_stages, n_micro, slow_stage, slowdown)`` -> the idle share of a GPipe step (idle time over
    p x step time) when one stage's forward and backward take ``slowdown`` times as long as the others'.
    Worked out by hand: a function that calls ``llmedu.parallel`` (``simulate``, ``schedule``) fails."""
    g = Grader("check_slow_stage_bubble")
    for p, m, k, s in [
        (4, 8, 1, 2.0),
        (2, 3, 0, 3.0),
        (8, 16, 5, 1.25),
        (4, 2, 3, 2.0),
        (6, 24, 2, 1.5),
        (3, 5, 1, 1.0),
    ]:
        case = f"p={p}, m={m}, stage {k} x{s}"
        got, called = call_watching(g, fn, (p, m, k, s), _LIBRARY)
        if not g.expect(f"{case}: worked out, not simulated", called is None, f"your function called {called}"):
            break
        g.compare(case, got, slow_stage_bubble(p, m, k, s), atol=1e-9)
    return g.result()


def best_micro_batches(batch: int, n_stages: int, fixed: float, per_sample: float, memory: int) -> int:
    """The reference: the divisor m of ``batch`` with the shortest 1F1B step (m + p - 1) x 3 (fixed +
    per_sample x batch/m), among those whose stage 0 holds at most ``memory`` samples (min(m, p) x batch/m)."""
    fits = [m for m in range(1, batch + 1) if batch % m == 0 and min(m, n_stages) * batch // m <= memory]
    if not fits:
        return 0
    return min(fits, key=lambda m: ((m + n_stages - 1) * 3 * (fixed + per_sample * batch / m), m))


_CASES = [  # (batch, n_stages, fixed, per_sample, memory): the bubble, the fixed cost and the memory each decide one
    (64, 4, 0.0, 1.0, 64),  # no fixed cost: the most micro-batches
    (64, 4, 2.0, 1.0, 64),  # a fixed cost per micro-batch: fewer, larger ones
    (64, 4, 2.0, 1.0, 20),  # the memory rules out the step's best m
    (96, 8, 0.5, 0.25, 96),
    (48, 2, 1.0, 1.0, 12),
    (128, 4, 8.0, 1.0, 1000),
    (60, 3, 0.3, 1.0, 25),
]


def check_micro_batches(fn: Callable[[int, int, float, float, int], int]) -> CheckResult:
    """``fn(batch, n_stages, fixed, per_sample, memory)`` -> the number of micro-batches m (a divisor of
    ``batch``) that gives the shortest 1F1B step, when a micro-batch of b samples takes fixed + per_sample x b
    seconds forward and twice that backward, and stage 0 may hold the activations of at most ``memory``
    samples; 0 if no m fits."""
    g = Grader("check_micro_batches")
    for batch, p, fixed, per_sample, memory in _CASES:
        case = f"batch={batch}, p={p}, fixed={fixed}, per_sample={per_sample}, memory={memory} samples"
        g.compare(
            case,
            g.call(fn, batch, p, fixed, per_sample, memory),
            best_micro_batches(batch, p, fixed, per_sample, memory),
        )
    return g.result()
