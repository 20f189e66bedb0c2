"""Integer quantization of weights and activations, and a linear layer that multiplies in int8.

A real number x is stored as an integer code q and read back as ``x_hat = scale * (q - zero_point)``:

    symmetric   zero_point = 0,  scale = absmax / ((qmax - qmin) / 2),  q in [-2^(b-1), 2^(b-1) - 1]
    asymmetric  scale = (max - min) / (qmax - qmin),  zero_point = qmin - round(min / scale),  q in [0, 2^b - 1]
    q = clamp(round(x / scale) + zero_point, qmin, qmax)     (computed as x * (1/scale) + zero_point, as kernels do)

(Jacob et al. 2018, "Quantization and Training of Neural Networks for Efficient Integer-Arithmetic-Only
Inference", eq. 1; the symmetric scale is ``torch.ao``'s MinMaxObserver's, absmax / 127.5 for 8 bits,
which uses the code -128 too; LLM.int8 and bitsandbytes use absmax / 127 over [-127, 127].) The range
[min, max] is stretched to hold 0, so zero (padding, ReLU's output) is stored exactly. Inside the range
every value is off by at most ``scale / 2``: that is the error bound the tests check, per scheme.

One scale for the whole tensor (per-tensor) or one per row (``axis=0``: per output channel of a weight,
or per token of an activation): one outlier then spoils only its own row's step size.

``QuantLinear`` stores int8 weights and quantizes its input *dynamically*: each call measures
the input's range, quantizes it to 7 bits (codes 0..127, what fbgemm's ``reduce_range`` does, so that
the products fit the int16 pair sums of its AVX2 kernel; ``quantize_per_call``, the same codes in one
float32 pass) and multiplies integer codes with
``torch._int_mm`` (int8 x int8 -> int32, an int8 GEMM kernel of torch's CPU build, not a loop). The float
result is ``s_x s_w (Q_x - z_x) Q_w^T + b``; the zero point comes out as a correction
``z_x * rowsum(Q_w)``, so the integer matmul never sees it. This is the arithmetic of
``torch.ao.quantization.quantize_dynamic`` (qint8 symmetric weights, per tensor by default or per channel
with ``per_channel_dynamic_qconfig``; quint8 reduce-range activations), down to the rounding: the tests
find the same integer codes on MiniLM, and outputs equal to float32 rounding.

``Int8Embedding`` stores an embedding table the same way, weight-only: int8 rows with one fp32 scale
each (absmax / 127). A lookup reads no matmul, so there is nothing to quantize on the activation side.

Left out: static (calibrated) activation quantization, quantization-aware training, int4 kernels.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "SUPPORTED_BITS",
    "qrange",
    "quantize",
    "quantize_per_call",
    "dequantize",
    "int8_matmul",
    "QuantLinear",
    "quantize_linears",
    "Int8Embedding",
]

SUPPORTED_BITS = tuple(range(2, 9))  # codes stored in one (u)int8 byte each
_EPS = torch.finfo(torch.float32).eps  # the smallest scale, as torch.ao's observers


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS} (codes are stored in one byte), got {bits!r}")
    return bits


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """The smallest and largest integer code: (-128, 127) for 8-bit symmetric, (0, 255) asymmetric."""
    _check_bits(bits)
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)


def _min_max(x: torch.Tensor, axis: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """min and max of x over everything (axis None) or over all dims but ``axis``, kept broadcastable."""
    if axis is None:
        lo, hi = torch.aminmax(x)  # one pass over x
        return lo.reshape([1] * x.dim()), hi.reshape([1] * x.dim())
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} is out of range for a tensor of {x.dim()} dims {tuple(x.shape)}")
    dims = [d for d in range(x.dim()) if d != axis % x.dim()]
    return x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)


def _scale_and_zero_point(lo, hi, qmin: int, qmax: int, symmetric: bool):
    """float32 scale and zero point (shaped as lo and hi) for codes qmin..qmax covering [lo, hi] and 0."""
    lo, hi = lo.double().clamp(max=0.0), hi.double().clamp(min=0.0)  # float64, as torch's ChooseQuantizationParams;
    # the range must hold 0 exactly. A min or max is one of x's values: exact in x's own dtype.
    if symmetric:
        scale = (torch.maximum(-lo, hi) / ((qmax - qmin) / 2)).float().clamp(min=_EPS)
        return scale, torch.zeros_like(scale)
    scale = ((hi - lo) / (qmax - qmin)).float().clamp(min=_EPS)
    return scale, (qmin - torch.round(lo / scale.double())).clamp(qmin, qmax).float()


def quantize(
    x: torch.Tensor, bits: int = 8, symmetric: bool = True, axis: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (float) -> (codes, scale, zero_point); scale and zero_point broadcast against x.

    Codes are int8 when symmetric, uint8 when asymmetric. ``axis=None``: one scale for the whole
    tensor; ``axis=0``: one per row (a weight's output channels, or an activation's tokens).
    """
    _check_bits(bits)
    if not x.is_floating_point():
        raise TypeError(f"can only quantize floating-point tensors, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError("cannot quantize an empty tensor: its range is undefined")
    qmin, qmax = qrange(bits, symmetric)
    scale, zero_point = _scale_and_zero_point(*_min_max(x.detach(), axis), qmin, qmax, symmetric)
    # x * (1/scale) + zero_point rounded once to float32 (the kernels' fused multiply-add; the float64
    # product of two float32 numbers is exact), then to the nearest integer, ties to even. In place on one
    # float64 copy: a fresh tensor of an activation's size costs new pages from the OS, and out of place
    # these steps took 30 ms on a (1536, 1536) input, in place 7 ms (one thread, measured on this CPU).
    inverse = (1.0 / scale).double()
    q = x.detach().to(torch.float64, copy=True).mul_(inverse).add_(zero_point.double())
    q = q.float().round_().clamp_(qmin, qmax)
    return q.to(torch.int8 if symmetric else torch.uint8), scale, zero_point


def quantize_per_call(x: torch.Tensor, bits: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An activation's per-tensor asymmetric codes, fast: ``quantize(x, bits, symmetric=False)`` in float32.

    A dynamic layer quantizes its input at every call, so this is the hot path (``quantize`` serves weights,
    once). The same codes, returned as int8 (bits <= 7: codes 0..127 fit it): ``torch.add(z, x, alpha=1/s)``
    is one fused multiply-add per element on the CPU (ATen's add kernel computes ``fmadd(x, alpha, z)``),
    rounded once, as fbgemm's quantizer and the float64 steps of ``quantize`` are. Written
    ``x * (1/s) + z`` it would round twice and give another code for a few values in ten million (measured:
    9 of 40M normal samples; the test finds such values and checks them). 2.6x faster than ``quantize`` on a
    (1536, 1536) input, one float32 pass where that makes a float64 copy (measured on this CPU).
    """
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS or bits > 7:
        raise ValueError(f"bits must be 2..7 (codes 0..2^bits - 1 are returned as int8), got {bits!r}")
    if not x.is_floating_point() or x.numel() == 0:
        raise ValueError(f"quantize_per_call takes a non-empty floating-point tensor, got {x.dtype} {tuple(x.shape)}")
    qmin, qmax = qrange(bits, symmetric=False)
    scale, zero_point = _scale_and_zero_point(*_min_max(x.detach(), None), qmin, qmax, symmetric=False)
    inverse = float(1.0 / scale)  # float32 division, as fbgemm's 1.f / scale
    q = torch.add(zero_point, x.detach().float(), alpha=inverse)  # z + x / s, one rounding
    return q.round_().clamp_(qmin, qmax).to(torch.int8), scale, zero_point


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """codes -> float32: ``scale * (q - zero_point)``."""
    if q.is_floating_point():
        raise TypeError(f"dequantize takes integer codes, got {q.dtype}: were they dequantized already?")
    return scale * (q.float() - zero_point)


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(M, K) int8 @ (K, N) int8 -> (M, N) int32, exactly.

    ``torch._int_mm`` on the CPU (any shape) and on CUDA where its kernel accepts the shape (M > 16,
    K and N multiples of 8); elsewhere float64, which holds every such sum exactly (|sum| < 2^53).
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul takes int8 operands, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"int8_matmul needs (M, K) @ (K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    m, k = a.shape
    n = b.shape[1]
    if a.device.type == "cpu" or (a.device.type == "cuda" and m > 16 and k % 8 == 0 and n % 8 == 0):
        return torch._int_mm(a, b)
    return (a.double() @ b.double()).to(torch.int32)


class QuantLinear(nn.Module):
    """An ``nn.Linear`` stored as int8 weights; inputs quantized per call to 7-bit asymmetric codes.

    ``y = s_x * s_w * ((Q_x @ Q_w^T) - z_x * rowsum(Q_w)) + b``, the matmul in int8 x int8 -> int32.
    """

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if weight_q.dtype != torch.int8 or weight_q.dim() != 2:
            raise ValueError(f"weight_q must be a 2-d int8 tensor, got {weight_q.dtype} {tuple(weight_q.shape)}")
        self.out_features, self.in_features = weight_q.shape
        self.register_buffer("weight_q", weight_q)  # (d_out, d_in) int8
        self.register_buffer("weight_scale", weight_scale.reshape(1, -1).float())  # (1, 1) or (1, d_out)
        self.register_buffer("weight_rowsum", weight_q.sum(dim=1, dtype=torch.int32))  # (d_out,) for z_x
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, per_channel: bool = False) -> QuantLinear:
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"QuantLinear quantizes an nn.Linear, got {type(linear).__name__}")
        q, scale, _ = quantize(linear.weight, bits=8, symmetric=True, axis=0 if per_channel else None)
        return cls(q, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d_out)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs with {self.in_features} features, got shape {tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_features)  # (N, d_in)
        xq, sx, zx = quantize_per_call(x2, bits=7)  # (N, d_in) codes 0..127, as int8
        acc = int8_matmul(xq, self.weight_q.t())  # (N, d_out) int32
        # The epilogue works in place: at N = 2048 rows an (N, d_out) tensor is 12 MB, and each new one costs
        # a trip through memory (measured: 17 ms of a 26 ms layer made of out-of-place steps, the int8
        # matmul itself 6 ms). Same operations in the same order, so the same numbers.
        acc.sub_(zx.to(torch.int32) * self.weight_rowsum)  # remove the zero point's share, still exact
        y = acc.float().mul_(sx * self.weight_scale)  # (N, d_out)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        per = "channel" if self.weight_scale.numel() > 1 else "tensor"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights per-{per}"


def quantize_linears(model: nn.Module, per_channel: bool = False) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a ``QuantLinear``; returns their names.

    The from-scratch counterpart of ``torch.ao.quantization.quantize_dynamic(model, {nn.Linear})``.
    """
    names = [name for name, m in model.named_modules() if name and isinstance(m, nn.Linear)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no nn.Linear to quantize")
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, QuantLinear.from_linear(getattr(owner, child), per_channel))
    return names


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows, each with its fp32 scale (absmax / 127): a lookup
    gathers the codes and scales of the ids and multiplies, so the table is never made fp32 whole."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"Int8Embedding quantizes an nn.Embedding, got {type(embedding).__name__}")
        w = embedding.weight.detach()  # (V, d)
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127  # (V, 1)
        self.register_buffer("weight_q", torch.round(w / scale).to(torch.int8))  # (V, d)
        self.register_buffer("scale", scale)
        self.padding_idx = embedding.padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, d)
        return self.weight_q[ids].float() * self.scale[ids]
