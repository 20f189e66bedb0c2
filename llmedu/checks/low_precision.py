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
each answer runs under a budget of executed Python lines and bytecode instructions (ten a line: steps unrolled onto
one line count) that a formula meets and a simulation of Adam's steps (even one capped at a few dozen) or a rebuild
and scan of the map's 256 values cannot, the decay answer also under a time limit. An answer that hides from that
count fails too: a name of ``HIDING`` in its code (settrace, _getframe, exec...), sys.settrace called by any name, or
a frame's events switched off. For the first case of each, a wrong answer hears only "too high" or "too low".
"""

from __future__ import annotations

import builtins
import dis
import functools
import inspect
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
__all__ += ["INSTRUCTIONS_PER_LINE"]

BETAS, EPS = (0.9, 0.999), 1e-8
TIME_LIMIT_S = 2.0  # per decay answer: a formula takes microseconds, a Python loop over 10**8 steps minutes
DECAY_LINE_BUDGET = 100  # Python lines one decay answer may execute (with the grader's wrappers, a formula: ~20);
# Adam's ratio settles within about 50 steps, and a loop over them runs hundreds of lines
LINE_BUDGET = 200  # Python lines one map answer may execute: a formula needs tens, a rebuild and scan of 256 more
INSTRUCTIONS_PER_LINE = 10  # the instruction budget, per line of the line budget (the formula with wrappers: ~110)
REPLAY_STEPS = 60_000  # beta2**60_000 < 1e-26: the bias corrections are gone long before
HIDING = {"settrace", "gettrace", "setprofile", "_getframe", "currentframe", "f_trace", "f_trace_lines"}
HIDING |= {"f_trace_opcodes", "exec", "eval", "compile"}  # names an answer needs only to hide steps from the count
_HIDING_OBJECTS = [getattr(m, name) for m in (sys, inspect, builtins) for name in HIDING if hasattr(m, name)]
HIDDEN = (
    "your function reaches for the grader's count of the Python it runs ({}): steps hidden from it (tracing switched "
    "off, a frame's line events off, code run from a string) are still the grader's measurement; predict the formula"
)


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
        count, start = _Count(), time.perf_counter()
        got = _call_counting(g, wrapped, case, count, budget=DECAY_LINE_BUDGET, seconds=TIME_LIMIT_S)
        slow = isinstance(got, _TooSlow) or time.perf_counter() - start > TIME_LIMIT_S  # also if it caught the stop
        description = "w={}, grad={}, lr={}, weight_decay={}, steps={:,}".format(*case)
        numpy, hiding = _code_names(fn)
        uses = sorted(set(ops) | numpy) or (["a numpy scalar"] if _is_numpy(got) else [])
        hidden, method = ", ".join(sorted(hiding | count.off)), f"{description}: the method"
        simulating = "simulating Adam's steps, for all of them or for some, is the grader's measurement"
        if not g.expect(
            method,
            not uses,
            f"your function uses torch or numpy ({', '.join(uses)}): running the two optimizers is the grader's "
            "measurement; predict the ratio in plain Python (math) from what m_hat and v_hat become",
        ) or not g.expect(method, not hidden, HIDDEN.format(hidden)):
            break
        if not g.expect(
            method,
            not slow and not count.over(DECAY_LINE_BUDGET),
            f"your function ran for more than {TIME_LIMIT_S:g} s: {simulating}; predict the ratio from what m_hat "
            "and v_hat settle to"
            if slow
            else f"your function executed more than {DECAY_LINE_BUDGET} lines of Python (or "
            f"{INSTRUCTIONS_PER_LINE * DECAY_LINE_BUDGET:,} instructions): {simulating}; predict the ratio from "
            "what m_hat and v_hat settle to",
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


class _Count:
    """What one answer ran, in any frame it entered: Python lines, bytecode instructions, and how it hid from both."""

    def __init__(self):
        self.lines, self.instructions, self.off = 0, 0, set()

    def over(self, budget: int) -> bool:
        return self.lines > budget or self.instructions > INSTRUCTIONS_PER_LINE * budget


def _call_counting(g: Grader, fn, args: tuple, count: _Count, budget: int | None = None, seconds=None):
    """``g.call(fn, *args)``, counting every line and instruction run inside ``fn`` (any frame) into ``count``, and
    stopped past ``budget`` or ``seconds`` if given (returning the ``_OverBudget`` or ``_TooSlow``). While ``fn`` runs,
    ``sys.settrace`` only records the attempt; a frame whose events went off is recorded too. Only ``fn`` is traced:
    ``g.call``'s report of an error it raises neither counts nor is stopped."""
    deadline = None if seconds is None else time.perf_counter() + seconds
    stopped, frames = [], []  # raise once: the handlers that catch the stop run traced too

    def tracer(frame, event, arg):
        if event == "call":
            frame.f_trace_opcodes = True
            frames.append(frame)
        elif not (frame.f_trace_lines and frame.f_trace_opcodes):
            count.off.add("f_trace_lines" if not frame.f_trace_lines else "f_trace_opcodes")
        count.lines += event == "line"
        count.instructions += event == "opcode"
        if stopped:
            return tracer
        if budget is not None and count.over(budget):
            stopped.append(True)
            raise _OverBudget(f"more than {budget} lines")
        if deadline is not None and time.perf_counter() > deadline:
            stopped.append(True)
            raise _TooSlow(f"ran past {seconds:g} s")
        return tracer

    def traced(*args):
        previous, settrace = sys.gettrace(), sys.settrace
        sys.settrace = lambda function: count.off.add("sys.settrace")  # the count stays on
        settrace(tracer)
        try:
            return fn(*args)
        except (_OverBudget, _TooSlow) as stop:
            return stop
        finally:
            now, sys.settrace = sys.gettrace(), settrace
            settrace(previous)
            if not stopped and (now is not tracer or any(f.f_trace is not tracer for f in frames)):  # a stop unsets it
                count.off.add("sys.settrace" if now is not tracer else "f_trace")

    return g.call(traced, *args)


def _code_names(fn) -> tuple[set[str], set[str]]:
    """The names in ``fn``'s code (and its nested functions', closures', defaults' and same-namespace helpers') that
    are numpy (np, np.sqrt, np.float64, import numpy: a ufunc makes no call event that ``_numpy_recorded`` sees), and
    those of ``HIDING`` (as a name, an attribute, a string, or the function itself)."""
    found: set[str] = set()
    hiding: set[str] = set()
    seen: set[int] = set()

    def resolve(name: str, obj, helper: bool) -> None:
        if _is_numpy(obj):
            found.add(name)
        elif any(obj is h for h in _HIDING_OBJECTS):
            hiding.add(obj.__name__)
        elif helper:
            visit(obj)

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
            hiding.update(n for n in code.co_names + code.co_consts if isinstance(n, str) and n in HIDING)
            for name in code.co_names + code.co_freevars:
                obj = values[name] if name in values else f.__globals__.get(name)
                if obj is not None:  # a helper the answer defined beside it is read too
                    resolve(name, obj, isinstance(obj, types.FunctionType) and obj.__globals__ is f.__globals__)
        for obj in list(f.__defaults__ or ()) + list((f.__kwdefaults__ or {}).values()):  # what its defaults hold
            resolve(getattr(obj, "__name__", type(obj).__name__), obj, True)
        for obj in values.values():  # the functions its closure holds (the names were read above)
            visit(obj)

    visit(fn)
    return found, hiding


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
        count = _Count()
        got = _call_counting(g, _numpy_recorded(_recorded(fn, ops), ops), (decade, signed), count)
        description = f"decade={decade}, signed={signed}"
        numpy, hiding = _code_names(fn)
        uses = sorted(set(ops) | numpy) or (["a numpy scalar"] if _is_numpy(got) else [])
        hidden = ", ".join(sorted(hiding | count.off))
        if not g.expect(f"{description}: the method", not hidden, HIDDEN.format(hidden)) or not g.expect(
            f"{description}: the method",
            not uses and not count.over(LINE_BUDGET),
            f"your function uses torch or numpy ({', '.join(uses)}): building the map and scanning it "
            "is the grader's measurement; derive the largest error in plain Python (math) from how the map places "
            "its values"
            if uses
            else f"your function executed {count.lines:,} lines of Python ({count.instructions:,} instructions) for "
            f"one decade (at most {LINE_BUDGET} and {INSTRUCTIONS_PER_LINE * LINE_BUDGET:,}): that "
            "is a rebuild and scan of the map, the grader's measurement; derive the largest error from the two "
            "places it can occur",
        ):
            break
        compare = _compare_headline if (decade, signed) == MAP_CASES[0] else Grader.compare
        if not compare(g, description, got, expected, rtol=1e-4):
            break
    return g.result()
