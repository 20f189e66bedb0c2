"""Grader for lesson 08's find-the-bug exercise: one AdamW step, fixed by hand.

check_adamw_fix(fn)    ``llmedu.checks.optim.check_adamw_step`` on ``fn``, with two changes: an answer that
                       enters a library Adam step fails (our ``adamw_update_`` and ``AdamW``, recognised by the
                       identity of their code; any function defined under ``torch/optim/``, which covers
                       ``torch.optim.AdamW``, ``torch.optim.Adam(decoupled_weight_decay=True)`` and the
                       functional ``torch.optim.adam.adam``; and torch's fused or foreach Adam kernels), and the
                       hint that names the planted mistake (coupled L2 decay) is off, so that the grader does
                       not answer the exercise.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from llmedu.checks import optim as optim_checks
from llmedu.checks.core import CheckResult, Grader, profiled
from llmedu.optim.adamw import AdamW, adamw_update_

__all__ = ["check_adamw_fix"]

# -- AdamW: find the bug, without calling a library step ---------------------------------------------
LIBRARY_CODE = {adamw_update_.__code__, AdamW.__init__.__code__, torch.optim.AdamW.__init__.__code__}
TORCH_OPTIM = str(Path(torch.optim.__file__).parent)  # every optimizer torch ships, and its functional forms


def _library_calls(fn, called: list[str]):
    """``fn`` with the name of each library Adam function it enters put in ``called``: ours (by identity of its
    code), any Python function under torch/optim/, and any C function whose name says adam (torch._fused_adamw_)."""

    def watch(frame, event, arg):
        code = frame.f_code
        if event == "call" and (code in LIBRARY_CODE or code.co_filename.startswith(TORCH_OPTIM)):
            where = "torch.optim" if code.co_filename.startswith(TORCH_OPTIM) else "llmedu.optim"
            called.append(f"{where} ({code.co_qualname})")
        elif event == "c_call" and "adam" in getattr(arg, "__name__", "").lower():
            called.append(f"torch.{arg.__name__}")

    return profiled(fn, watch)


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
        f"your step calls {called[0] if called else ''}, a library Adam step: fix the given code instead",
    ):
        g.cases = inner.cases - 1  # the inner grader's cases, the last of them recorded by this expect
        g.expect("the values", bool(inner), inner.failure or "")
    return g.result()
