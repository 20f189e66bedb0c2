"""Lesson 07's loss-scaling grader: how many steps a dynamic loss scaler skips, predicted, not replayed.

check_skipped_steps(fn)   fn(init_scale, growth_interval, overflow_scale, n_steps) -> how many of n_steps a
                          dynamic loss scaler (``torch.amp.GradScaler``'s rules) skips when every scale
                          >= overflow_scale overflows and none below it does

The reference is measured: ``torch.amp.GradScaler`` replayed step by step until its state (scale, clean
streak) repeats, then the measured cycle is counted out to ``n_steps`` (a run of 10**12 steps is one cycle
found and multiplied, never a formula for the count). The answer must predict: it runs with GradScaler and
LossScaler switched off, and under a time limit that a replay of 10**12 steps cannot meet.
"""

from __future__ import annotations

import functools
import math
import sys
import time

import torch

from llmedu.checks.core import CheckResult, Grader
from llmedu.checks.precision import _compare_headline, _refusing
from llmedu.train.precision import LossScaler

__all__ = ["check_skipped_steps", "TIME_LIMIT_S"]

TIME_LIMIT_S = 2.0  # a closed form answers in microseconds; a replay of 10**12 steps would take days


class _TooSlow(Exception):
    """Raised inside the answer when it runs past its time limit."""


def _call_with_deadline(g: Grader, fn, args: tuple, seconds: float):
    """``g.call(fn, *args)``, stopped with ``_TooSlow`` once ``seconds`` have passed (checked at every line)."""
    deadline = time.perf_counter() + seconds

    def tracer(frame, event, arg):
        if time.perf_counter() > deadline:
            raise _TooSlow(f"ran past {seconds:g} s")
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return g.call(fn, *args)
    finally:
        sys.settrace(previous)


@functools.cache  # deterministic: each setting is replayed once per session
def _measured_skipped_steps(init_scale: float, growth_interval: int, overflow_scale: float, n_steps: int) -> int:
    """Replay ``torch.amp.GradScaler`` (inf gradient exactly when scale >= overflow_scale) until its state repeats."""
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    seen: dict[tuple[float, int], int] = {}  # (scale, clean streak) before a step -> that step's index
    skipped_before = [0]  # skipped_before[i]: steps skipped among the first i
    for i in range(n_steps):
        scaler.scale(torch.zeros(()))  # what a training step does first (it creates GradScaler's scale tensor)
        state = scaler.get_scale(), int(scaler.state_dict()["_growth_tracker"])
        if state in seen:  # from here the run repeats steps seen[state] .. i-1 over and over
            start, period = seen[state], i - seen[state]
            per_cycle = skipped_before[i] - skipped_before[start]
            cycles, rest = divmod(n_steps - i, period)
            return skipped_before[i] + cycles * per_cycle + skipped_before[start + rest] - skipped_before[start]
        seen[state] = i
        scale = state[0]
        p.grad = torch.full((1,), math.inf if scale >= overflow_scale else scale)  # the scaled gradient
        before = p.detach().clone()
        scaler.step(opt)
        scaler.update()
        skipped_before.append(skipped_before[-1] + int(scale >= overflow_scale and torch.equal(before, p.detach())))
    return skipped_before[-1]


def _power_of_two(x: float) -> str:
    return f"2^{math.log2(x):g}" if math.log2(x).is_integer() else f"{x:g}"


def check_skipped_steps(fn) -> CheckResult:
    """Grade ``fn(init_scale, growth_interval, overflow_scale, n_steps)`` against a replayed ``GradScaler``."""
    g = Grader("check_skipped_steps")
    reason = "predict the count; running GradScaler or LossScaler is the measurement the grader makes"
    cases = [
        (2.0**24, 10, 2.0**20, 600),  # the board of the lesson, with a fixed overflow line
        (2.0**4, 5, 2.0**20, 200),  # a low first guess: 80 clean steps of growth before the first overflow
        (2.0**20, 10, 2.0**20, 100),  # the guess is the line itself: one skip, then the probing
        (2.0**16, 2000, 2.0**20, 5000),  # GradScaler's default interval: it never reaches the line
        (2.0**16, 3, 2.0**13, 50),  # a short interval: a skip in every 4 steps once settled
        (1024.0, 7, 2.0**12, 23),  # the run ends in the middle of a clean streak
        (2.0**16, 2000, 5e4, 10**12),  # a line between powers of two, and far too many steps to replay
    ]
    for args in cases:
        expected = _measured_skipped_steps(*args)
        with _refusing(reason, (torch.amp.GradScaler, "__init__"), (LossScaler, "__init__")):
            got = _call_with_deadline(g, fn, args, TIME_LIMIT_S)
        init, interval, line, n = args
        description = f"init_scale={_power_of_two(init)}, growth_interval={interval}, "
        description += f"overflow_scale={_power_of_two(line)}, n_steps={n:,}"
        if g.failure is not None and "_TooSlow" in g.failure:
            g.failure = (
                f"{description}: your function ran for more than {TIME_LIMIT_S:g} s. Replaying the steps one by "
                f"one cannot finish {n:,} of them; count the cycles of skips and clean steps with arithmetic"
            )
        if not (_compare_headline if args == cases[0] else Grader.compare)(g, description, got, expected):
            break
    return g.result()
