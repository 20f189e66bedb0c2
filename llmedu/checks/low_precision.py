"""Graders for lesson 08's predictions: coupled against decoupled weight decay, and the 8-bit dynamic map's error.

check_decay_ratio(fn)          fn(w, grad, lr, weight_decay, steps) -> how many times more Adam with L2 decay added
                               to the gradient (coupled) shrinks a weight than AdamW does (decoupled), when the
                               weight's loss gradient alternates +grad, -grad (no net push) for ``steps`` steps
check_dynamic_map_error(fn)    fn(decade, signed) -> the largest relative round-trip error |q(x) - x| / x of the
                               dynamic 8-bit map for 0 < x in the decade [10^-(decade+1), 10^-decade] of the
                               block's absmax (Dettmers et al. 2022, Section 2.2)

The references are measured: the decay from three float64 runs of the library's ``adamw_update_`` (with decay
coupled, decoupled, and none), the map's error from ``dynamic_map`` and ``nearest_code`` at every decision
boundary of the map inside the decade and at its two ends (the relative error is largest at one of them). One
decay case runs 10**8 steps: its reference replays the same arithmetic in Python floats (float64, ``_replay``,
tested against ``adamw_update_``) until the bias corrections have died out and a two-step cycle of the
displacements repeats, then counts that cycle out to 10**8 steps (the weight's own drift over them, below
lr * steps against |w|, is left out). Both exercises ask for a prediction: an answer that calls torch, names
numpy (in its code or a helper of the same namespace) or returns a numpy scalar fails with a message that says so;
each answer runs under a budget of executed Python lines that a formula meets and a simulation of Adam's steps (even
one capped at a few dozen) or a rebuild and scan of the map's 256 values cannot, and the decay answer also under a
time limit. For the first case of each, a wrong answer hears only "too high" or "too low".
"""

from __future__ import annotations

import dis
import functools
import math
import sys
import time
import types

import torch

from llmedu.checks.core import CheckResult, Grader
from llmedu.checks.loss_scaling import _TooSlow
from llmedu.checks.precision import _compare_headline, _numpy_recorded, _recorded, _RecordOps
from llmedu.optim.adamw import adamw_update_
from llmedu.optim.quantization_map import dynamic_map, nearest_code

__all__ = ["check_decay_ratio", "check_dynamic_map_error", "TIME_LIMIT_S", "LINE_BUDGET", "DECAY_LINE_BUDGET"]

BETAS, EPS = (0.9, 0.999), 1e-8
TIME_LIMIT_S = 2.0  # per decay answer: a formula takes microseconds, a Python loop over 10**8 steps minutes
DECAY_LINE_BUDGET = 100  # Python lines one decay answer may execute (with the grader's wrappers, a formula: ~20);
# Adam's ratio settles within about 50 steps, and a loop over them runs hundreds of lines
LINE_BUDGET = (
    200  # Python lines one map answer may execute: a formula needs tens, a rebuild and scan of 256 values more
)
REPLAY_STEPS = 60_000  # beta2**60_000 < 1e-26: the bias corrections are gone long before


def _final_weight(w: float, grad: float, lr: float, weight_decay: float, steps: int, coupled: bool) -> float:
    """One weight after ``steps`` Adam steps in float64, its loss gradient +grad, -grad, +grad, ..."""
    p, m, v = (torch.tensor([x], dtype=torch.float64) for x in (w, 0.0, 0.0))
    for t in range(1, steps + 1):
        g = torch.tensor([grad if t % 2 else -grad], dtype=torch.float64)
        if coupled:  # L2 in the loss: the decay enters m and v, and is divided by sqrt(v_hat) like the gradient
            adamw_update_(p, g + weight_decay * p, m, v, t, lr, *BETAS, EPS, 0.0)
        else:
            adamw_update_(p, g, m, v, t, lr, *BETAS, EPS, weight_decay)
    return float(p)


def _replay(w: float, grad: float, lr: float, weight_decay: float, steps: int, coupled: bool) -> list[float]:
    """``adamw_update_``'s arithmetic on one weight in Python floats (float64): the displacement p - w after each
    step (kept apart from w so that steps of lr ~ 1e-12 are not rounded away against |w|)."""
    b1, b2 = BETAS
    d, m, v, out = 0.0, 0.0, 0.0, []
    for t in range(1, steps + 1):
        g = grad if t % 2 else -grad
        if coupled:
            g, wd = g + weight_decay * (w + d), 0.0
        else:
            wd = weight_decay
        d -= lr * wd * (w + d)  # p <- p (1 - lr wd)
        m += (1 - b1) * (g - m)  # torch.lerp with weight < 0.5
        v = v * b2 + (1 - b2) * g * g
        step_size = lr / (1 - b1**t)
        denom = math.sqrt(v) / math.sqrt(1 - b2**t) + EPS
        d -= step_size * (m / denom)
        out.append(d)
    return out


@functools.cache
def converged_decay_ratio(w: float, grad: float, lr: float, weight_decay: float, steps: int) -> float:
    """The ratio for a run too long to replay: replay ``REPLAY_STEPS`` steps (same parity as ``steps``), check that
    the last two-step cycle of each decay's displacement repeats the one before it, and count it out to ``steps``."""
    n = REPLAY_STEPS + (steps - REPLAY_STEPS) % 2
    none, coupled, decoupled = (
        _replay(w, grad, lr, wd, n, c) for wd, c in ((0.0, False), (weight_decay, True), (weight_decay, False))
    )
    totals = []
    for run in (coupled, decoupled):
        gap = [a - b for a, b in zip(none, run)]  # (n,) this decay's displacement against the run without it
        cycle, before = gap[-1] - gap[-3], gap[-3] - gap[-5]
        if not math.isclose(cycle, before, rel_tol=1e-6):
            raise RuntimeError(f"the decay per cycle has not settled after {n} steps: {before!r} then {cycle!r}")
        totals.append(gap[-1] + (steps - n) // 2 * cycle)
    return totals[0] / totals[1]


def measured_decay_ratio(w: float, grad: float, lr: float, weight_decay: float, steps: int) -> float:
    """(w_none - w_coupled) / (w_none - w_decoupled): each decay measured against the run without decay."""
    if steps > REPLAY_STEPS:
        return converged_decay_ratio(w, grad, lr, weight_decay, steps)
    none = _final_weight(w, grad, lr, 0.0, steps, coupled=False)
    coupled = _final_weight(w, grad, lr, weight_decay, steps, coupled=True)
    decoupled = _final_weight(w, grad, lr, weight_decay, steps, coupled=False)
    return (none - coupled) / (none - decoupled)


DECAY_CASES = [  # (w, grad, lr, weight_decay, steps): lr * steps small against |w|, so w barely moves
    (0.5, 1e-3, 1e-4, 0.1, 200),  # the exercise: a weight with small gradients
    (0.5, 2.0, 1e-4, 0.1, 200),  # large gradients: the decay is divided by about |grad|
    (1.0, 0.0, 1e-4, 0.1, 200),  # no loss gradient at all: only the decay is in m and v
    (-0.3, 0.05, 1e-4, 0.01, 300),  # a negative weight, a smaller decay
    (0.2, 0.02, 1e-5, 0.1, 100),  # gradient and decay of the same size
    (0.5, 0.3, 1e-12, 0.1, 10**8),  # a long run: predicted in microseconds, simulated step by step in minutes
]


def check_decay_ratio(fn) -> CheckResult:
    """Grade ``fn(w, grad, lr, weight_decay, steps)`` against float64 runs of coupled and decoupled decay (5%)."""
    g = Grader("check_decay_ratio")
    ops: list[str] = []
    for case in DECAY_CASES:
        expected = measured_decay_ratio(*case)
        wrapped = _numpy_recorded(_recorded_always(fn, ops), ops)
        lines, start = [0], time.perf_counter()
        got = _call_counting_lines(g, wrapped, case, lines, budget=DECAY_LINE_BUDGET, seconds=TIME_LIMIT_S)
        slow = isinstance(got, _TooSlow) or time.perf_counter() - start > TIME_LIMIT_S  # also if it caught the stop
        description = "w={}, grad={}, lr={}, weight_decay={}, steps={:,}".format(*case)
        uses = sorted(set(ops) | _numpy_names(fn)) or (["a numpy scalar"] if _is_numpy(got) else [])
        simulating = "simulating Adam's steps, for all of them or for some, is the grader's measurement"
        if not g.expect(
            f"{description}: the method",
            not uses,
            f"your function uses torch or numpy ({', '.join(uses)}): running the two optimizers is the grader's "
            "measurement; predict the ratio in plain Python (math) from what m_hat and v_hat become",
        ) or not g.expect(
            f"{description}: the method",
            not slow and lines[0] <= DECAY_LINE_BUDGET,
            f"your function ran for more than {TIME_LIMIT_S:g} s: {simulating}; predict the ratio from what m_hat "
            "and v_hat settle to"
            if slow
            else f"your function executed more than {DECAY_LINE_BUDGET} lines of Python: {simulating}; predict the "
            "ratio from what m_hat and v_hat settle to",
        ):
            break
        compare = _compare_headline if case == DECAY_CASES[0] else Grader.compare
        if not compare(g, description, got, expected, rtol=0.05):
            break
    return g.result()


class _OverBudget(Exception):
    """Raised inside an answer once it has executed more Python lines than its budget."""


def _recorded_always(fn, ops: list[str]):
    """``_recorded``, except that the torch ops are appended to ``ops`` even when ``fn`` is stopped mid-way."""

    def call(*args):
        recorder = _RecordOps()
        try:
            with recorder:
                return fn(*args)
        finally:
            ops.extend(recorder.names)

    return call


def _call_counting_lines(g: Grader, fn, args: tuple, lines: list[int], budget: int | None = None, seconds=None):
    """``g.call(fn, *args)``, adding to ``lines[0]`` every Python line executed inside ``fn`` (any frame); stopped
    past ``budget`` lines or ``seconds``, when they are given, and then returning the ``_OverBudget`` or
    ``_TooSlow`` that stopped it. Only ``fn`` is traced: an error it raises leaves it untraced, so ``g.call``'s
    report of that error (a traceback read in Python) neither counts nor is stopped."""
    deadline = None if seconds is None else time.perf_counter() + seconds
    stopped = []  # raise once: the handlers that catch the stop run traced too

    def tracer(frame, event, arg):
        if event == "line":
            lines[0] += 1
        if stopped:
            return tracer
        if budget is not None and lines[0] > budget:
            stopped.append(True)
            raise _OverBudget(f"more than {budget} lines")
        if deadline is not None and time.perf_counter() > deadline:
            stopped.append(True)
            raise _TooSlow(f"ran past {seconds:g} s")
        return tracer

    def traced(*args):
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            result = fn(*args)
            if sys.gettrace() is not tracer:  # the answer switched the count off: its lines went uncounted
                lines[0] = max(lines[0], (budget or 0) + 1)
            return result
        except (_OverBudget, _TooSlow) as stop:
            return stop
        finally:
            sys.settrace(previous)

    return g.call(traced, *args)


def _numpy_names(fn) -> set[str]:
    """The names in ``fn``'s code (and its nested functions', closures' and same-namespace helpers') that resolve to
    numpy: the module, a submodule, or anything defined in it (np.sqrt, np.float64), and numpy imported inside it.
    A ufunc makes no call event that ``_numpy_recorded`` could see, so the names are read from the code."""
    found: set[str] = set()
    seen: set[int] = set()

    def visit(f) -> None:
        if id(f) in seen or not isinstance(f, types.FunctionType):
            return
        seen.add(id(f))
        cells = zip(f.__code__.co_freevars, f.__closure__ or ())
        values = {name: cell.cell_contents for name, cell in cells if _filled(cell)}  # what its closure holds
        codes = [f.__code__]
        while codes:
            code = codes.pop()
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
            imports = {i.argval for i in dis.get_instructions(code) if i.opname == "IMPORT_NAME"}
            found.update(name for name in imports if name.split(".")[0] == "numpy")  # import numpy inside it
            for name in code.co_names + code.co_freevars:
                obj = values[name] if name in values else f.__globals__.get(name)
                if obj is None:
                    continue
                if _is_numpy(obj):
                    found.add(name)
                elif isinstance(obj, types.FunctionType) and obj.__globals__ is f.__globals__:
                    visit(obj)  # a helper the answer defined beside it
        for obj in values.values():
            if isinstance(obj, types.FunctionType):
                visit(obj)

    visit(fn)
    return found


def _is_numpy(obj) -> bool:
    """Is ``obj`` numpy: the module, a submodule, or anything numpy defines (np.sqrt, np.float64, np.float64(2))?"""
    if isinstance(obj, types.ModuleType):
        return obj.__name__.split(".")[0] == "numpy"
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return isinstance(module, str) and module.split(".")[0] == "numpy"


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return False
    return True


def measured_map_error(decade: int, signed: bool) -> float:
    """max |q(x) - x| / x over 0 < x in [10^-(decade+1), 10^-decade], from the library's map and nearest code."""
    code = dynamic_map(signed)  # (256,) float32, sorted
    lo, hi = 10.0 ** -(decade + 1), 10.0**-decade
    boundaries = ((code[1:].double() + code[:-1].double()) / 2).float()  # (255,) where the nearest code changes
    x = torch.cat([boundaries[(boundaries >= lo) & (boundaries <= hi)], torch.tensor([lo, hi])])  # float32
    q = code[nearest_code(x, code).long()]  # the round trip at absmax 1
    return float(((q.double() - x.double()).abs() / x.double()).max())


MAP_CASES = [  # (decade, signed)
    (3, True),  # the exercise: values a thousandth of their block's absmax, in the first moment's map
    (0, True),  # the top decade: the finest steps
    (0, False),  # the second moment's map: one more fraction bit
    (5, False),
    (6, True),  # the last decade: below its first code, only 0
    (1, True),
]


def check_dynamic_map_error(fn) -> CheckResult:
    """Grade ``fn(decade, signed)`` against the map's error at its decision boundaries (rtol 1e-4)."""
    g = Grader("check_dynamic_map_error")
    ops: list[str] = []
    for decade, signed in MAP_CASES:
        expected = measured_map_error(decade, signed)
        lines = [0]
        got = _call_counting_lines(g, _numpy_recorded(_recorded(fn, ops), ops), (decade, signed), lines)
        description = f"decade={decade}, signed={signed}"
        uses = sorted(set(ops) | _numpy_names(fn)) or (["a numpy scalar"] if _is_numpy(got) else [])
        if not g.expect(
            f"{description}: the method",
            not uses and lines[0] <= LINE_BUDGET,
            f"your function uses torch or numpy ({', '.join(uses)}): building the map and scanning it "
            "is the grader's measurement; derive the largest error in plain Python (math) from how the map places "
            "its values"
            if uses
            else f"your function executed {lines[0]:,} lines of Python for one decade (at most {LINE_BUDGET}): that "
            "is a rebuild and scan of the map, the grader's measurement; derive the largest error from the two "
            "places it can occur",
        ):
            break
        compare = _compare_headline if (decade, signed) == MAP_CASES[0] else Grader.compare
        if not compare(g, description, got, expected, rtol=1e-4):
            break
    return g.result()
