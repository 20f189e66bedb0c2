"""Graders for lesson 22, quantization: each checks the value against the library and the method by what the
learner's code calls.

check_smoothing_scales(fn)  fn(hidden (B, T, d), mask (B, T), weights [(d_out, d), ...], alpha) -> s (d,):
                            SmoothQuant's s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (Xiao et al. 2023, eq. 4)
                            for one LayerNorm output read by several linears: max|X_j| over the real (mask 1)
                            tokens of every sequence, max|W_j| over every output row of every weight. Compared
                            with ``smoothquant.smoothing_scales``, which the answer must not call.
check_gptq_fix(fn)          fn(weight (d_out, d_in), x (N, d_in), bits) -> codes (d_out, d_in): GPTQ's codes on
                            RTN's per-row min-max grid, damping 1% of mean(diag H) (Frantar et al. 2022, Algorithm 1).
                            Compared exactly with ``gptq.gptq_codes``, which the answer must not call.
check_llm_int8(fn)          fn(x (N, d_in), weight (d_out, d_in), threshold) -> y (N, d_out): LLM.int8's product
                            (Dettmers et al. 2022, eq. 7): the columns with some |x| >= threshold in floating point,
                            the rest in vector-wise int8 (``int8.quantize(t, 8, symmetric=True, axis=0)`` of the
                            rest of x and of W). Compared with ``llm_int8.llm_int8_matmul``, which the answer must not
                            call; every matrix product is recorded, and a floating-point one that contracts more
                            columns than the outliers fails (the int8 part must be an integer product:
                            ``int8.int8_matmul`` or ``torch._int_mm``, over the d_in - |O| ordinary columns or,
                            as bitsandbytes does, over all d_in with the outlier columns' codes zeroed). The
                            output must be computed from that product: every tensor made from its result is
                            followed, so a discarded call beside a float product fails.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmedu.checks.core import CheckResult, Grader, call_watching
from llmedu.compress import gptq, llm_int8, smoothquant
from llmedu.compress.gptq import gptq_codes
from llmedu.compress.llm_int8 import llm_int8_matmul
from llmedu.compress.smoothquant import smoothing_scales

__all__ = ["check_smoothing_scales", "check_gptq_fix", "check_llm_int8"]


def _forbid(g: Grader, module, fn, args: tuple, what: str):
    """``fn(*args)``, failing the case when it calls anything defined in ``module``'s file."""
    got, called = call_watching(g, fn, args, Path(module.__file__))
    g.expect(f"{what}: your own code", called is None, f"your function called the library's {called}: write it")
    return got


def _smoothing_cases(gen: torch.Generator):
    """(name, hidden, mask, weights, alpha): each defeats one slip (the comment says which)."""
    cases = []
    for B, T, d, outs, alpha in [(2, 5, 8, (8, 8, 8), 0.5), (3, 6, 8, (8, 16), 0.75), (2, 4, 16, (16,), 0.25)]:
        hidden = torch.randn(B, T, d, generator=gen)
        hidden[0, 1, 2] = -40.0  # a negative outlier at a real token: the max of |x|, not of x
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, -2:] = 0  # padding: its hidden states hold values no real token has
        hidden[1, -1, 3] = 90.0
        # weights of different column maxima: every reader counts, and a square one makes the wrong axis fail by value
        weights = [torch.randn(o, d, generator=gen) * (1 + k) for k, o in enumerate(outs)]
        weights[-1][:, 5] *= 8
        cases.append((f"hidden ({B}, {T}, {d}), weights {[tuple(w.shape) for w in weights]}, alpha {alpha}",
                      hidden, mask, weights, alpha))  # fmt: skip
    return cases


def check_smoothing_scales(fn) -> CheckResult:
    g = Grader("check_smoothing_scales")
    for name, hidden, mask, weights, alpha in _smoothing_cases(torch.Generator().manual_seed(5)):
        act_absmax = hidden[mask.bool()].abs().amax(dim=0)  # (d,) over the real tokens
        expected = smoothing_scales(act_absmax, weights, alpha)
        args = (hidden.clone(), mask.clone(), [w.clone() for w in weights], alpha)
        got = _forbid(g, smoothquant, fn, args, name)
        g.compare(name, got, expected, rtol=1e-5)
    return g.result()


def _gptq_cases(gen: torch.Generator):
    """(name, weight, x, bits): correlated inputs with a few large features, where GPTQ's codes differ from RTN's."""
    cases = []
    for d_out, d_in, n, bits in [(4, 8, 64, 4), (6, 16, 128, 4), (8, 24, 96, 3)]:
        mix = torch.randn(d_in, d_in, generator=gen, dtype=torch.float64) / d_in**0.5 + torch.eye(d_in)
        x = torch.randn(n, d_in, generator=gen, dtype=torch.float64) @ mix  # (N, d_in), correlated features
        x[:, 1] *= 6  # a large feature
        weight = torch.randn(d_out, d_in, generator=gen)
        cases.append((f"weight ({d_out}, {d_in}), x ({n}, {d_in}), {bits} bits", weight, x.float(), bits))
    return cases


def check_gptq_fix(fn) -> CheckResult:
    g = Grader("check_gptq_fix")
    for name, weight, x, bits in _gptq_cases(torch.Generator().manual_seed(6)):
        expected = gptq_codes(weight, x, bits)[0]  # (d_out, d_in) float64 integer codes
        got = _forbid(g, gptq, fn, (weight.clone(), x.clone(), bits), name)
        if isinstance(got, torch.Tensor):
            got = got.double()
        g.compare(f"{name}: the codes", got, expected)
    return g.result()


_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "vdot", "_int_mm"}


class _Products(TorchDispatchMode):
    """Every matrix product inside the ``with`` block: (name, dtype, contracted length); the largest
    floating-point tensor any operation made (a broadcast product summed by hand is one); and the tensors computed
    from an integer product that contracts at least ``min_int`` columns (``fed``: its result and every tensor an
    operation makes from them, an in-place one's target and that target's base included)."""

    def __init__(self, min_int: int):
        super().__init__()
        self.products: list[tuple[str, torch.dtype, int]] = []
        self.largest = 0
        self.min_int = min_int
        self.fed: dict[int, torch.Tensor] = {}  # id -> tensor, kept alive so that no id is reused

    def feeds(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self.fed.get(id(t)) is t

    def _mark(self, t: torch.Tensor):
        self.fed[id(t)] = t
        if t._base is not None:  # y[:, :] = ...: the write lands in y
            self.fed[id(t._base)] = t._base

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        integer = False
        if name in _MATMULS:
            a = args[1] if name in ("addmm", "baddbmm", "addmv") else args[0]
            self.products.append((name, a.dtype, a.numel() if name in ("dot", "vdot") else a.shape[-1]))
            integer = not a.dtype.is_floating_point and self.products[-1][2] >= self.min_int
        out = func(*args, **(kwargs or {}))
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        for t in outs:
            if t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        if integer or any(self.feeds(t) for t in tree_leaves((args, kwargs or {}))):
            for t in outs:
                self._mark(t)
            if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
                self._mark(args[0])
        return out


def _llm_int8_cases(gen: torch.Generator):
    """(name, x, weight, threshold): tokens of norms 1/4 to 8 (one scale per tensor fails), output rows of
    different sizes (one weight scale fails), outlier columns, one value exactly at the threshold."""
    cases = []
    for n, d_in, d_out, threshold in [(6, 16, 8, 6.0), (10, 32, 12, 6.0), (8, 24, 5, 4.0)]:
        x = torch.randn(n, d_in, generator=gen) * torch.exp2(torch.randint(-2, 4, (n, 1), generator=gen).float()) / 8
        x[1, 3], x[4, 7], x[2, 5] = 20.0, -9.0, threshold  # outliers; |x| == threshold counts (>=)
        weight = torch.randn(d_out, d_in, generator=gen) * torch.linspace(0.2, 3.0, d_out)[:, None]
        cases.append((f"x ({n}, {d_in}), weight ({d_out}, {d_in}), threshold {threshold}", x, weight, threshold))
    return cases


def check_llm_int8(fn) -> CheckResult:
    g = Grader("check_llm_int8")
    for name, x, weight, threshold in _llm_int8_cases(torch.Generator().manual_seed(7)):
        expected, parts = llm_int8_matmul(x, weight, threshold)
        n_out = int(parts["columns"].sum())
        products = _Products(min_int=x.shape[1] - n_out)
        with products:
            got = _forbid(g, llm_int8, fn, (x.clone(), weight.clone(), threshold), name)
        floats = [p for p in products.products if p[1].is_floating_point and p[2] > n_out]
        g.expect(
            f"{name}: int8 on the {x.shape[1] - n_out} ordinary columns",
            not floats,
            f"a floating-point {floats[0][0] if floats else ''} contracted {floats[0][2] if floats else 0} columns, "
            f"but only {n_out} are outliers: multiply the rest as int8 codes (int8_matmul or torch._int_mm)",
        )
        limit = max(x.numel(), weight.numel(), x.shape[0] * weight.shape[0])
        g.expect(
            f"{name}: no broadcast product",
            products.largest <= limit,
            f"a float tensor of {products.largest} elements was made (the inputs and output hold at most {limit}): "
            "a product summed by hand is a float product too",
        )
        ints = [p for p in products.products if not p[1].is_floating_point and p[2] >= x.shape[1] - n_out]
        g.expect(f"{name}: an integer product", bool(ints), "no integer matrix product of the ordinary columns ran")
        g.expect(
            f"{name}: the integer product feeds the output",
            products.feeds(got),
            "the output was not computed from the integer product: scale its int32 result into y",
        )
        if isinstance(got, torch.Tensor) and got.shape == expected.shape:
            error = float((got.float() - expected).norm() / expected.norm())
            g.expect(f"{name}: the value", error < 1e-5, f"relative difference {error:.2e} from the reference")
        else:
            g.compare(name, got, expected)
    return g.result()
