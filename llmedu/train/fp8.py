"""fp8 training, simulated: the E4M3 and E5M2 formats, per-tensor delayed scaling, an fp8 linear layer.

Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (arXiv 2209.05433), define two 8-bit
formats (sign, exponent, mantissa bits):

    E4M3  1 4 3  bias 7   max 448     no infinities; S.1111.111 is the only NaN   forward: x, W
    E5M2  1 5 2  bias 15  max 57344   IEEE-like: infinities and NaNs             backward: dy

E4M3 ("fn" in PyTorch: finite + NaN) buys one more mantissa bit with the top exponent that IEEE
reserves for inf/NaN; E5M2 keeps fp16's exponent range, which gradients need, at 2 mantissa bits.
``cast_to_fp8`` rounds float32 values to either grid (round half to even, subnormals included) and
returns float32: the values an fp8 tensor would hold. It matches ``x.to(torch.float8_e4m3fn)`` and
``x.to(torch.float8_e5m2)`` bit for bit (tests/test_train_fp8.py), including what they do out of range:

    E4M3  |x| beyond 448, and +-inf, saturate to +-448     (PyTorch 2.13's cast; the paper's Sec. 3)
    E5M2  |x| >= 61440 (halfway past 57344) becomes +-inf  (IEEE round-to-nearest-even)
    both  NaN stays NaN; a value that rounds to zero keeps its sign (-0.0)

(PyTorch before 2.13 cast E4M3 without saturating, 2.11 seen on a GPU machine: |x| > 464, past the tie
halfway to the next step, and +-inf became NaN; 464 itself rounds to 448. The OCP FP8 specification allows
either mode; we keep the saturating one, as Transformer Engine's casts do.)

Eight bits hold so little range that every tensor is multiplied by a *scale* before the cast and
divided by it after: ``x ~ fp8(x * s) / s``. NVIDIA Transformer Engine's *delayed scaling* takes s
from the past, so the cast needs no extra pass over x:

    s = (fp8_max / max(amax history)) / 2**margin         amax = max |x| of each past step

Each tensor's amax is appended to its history *after* it is used, so a spike changes the scale from
the next step on and for ``history_len`` steps. ``FP8Linear`` quantizes x and W to E4M3 in the
forward pass and dy to E5M2 in the backward pass, multiplies the fp8 values with fp32
accumulation, and counts overflows (|x * s| > max: clipped to +-max) and underflows (nonzero
x that became 0). The weights stay fp32 parameters: they are the master copies the optimizer updates.

Left out: fp8 storage (we hold the fp8 values in float32: same numbers, 4x the memory), fp8 weight
caching across micro-batches, power-of-two scales, current (just-in-time) and block (MXFP8) scaling,
amax reduction across data/tensor-parallel ranks, fp8 attention and all-gathers. On a GPU with fp8
tensor cores ``scaled_matmul`` calls ``torch._scaled_mm``; that path is never run by our CPU tests.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

__all__ = [
    "FP8Format",
    "FORMATS",
    "get_format",
    "cast_to_fp8",
    "DelayedScaling",
    "Quantized",
    "scaled_matmul",
    "FP8Linear",
    "convert_to_fp8",
    "fp8_counts",
]


# -- the two formats ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FP8Format:
    """Bit layout and range of an 8-bit float (the numbers are derived from the bits; see ``_format``)."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float  # largest finite value
    min_normal: float  # 2**(1 - bias)
    min_subnormal: float  # 2**(1 - bias - mantissa_bits): the grid spacing below min_normal
    saturates: bool  # out-of-range values become +-max (E4M3) rather than +-inf (E5M2)
    torch_dtype: torch.dtype  # the real dtype, for the reference cast and for torch._scaled_mm


def _format(name: str, exponent_bits: int, mantissa_bits: int, ieee: bool, dtype: torch.dtype) -> FP8Format:
    bias = 2 ** (exponent_bits - 1) - 1
    if ieee:  # the top exponent field is inf/NaN: the largest finite number has all mantissa bits set
        top_exponent = 2**exponent_bits - 2 - bias
        top_mantissa = 2 - 2.0**-mantissa_bits  # 1.11...1
    else:  # "fn": the top exponent is ordinary, only its all-ones mantissa is NaN
        top_exponent = 2**exponent_bits - 1 - bias
        top_mantissa = 2 - 2.0 ** (1 - mantissa_bits)  # 1.11...0
    return FP8Format(
        name=name,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        bias=bias,
        max=2.0**top_exponent * top_mantissa,
        min_normal=2.0 ** (1 - bias),
        min_subnormal=2.0 ** (1 - bias - mantissa_bits),
        saturates=not ieee,
        torch_dtype=dtype,
    )


FORMATS = {
    "e4m3": _format("e4m3", 4, 3, ieee=False, dtype=torch.float8_e4m3fn),  # 448, 2**-6, 2**-9
    "e5m2": _format("e5m2", 5, 2, ieee=True, dtype=torch.float8_e5m2),  # 57344, 2**-14, 2**-16
}


def get_format(fmt: str | FP8Format) -> FP8Format:
    """The ``FP8Format`` named ``fmt`` ('e4m3' or 'e5m2'); a format passes through."""
    if isinstance(fmt, FP8Format):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown fp8 format {fmt!r}; choose one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def cast_to_fp8(x: torch.Tensor, fmt: str | FP8Format) -> torch.Tensor:
    """Round ``x`` to the nearest value of an fp8 format (ties to even); float32 out, same shape."""
    fmt = get_format(fmt)
    x = x.float()
    a = x.abs()
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1): the leading bit is worth 2**(e - 1)
    e = (e - 1).clamp(min=1 - fmt.bias)  # below min_normal, subnormals share its exponent (fixed spacing)
    ulp = torch.ldexp(torch.ones_like(a), e - fmt.mantissa_bits)  # grid spacing around a: a power of 2
    q = torch.round(a / ulp) * ulp  # a / ulp is exact; torch.round rounds half to even
    if fmt.saturates:
        q = q.clamp(max=fmt.max)  # E4M3: beyond 448 (and inf) -> 448; NaN passes through clamp
    else:
        q = torch.where(q > fmt.max, math.inf, q)  # E5M2: rounded past the largest finite -> inf
    return torch.copysign(q, x)  # -0.0 for negatives that rounded to zero


# -- delayed scaling ------------------------------------------------------------------------------
class Quantized(NamedTuple):
    """An fp8 tensor: ``data`` = fp8(x * scale) held as float32 grid values, so x ~ data / scale."""

    data: torch.Tensor
    scale: float
    format: FP8Format

    def t(self) -> Quantized:
        return Quantized(self.data.t(), self.scale, self.format)


class DelayedScaling:
    """One tensor's scale, chosen from the amaxes of its last ``history_len`` steps.

    Call ``quantize`` once per step: it casts with the current scale, counts the overflows and
    underflows of that cast, then appends this step's amax and computes the scale for the next step.
    Finite values that the stale scale pushes past the format's max are clipped to +-max before the
    cast (Transformer Engine's casts saturate too), so one step of growth costs accuracy, not an inf
    in E5M2; inf and NaN inputs stay inf and NaN.

    The first step uses scale 1 (no history yet). A zero or non-finite amax is not recorded: an
    all-zero tensor says nothing about range, and an inf/NaN step is the loss scaler's business.
    """

    def __init__(self, fmt: str | FP8Format = "e4m3", history_len: int = 16, margin: int = 0):
        if not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"history_len must be an int >= 1, got {history_len!r}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0 (headroom of 2**margin below fp8 max), got {margin!r}")
        self.format = get_format(fmt)
        self.margin = margin
        self.history: deque[float] = deque(maxlen=history_len)  # oldest amax drops out
        self.scale = 1.0
        self.overflows = 0  # elements with |x * scale| > max, clipped to +-max (or inf inputs)
        self.underflows = 0  # nonzero elements that became zero

    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> Quantized:
        scaled = x.float() * self.scale
        out_of_range = scaled.abs() > self.format.max  # the scale is stale: this step's |x| grew past amax
        self.overflows += int(out_of_range.sum())
        clipped = torch.where(scaled.isfinite(), scaled.clamp(-self.format.max, self.format.max), scaled)
        q = Quantized(cast_to_fp8(clipped, self.format), self.scale, self.format)
        self.underflows += int(((x != 0) & (q.data == 0)).sum())
        amax = float(x.abs().max())
        if math.isfinite(amax) and amax > 0:
            self.history.append(amax)
        if self.history:  # the delayed part: this step's amax shapes the *next* step's scale
            self.scale = self.format.max / max(self.history) / 2**self.margin
        return q

    def state(self) -> torch.Tensor:
        """(4 + history_len,) float64: scale, overflows, underflows, amaxes recorded, then the amaxes oldest
        first (0 beyond them). A checkpoint needs it: a resumed run must not restart at scale 1."""
        amaxes = [*self.history] + [0.0] * (self.history.maxlen - len(self.history))
        head = [self.scale, self.overflows, self.underflows, len(self.history)]
        return torch.tensor(head + amaxes, dtype=torch.float64)

    def load_state(self, state: torch.Tensor) -> None:
        """Restore what ``state`` returned (same ``history_len``)."""
        if state.shape != (4 + self.history.maxlen,):
            raise ValueError(
                f"fp8 scaling state of shape {tuple(state.shape)} does not fit history_len={self.history.maxlen} "
                f"(expected ({4 + self.history.maxlen},)): convert the model with the history_len it was saved with"
            )
        scale, overflows, underflows, n, *amaxes = state.tolist()
        self.scale, self.overflows, self.underflows = scale, int(overflows), int(underflows)
        self.history.clear()
        self.history.extend(amaxes[: int(n)])


# -- the fp8 matmul and linear layer --------------------------------------------------------------
def _fp8_tensor_cores(device: torch.device) -> bool:
    """Hopper/Ada (compute capability >= 8.9) have fp8 matmuls; never true on the CPU we test on."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_matmul(a: Quantized, b: Quantized) -> torch.Tensor:
    """(a @ b.T) / (a.scale * b.scale): a (M, K), b (N, K) fp8 values, fp32 products and sums -> (M, N)."""
    if _fp8_tensor_cores(a.data.device) and a.data.shape[1] % 16 == 0 and all(n % 16 == 0 for n in b.data.shape):
        # NEVER RUN HERE (CPU-only tests): the real fp8 GEMM. The cast to an fp8 dtype is exact (the
        # values are on its grid); _scaled_mm wants `a` row-major, `b` column-major, and the
        # dequantization factors 1/scale, which it applies to the fp32 accumulator.
        a8 = a.data.contiguous().to(a.format.torch_dtype)
        b8 = b.data.contiguous().to(b.format.torch_dtype)
        inv = lambda s: torch.tensor(1.0 / s, device=a8.device)
        out = torch._scaled_mm(a8, b8.t(), scale_a=inv(a.scale), scale_b=inv(b.scale), out_dtype=torch.float32)
        return out[0] if isinstance(out, tuple) else out  # older torch versions returned (out, amax)
    return (a.data @ b.data.t()) / (a.scale * b.scale)  # fp8 x fp8 products are exact in fp32; sums in fp32


class _FP8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with x, W cast to E4M3 (forward) and dy cast to E5M2 (backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        xq = layer.input_scaling.quantize(x2)  # E4M3 (N, in)
        wq = layer.weight_scaling.quantize(weight)  # E4M3 (out, in)
        y = scaled_matmul(xq, wq)  # (N, out)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(xq.data, wq.data)  # backward reuses the fp8 copies, as Transformer Engine does
        ctx.meta = (xq.scale, wq.scale, layer, bias is not None, x.shape)
        return y.reshape(*x.shape[:-1], y.shape[-1])  # (..., out)

    @staticmethod
    def backward(ctx, grad_y):
        x_data, w_data = ctx.saved_tensors
        x_scale, w_scale, layer, has_bias, x_shape = ctx.meta
        xq, wq = Quantized(x_data, x_scale, FORMATS["e4m3"]), Quantized(w_data, w_scale, FORMATS["e4m3"])
        g = grad_y.reshape(-1, grad_y.shape[-1])  # (N, out)
        gq = layer.grad_scaling.quantize(g)  # E5M2 (N, out)
        grad_x = scaled_matmul(gq, wq.t())  # (N, in)   = dy @ W
        grad_w = scaled_matmul(gq.t(), xq.t())  # (out, in) = dy^T @ x
        grad_b = g.sum(0) if has_bias else None  # from the unquantized fp32 dy
        return grad_x.reshape(x_shape), grad_w, grad_b, None


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose matmuls run in (simulated) fp8, with one ``DelayedScaling`` per tensor.

    The parameters are ordinary fp32 ``nn.Parameter``s: the optimizer updates them in fp32 and each
    forward pass re-quantizes them. It is still an ``nn.Linear``, so code that looks for those finds it.
    Every forward call is a step of its scaling states, evaluation passes included. Those states are
    part of the state dict (``_extra_state``: a (3, 4 + history_len) float64 tensor, input/weight/grad),
    so a checkpoint resumes with the scales it stopped at. An empty input (no rows: an MoE expert that
    got no tokens) gives the empty output of ``nn.Linear``, exactly, and is no step of the scaling
    states: it has no amax to record, and zero rows need no rounding.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        history_len: int = 16,
        margin: int = 0,
        device=None,
    ):
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.input_scaling = DelayedScaling("e4m3", history_len, margin)
        self.weight_scaling = DelayedScaling("e4m3", history_len, margin)
        self.grad_scaling = DelayedScaling("e5m2", history_len, margin)

    @classmethod
    def from_linear(cls, linear: nn.Linear, history_len: int = 16, margin: int = 0) -> FP8Linear:
        """An FP8Linear sharing ``linear``'s parameter objects (tied weights stay tied)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, history_len, margin, "meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # (..., 0 rows or 0 features): nothing to scale; gradients to W and b are zero
            return nn.functional.linear(x, self.weight, self.bias)
        return _FP8LinearFunction.apply(x, self.weight, self.bias, self)

    def get_extra_state(self) -> torch.Tensor:
        return torch.stack([scaling.state() for scaling in self.scalings().values()])  # (3, 4 + history_len)

    def set_extra_state(self, state: torch.Tensor) -> None:
        if state.shape[0] != 3:
            raise ValueError(
                f"FP8Linear scaling state must have 3 rows (input, weight, grad), got {tuple(state.shape)}"
            )
        for scaling, row in zip(self.scalings().values(), state):
            scaling.load_state(row)

    def scalings(self) -> dict[str, DelayedScaling]:
        return {"input": self.input_scaling, "weight": self.weight_scaling, "grad": self.grad_scaling}


def convert_to_fp8(model: nn.Module, history_len: int = 16, margin: int = 0) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by an ``FP8Linear`` with the same parameters, in place."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear) and not isinstance(child, FP8Linear):
            setattr(model, name, FP8Linear.from_linear(child, history_len, margin))
        else:
            convert_to_fp8(child, history_len, margin)
    return model


def fp8_counts(model: nn.Module) -> dict[str, dict[str, int]]:
    """Overflow and underflow counts summed over the FP8Linear layers, per tensor: input, weight, grad."""
    counts = {kind: {"overflows": 0, "underflows": 0} for kind in ("input", "weight", "grad")}
    for module in model.modules():
        if isinstance(module, FP8Linear):
            for kind, scaling in module.scalings().items():
                counts[kind]["overflows"] += scaling.overflows
                counts[kind]["underflows"] += scaling.underflows
    return counts
