"""Lesson 09's graders that enforce the method (the others are in ``llmedu.checks.train``).

check_fixed_checkpoint(fn)    fn(f, x) -> f(x) checkpointed by the learner's own code, f with dropout: everything
                              ``check_checkpoint_rng`` asks (the gradients of f itself, the caller's random stream
                              left where f leaves it, only x saved), and no call to a library's checkpoint
                              (``torch.utils.checkpoint``, ``llmedu.train.recompute``): the exercise is the replay
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import llmedu.train.recompute as our_recompute
import llmedu.train.selective as our_selective
from llmedu.checks.core import FAILED, CheckResult, Grader
from llmedu.checks.train import check_checkpoint_rng

__all__ = ["check_fixed_checkpoint", "library_checkpoint_called"]

_LIBRARY_CHECKPOINTS = {
    str(Path(torch_checkpoint.__file__)): "torch.utils.checkpoint",
    str(Path(our_recompute.__file__)): "llmedu.train.recompute",
    str(Path(our_selective.__file__)): "llmedu.train.selective",
}


def library_checkpoint_called(fn, *args) -> tuple[object, str | None]:
    """``fn(*args)`` and the first library checkpoint it called (``"torch.utils.checkpoint.checkpoint"``), or None.

    Raises what ``fn`` raises; the profiler watches this thread only, where a CPU forward runs.
    """
    called: list[str] = []

    def watch(frame, event, arg):
        if event == "call" and not called:
            module = _LIBRARY_CHECKPOINTS.get(frame.f_code.co_filename)
            if module is not None:
                called.append(f"{module}.{frame.f_code.co_qualname}")

    sys.setprofile(watch)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
    return out, (called[0] if called else None)


def check_fixed_checkpoint(fn) -> CheckResult:
    """``fn(f, x)``: a checkpoint with dropout replayed, written without a library's checkpoint."""
    g = Grader("check_fixed_checkpoint")
    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 4)).train()
    x = torch.randn(3, 4, requires_grad=True)
    got = g.call(library_checkpoint_called, fn, f, x)
    if got is FAILED:
        return g.result()
    _, library = got
    g.expect(
        "your checkpoint is your own",
        library is None,
        f"your function called {library}: the exercise is to write the replay yourself (start from BuggyCheckpoint)",
    )
    if g.failure is None:
        quiet = io.StringIO()
        with contextlib.redirect_stdout(quiet):  # one verdict is printed: this grader's
            inner = check_checkpoint_rng(fn)
        g.expect(
            "gradients, random stream and saved tensors, as check_checkpoint_rng grades them",
            inner.passed,
            inner.failure or "",
        )
    return g.result()
