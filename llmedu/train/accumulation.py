"""Why low-precision training keeps an fp32 accumulator, and what TF32 costs a matmul, in numbers.

**Accumulation.** A running sum rounds after every addition. With p significant bits a sum s has
grid spacing ulp(s) = 2**(floor(log2 s) - p + 1); adding v < ulp(s) / 2 rounds straight back to s,
so the sum *stalls*. For bf16 (p = 8) and a v strictly between powers of two, 2**k < v < 2**(k+1):

    s in [2**(k+8), 2**(k+9))   ulp = 2**(k+1), v > ulp/2   each addition adds exactly one ulp
    s >= 2**(k+9)               ulp = 2**(k+2), v < ulp/2   each addition is rounded away

so a bf16 running sum of copies of v stops at 2**(floor(log2 v) + 9): 10,000 copies of
bf16(1e-3) = 0.000999451 (k = -10) add up to 0.5, not 9.99. An fp32 accumulator (p = 24) has
spacing 2**-20 near 10, and v has only 8 significant bits, so every partial sum is exact: it ends
on 9.9945068359375 = 10,000 * v. This is why matmul units accumulate bf16 and fp8 products in fp32
(Micikevicius et al. 2018, Sec. 3.3).

**TF32** (NVIDIA Ampere, 2020) is fp32's 8 exponent bits with 10 mantissa bits: tensor cores round
fp32 matmul *inputs* to TF32 and accumulate in fp32 (``torch.backends.cuda.matmul.allow_tf32``).
``round_to_tf32`` emulates the input rounding on the CPU (round half to even on the bit pattern; the
hardware's own conversion may round ties away or truncate), ``matmul_errors`` measures the relative
error that costs against fp64, next to fp32 and to bf16 inputs. Rounding to m mantissa bits has a
relative rms error of 2**-m * sqrt(3 / (8 ln 2) / 12) = 0.212 * 2**-m per input (for mantissas spread
log-uniformly, as N(0, 1) samples nearly are); a product carries two, so a matmul's relative error
is about sqrt(2) * 0.212 * 2**-m: 2.9e-4 for TF32 (m = 10), 2.3e-3 for bf16 (m = 7).

Left out: pairwise/Kahan summation, stochastic rounding, split-K accumulation order on real GPUs.
"""

from __future__ import annotations

import math

import torch

__all__ = ["running_sum", "stall_point", "round_to_tf32", "round_to_bf16_inputs", "matmul_errors"]

_SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}  # mantissa bits + implicit 1


def running_sum(value: float, n: int, accumulator: torch.dtype, value_dtype: torch.dtype = torch.bfloat16) -> float:
    """Add ``value`` (rounded to ``value_dtype``) ``n`` times into an ``accumulator``-typed running sum."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    v = torch.tensor(value, dtype=value_dtype).to(accumulator)  # the stored input, e.g. bf16(1e-3)
    total = torch.zeros((), dtype=accumulator)
    for _ in range(n):
        total = total + v  # the result is rounded to the accumulator's format after every addition
    return total.item()


def stall_point(value: float, dtype: torch.dtype = torch.bfloat16) -> float:
    """Where a running sum of ``dtype(value)`` stops growing: 2**(floor(log2 v) + p + 1), p significant bits.

    For v strictly between two powers of two (see the module docstring); at v = 2**k exactly the
    additions in [2**(k+p), 2**(k+p+1)) are ties that round to even, and the sum stalls at 2**(k+p).
    """
    if dtype not in _SIGNIFICANT_BITS:
        raise ValueError(f"stall_point knows {list(_SIGNIFICANT_BITS)}, got {dtype}")
    v = torch.tensor(value, dtype=dtype).item()
    if v <= 0:
        raise ValueError(f"the value must round to a positive number, got {value} -> {v}")
    k = math.floor(math.log2(v))
    p = _SIGNIFICANT_BITS[dtype]
    return 2.0 ** (k + p) if v == 2.0**k else 2.0 ** (k + p + 1)


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to 10 mantissa bits (TF32), ties to even; float32 out, low 13 bits zero."""
    bits = x.float().view(torch.int32)
    dropped = 23 - 10  # fp32 mantissa bits that TF32 does not have
    lsb = (bits >> dropped) & 1  # the last kept bit: adding it turns "round half up" into "half to even"
    rounded = (bits + (1 << (dropped - 1)) - 1 + lsb) & ~((1 << dropped) - 1)  # a carry may bump the exponent
    return torch.where(x.isnan(), x.float(), rounded.view(torch.float32))  # keep NaNs NaN


def round_to_bf16_inputs(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to bf16 (7 mantissa bits) and back, for a matmul with bf16 inputs."""
    return x.to(torch.bfloat16).float()


def matmul_errors(sizes=(64, 256, 1024), seed: int = 0) -> dict[int, dict[str, float]]:
    """Relative Frobenius error of an (n, n) @ (n, n) matmul against fp64, per input rounding.

    Inputs are N(0, 1); every variant multiplies in fp32 (``torch.matmul`` on float32) after rounding
    its inputs: 'fp32' (no rounding), 'tf32' (10 mantissa bits), 'bf16' (7 mantissa bits). Returns
    ``{n: {"fp32": e, "tf32": e, "bf16": e, "tf32 vs fp32": e}}``.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)  # (n, n) float32
        exact = a.double() @ b.double()
        rel = lambda c, ref: ((c.double() - ref).norm() / ref.norm()).item()
        c32 = a @ b
        c_tf32 = round_to_tf32(a) @ round_to_tf32(b)
        c_bf16 = round_to_bf16_inputs(a) @ round_to_bf16_inputs(b)
        out[n] = {
            "fp32": rel(c32, exact),
            "tf32": rel(c_tf32, exact),
            "bf16": rel(c_bf16, exact),
            "tf32 vs fp32": rel(c_tf32, c32.double()),
        }
    return out
