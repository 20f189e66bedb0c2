"""The grading pattern behind every ``check_*`` function.

A grader calls a learner's function on a few cases, compares each answer with ours, and stops at
the first mismatch with a message that says what went wrong and where:

    def check_softmax(softmax):
        g = Grader("check_softmax")
        for x in cases:
            g.compare(f"x of shape {tuple(x.shape)}", g.call(softmax, x), reference(x), atol=1e-6)
        return g.result()

``Grader.call`` catches the learner's exceptions and reports them as the failure; ``compare``
understands tensors, NumPy arrays, numbers, strings and nested lists/tuples/dicts of those.
The returned ``CheckResult`` is truthy when every case passed, so tests can assert on it too.
"""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Grader", "CheckResult"]


class _Failed:
    """What ``Grader.call`` returns once a case has failed: later comparisons are skipped."""

    def __repr__(self) -> str:
        return "<failed call>"


FAILED = _Failed()


@dataclass
class CheckResult:
    name: str
    passed: bool
    cases: int
    failure: str | None = None

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if self.passed:
            agree = "the one case agrees" if self.cases == 1 else f"all {self.cases} cases agree"
            return f"PASS {self.name}: {agree} with the reference."
        return f"FAIL {self.name}: case {self.cases} of the check: {self.failure}"

    __repr__ = __str__


class Grader:
    """Collects the cases of one check; the first failing case ends the grading."""

    def __init__(self, name: str, verbose: bool = True):
        self.name = name
        self.verbose = verbose
        self.cases = 0
        self.failure: str | None = None

    # -- running the learner's code -----------------------------------------------------------
    def call(self, fn: Callable, *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)``, or ``FAILED`` (with the error recorded) if it raises."""
        if self.failure is not None:
            return FAILED
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # the learner's bug is the message, not a crash of the grader
            self.cases += 1
            frames = traceback.extract_tb(err.__traceback__)
            # the function and line, not the file: a notebook cell's file is a temporary path
            where = f" (in {frames[-1].name}, line {frames[-1].lineno})" if frames else ""
            self.failure = f"your function raised {type(err).__name__}: {err}{where}"
            return FAILED

    # -- comparing answers --------------------------------------------------------------------
    def compare(self, description: str, got: Any, expected: Any, *, rtol: float = 0.0, atol: float = 0.0) -> bool:
        """Record one case: does ``got`` equal ``expected`` within ``atol + rtol * |expected|``?"""
        if self.failure is not None:
            return False
        self.cases += 1
        problem = _difference(got, expected, rtol, atol)
        if problem is not None:
            self.failure = f"{description}: {problem}"
            return False
        return True

    def expect(self, description: str, condition: bool, detail: str = "") -> bool:
        """Record one case that is a yes/no property (``detail`` explains a no)."""
        if self.failure is not None:
            return False
        self.cases += 1
        if not condition:
            self.failure = f"{description}: {detail}" if detail else description
            return False
        return True

    def result(self) -> CheckResult:
        res = CheckResult(self.name, self.failure is None and self.cases > 0, self.cases, self.failure)
        if self.cases == 0:
            res.failure = "the check ran no case (this is a bug in the grader)"
        if self.verbose:
            print(res)
        return res


def _as_array(x: Any) -> np.ndarray | None:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64 if x.is_floating_point() else x.dtype).numpy()
    if isinstance(x, np.ndarray):
        return x
    return None


def _difference(got: Any, expected: Any, rtol: float, atol: float, path: str = "") -> str | None:
    """None if equal within tolerance, else a sentence saying where and how they differ."""
    at = f" at {path}" if path else ""
    if got is FAILED:
        return "no answer"
    exp_arr = _as_array(expected)
    if exp_arr is not None:
        got_arr = _as_array(got)
        if got_arr is None:
            return f"expected a tensor/array{at}, got {type(got).__name__}"
        if got_arr.shape != exp_arr.shape:
            return f"shape{at} is {tuple(got_arr.shape)}, expected {tuple(exp_arr.shape)}"
        if exp_arr.dtype.kind in "fc" or got_arr.dtype.kind in "fc":
            g, e = got_arr.astype(np.float64), exp_arr.astype(np.float64)
            if np.isnan(g).any() and not np.isnan(e).any():
                first = tuple(int(i) for i in np.argwhere(np.isnan(g))[0])
                return f"NaN{at} at index {first}"
            bad = ~np.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
        else:
            g, e = got_arr, exp_arr
            bad = g != e
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            worst = float(np.max(np.abs(g.astype(np.float64) - e.astype(np.float64))))
            return (
                f"values differ{at}: first at index {idx}, got {g[idx].item()!r}, expected {e[idx].item()!r}; "
                f"max |difference| = {worst:.3g} (tolerance atol={atol:g}, rtol={rtol:g})"
            )
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"expected a dict{at}, got {type(got).__name__}"
        if set(got) != set(expected):
            return f"keys{at} are {sorted(map(str, got))}, expected {sorted(map(str, expected))}"
        for key in expected:
            problem = _difference(got[key], expected[key], rtol, atol, f"{path}[{key!r}]")
            if problem:
                return problem
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return f"expected a {type(expected).__name__}{at}, got {type(got).__name__}"
        if len(got) != len(expected):
            return f"length{at} is {len(got)}, expected {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            problem = _difference(g, e, rtol, atol, f"{path}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(expected, float) or (isinstance(expected, int) and isinstance(got, float)):
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not isinstance(got, (int, float)):
            return f"expected a number{at}, got {type(got).__name__}"
        if math.isclose(got, expected, rel_tol=rtol, abs_tol=atol) or (math.isnan(got) and math.isnan(expected)):
            return None
        return f"got {got!r}{at}, expected {expected!r} (tolerance atol={atol:g}, rtol={rtol:g})"
    if got != expected:
        return f"got {got!r}{at}, expected {expected!r}"
    return None


def call_watching(g: Grader, fn, args: tuple, folder: Path | tuple[Path, ...], exempt: Callable = lambda code: False):
    """``g.call(fn, *args)``, and the first function defined under ``folder`` (a path, or several) that it called
    (``"file.qualname"``), or None. A grader that asks for a rule worked out by hand uses it to fail an answer
    that asks the library instead; ``exempt(code)`` names calls that do not count."""
    called = []
    root = tuple(str(f) for f in folder) if isinstance(folder, tuple) else str(folder)

    def watch(frame, event, arg):
        code = frame.f_code
        if event == "call" and not called and code.co_filename.startswith(root) and not exempt(code):
            called.append(f"{Path(code.co_filename).stem}.{code.co_qualname}")

    sys.setprofile(watch)
    try:
        got = g.call(fn, *args)
    finally:
        sys.setprofile(None)
    return got, (called[0] if called else None)


def profiled(fn, watch: Callable):
    """``fn`` run with ``watch`` as this thread's profile function (``sys.setprofile``), switched off after:
    how a grader sees the calls an answer makes, C functions included."""

    def call(*args):
        sys.setprofile(watch)
        try:
            return fn(*args)
        finally:
            sys.setprofile(None)

    return call
