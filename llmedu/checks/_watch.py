"""What a grader sees of the torch calls an answer makes, for graders that enforce a method (lesson 23's).

Calls             a ``TorchFunctionMode`` that records the name of every torch function and tensor method called
                  inside its ``with`` block, the first argument of every cosine similarity, every power's exponent,
                  the largest tensor made and whether any complex tensor went in or came out
math_recorded     wraps a function so that its calls of ``math``'s and ``cmath``'s exponentials and logarithms (on
                  Python floats, which the mode does not see) are recorded
no_threads        a ``with`` block in which starting a thread raises: a torch function mode is thread-local, so the
                  work of another thread is work the grader cannot see
EXP_OR_LOG        an exponential or logarithm by any of torch's names
LEAVING_TORCH     the ways a number leaves torch for numpy, math or Python

It leaves out what Python can always do: a determined answer can reach numbers through ctypes or a subprocess.
The graders aim at the routes a learner might take, not at every way round them.
"""

from __future__ import annotations

import _thread
import contextlib
import re
import threading

import torch
from torch.overrides import TorchFunctionMode

from llmedu.checks.core import profiled

# an exp or log by any name (exp2, logcumsumexp, xlogy, softplus, tanh, ELUs, scalar ** tensor; not expand, logical)
EXP_OR_LOG = re.compile(
    r"exp(?!and)|log(?!ical)|soft|sigm|tanh|sinh|cosh|gamma|erf|entr|kl_div|entropy|nll|polar|"
    r"bessel|^i[01]|^(s|c|ge|si)?elu$|mish|rpow"
)
# the ways a number leaves torch (to numpy, math or Python) where the grader cannot see what is done with it;
# __float__ and item are allowed once, for the answer
LEAVING_TORCH = set(
    "__array__ numpy tolist __int__ __index__ __complex__ __repr__ __str__ __format__ data_ptr storage "
    "untyped_storage __reduce_ex__ __dlpack__".split()
)
MATH_LIKE = ("exp", "expm1", "log", "log1p", "log2", "log10", "pow")


class Calls(TorchFunctionMode):
    """The names of the torch functions and tensor methods called inside the ``with`` block (``raw``: with their
    underscores, ``Tensor.__float__`` apart from ``Tensor.float``; one per call), the first argument of every
    cosine similarity (where a loss was evaluated), the largest tensor made, every power's exponent, and
    whether a complex tensor was an argument or a result (``complex``)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()
        self.raw: list[str] = []
        self.cosine_inputs: list = []
        self.exponents: list = []
        self.largest = 0
        self.complex = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        raw = getattr(func, "__name__", str(func))
        name = raw.strip("_")
        self.names.add(name)
        self.raw.append(raw)
        if name in ("cosine_similarity", "cosine_embedding_loss") and args:
            self.cosine_inputs.append(args[0])
        if name in ("pow", "float_power") and len(args) > 1:
            self.exponents.append(args[1])
        self.complex |= any(isinstance(a, torch.Tensor) and a.is_complex() for a in args)
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.largest = max(self.largest, out.numel())
            self.complex |= out.is_complex()
        return out

    def leaving_torch(self) -> list[str]:
        """The calls that took numbers out of torch (one ``.item()`` or ``float()``, for the answer, is fine)."""
        left = sorted(set(self.raw) & LEAVING_TORCH)
        scalars = sum(r in ("item", "__float__") for r in self.raw)
        return left + ([f"{scalars} .item() or float() calls"] if scalars > 1 else [])


def math_recorded(fn, used: list[str]):
    """``fn`` with every call of math's exponentials and logarithms (on Python floats, which torch's mode does
    not see) appended to ``used``."""

    def watch(frame, event, arg):
        if event == "c_call" and getattr(arg, "__module__", None) in ("math", "cmath") and arg.__name__ in MATH_LIKE:
            used.append(f"math.{arg.__name__}")

    return profiled(fn, watch)


THREAD_REFUSED = (
    "starting a thread is refused while the grader watches your function: torch records its calls in this "
    "thread only; compute in this one"
)


@contextlib.contextmanager
def no_threads():
    """Inside the block, ``threading.Thread.start`` (which thread pools use too) and ``_thread.start_new_thread``
    raise a RuntimeError that says why."""

    def refuse(*args, **kwargs):
        raise RuntimeError(THREAD_REFUSED)

    targets = [(threading.Thread, "start"), (_thread, "start_new_thread")]
    targets += [(threading, n) for n in ("_start_new_thread", "_start_joinable_thread") if hasattr(threading, n)]
    saved = [(owner, name, getattr(owner, name)) for owner, name in targets]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
