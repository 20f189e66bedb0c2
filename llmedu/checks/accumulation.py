"""Lesson 09's graders that enforce the method (the others are in ``llmedu.checks.train``).

check_frozen_input_checkpoint(fn)   fn(f, x) -> f(x) checkpointed by the learner's own code, such that f's
                                    parameters get their gradients also when x does not require grad (the output
                                    of frozen embeddings, as in parameter-efficient fine-tuning), equal to those
                                    of no checkpoint; only x saved; no call to a library's checkpoint
                                    (``torch.utils.checkpoint``, ``llmedu.train.recompute``): the exercise is the fix
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import llmedu.train.recompute as our_recompute
import llmedu.train.selective as our_selective
from llmedu.checks.core import FAILED, CheckResult, Grader
from llmedu.checks.train import _expect_only_x_saved

__all__ = ["check_frozen_input_checkpoint", "library_checkpoint_called"]

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


def check_frozen_input_checkpoint(fn) -> CheckResult:
    """``fn(f, x)``: a checkpoint of f whose parameters get their gradients whether or not x requires grad."""
    g = Grader("check_frozen_input_checkpoint")
    torch.manual_seed(0)
    embed = nn.Embedding(32, 16).requires_grad_(False)  # frozen, as under parameter-efficient fine-tuning
    f = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))  # the checkpointed, trainable segment
    head = nn.Linear(16, 4)  # trainable after it: the loss has a graph, whatever the checkpoint returns
    ids = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(1))  # (B,)
    got = g.call(library_checkpoint_called, fn, f, embed(ids))
    if got is FAILED:
        return g.result()
    g.expect(
        "your checkpoint is your own",
        got[1] is None,
        f"your function called {got[1]}: the exercise is to write the fix yourself (start from Checkpoint)",
    )
    for frozen in (True, False):
        case = "an input that does not require grad (frozen embeddings)" if frozen else "an input that requires grad"

        def run(use_fn: bool):
            for p in (*f.parameters(), *head.parameters()):
                p.grad = None
            x = embed(ids) if frozen else embed(ids).requires_grad_(True)  # (B, d)
            saved = []  # bytes of every tensor autograd saves for backward during the call
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t
            ):
                out = g.call(fn, f, x) if use_fn else f(x)
            if isinstance(out, torch.Tensor) and out.shape == (8, 16):
                g.call(lambda: head(out).pow(2).sum().backward())
            return x, out, [p.grad for p in f.parameters()], saved

        _, ref_out, ref_grads, ref_saved = run(False)
        x, out, grads, saved = run(True)
        if g.failure is not None:
            break
        g.compare(f"{case}: the output f(x)", out, ref_out, atol=1e-6)
        g.expect(
            f"{case}: f's parameters have gradients",
            all(isinstance(t, torch.Tensor) for t in grads),
            "the loss went backward, yet f's parameters got no gradient: nothing links your output to them",
        )
        g.compare(f"{case}: the gradients of f's parameters", grads, ref_grads, atol=1e-6)
        if not frozen:
            reference = torch.autograd.functional.vjp(lambda t: head(f(t)).pow(2).sum(), x.detach())[1]
            g.compare(f"{case}: the gradient of x", x.grad, reference, atol=1e-6)
        _expect_only_x_saved(g, saved, ref_saved, x.detach())
    return g.result()
