"""Grader for lesson 08's find-the-bug exercise: one AdamW step, fixed by hand.

check_adamw_fix(fn)    ``llmedu.checks.optim.check_adamw_step`` on ``fn``, with two changes: an answer that
                       enters a library AdamW step (``adamw_update_``, ``AdamW``, ``torch.optim.AdamW``;
                       recognised by the identity of their code, not by the ops they call) fails, and the
                       hint that names the planted mistake (coupled L2 decay) is off, so that the grader does
                       not answer the exercise.
"""

from __future__ import annotations

import contextlib
import io
import sys

import torch

from llmedu.checks import optim as optim_checks
from llmedu.checks.core import CheckResult, Grader
from llmedu.optim.adamw import AdamW, adamw_update_

__all__ = ["check_adamw_fix"]

# -- AdamW: find the bug, without calling a library step ---------------------------------------------
LIBRARY_CODE = {adamw_update_.__code__, AdamW.__init__.__code__, torch.optim.AdamW.__init__.__code__}


def _library_calls(fn, called: list[str]):
    """``fn`` with the name of each library AdamW function it enters (by identity of its code) put in ``called``."""

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in LIBRARY_CODE:
            called.append(frame.f_code.co_qualname)

    def call(*args):
        sys.setprofile(watch)
        try:
            return fn(*args)
        finally:
            sys.setprofile(None)

    return call


def check_adamw_fix(fn) -> CheckResult:
    """``check_adamw_step`` on the fixed step, failing any answer that calls a library AdamW step."""
    g = Grader("check_adamw_fix")
    called: list[str] = []
    coupled = optim_checks.MISTAKES.pop("coupled")  # the planted mistake: no hint that names it
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the inner grader's verdict becomes this one's case
            inner = optim_checks.check_adamw_step(_library_calls(fn, called))
    finally:
        optim_checks.MISTAKES["coupled"] = coupled
    if g.expect(
        "the method",
        not called,
        f"your step calls {', '.join(sorted(set(called)))}, a library AdamW step: fix the given code instead",
    ):
        g.cases = inner.cases - 1  # the inner grader's cases, the last of them recorded by this expect
        g.expect("the values", bool(inner), inner.failure or "")
    return g.result()
