"""Graders for lesson 07's precision exercises: accumulation, number formats, 8-bit optimizer state.

check_stall_point(fn)           fn(value, dtype) -> where a running sum of dtype(value), kept in
                                dtype, stops growing (bf16, fp16, fp32; ties included)
check_additions_to_stall(fn)    fn(value, dtype) -> how many additions of dtype(value) change a running
                                sum kept in dtype before it stalls (bf16, fp16): not stall / value
check_float_format(fn)          fn(exponent_bits, mantissa_bits, ieee) -> (max, min_normal, min_subnormal)
                                of a binary float format: fp32, TF32, bf16, fp16, fp8 E5M2 and E4M3
check_adam8bit_state_bytes(fn)  fn(numel, block_size, min_8bit_size) -> bytes of ``AdamW8bit``'s state
                                for one parameter tensor after its first step, as ``state_bytes`` counts them

The references are the library's (``stall_point``) or measured (a real running sum, ``torch.finfo``,
``FORMATS``, the state tensors of a real ``AdamW8bit``), never a second copy of the formula being tested.
"""

from __future__ import annotations

import torch

from llmedu.checks.core import CheckResult, Grader
from llmedu.optim.eight_bit import AdamW8bit, state_bytes
from llmedu.train.accumulation import stall_point
from llmedu.train.fp8 import FORMATS

__all__ = ["check_stall_point", "check_additions_to_stall", "check_float_format", "check_adam8bit_state_bytes"]

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def check_stall_point(fn) -> CheckResult:
    """Grade ``fn(value, dtype)`` against ``llmedu.train.accumulation.stall_point``."""
    g = Grader("check_stall_point")
    cases = [
        (0.01, torch.bfloat16),  # the value of the exercise
        (0.3, torch.bfloat16),
        (0.01, torch.float16),  # more significant bits: a later stall
        (1e-3, torch.float32),
        (2.0**-7, torch.bfloat16),  # a power of two: the additions past 2**(k+p) are ties, rounded to even
        (0.99999, torch.bfloat16),  # rounds up to 1.0 in bf16, a power of two
    ]
    for value, dtype in cases:
        got = g.call(fn, value, dtype)
        if not g.compare(f"value={value!r}, dtype={DTYPE_NAMES[dtype]}", got, stall_point(value, dtype), rtol=1e-9):
            break
    return g.result()


def _measured_additions_to_stall(value: float, dtype: torch.dtype, limit: int = 100_000) -> int:
    """Add dtype(value) into a dtype running sum until an addition changes nothing; count the ones that did."""
    v = torch.tensor(value, dtype=dtype)
    total = torch.zeros((), dtype=dtype)
    for n in range(limit):
        new = total + v  # rounded to dtype's grid around the sum
        if new == total:
            return n
        total = new
    raise RuntimeError(f"the sum of {value} in {dtype} did not stall within {limit:,} additions")


def check_additions_to_stall(fn) -> CheckResult:
    """Grade ``fn(value, dtype)`` against the count of a real running sum (bf16 and fp16 accumulators)."""
    g = Grader("check_additions_to_stall")
    cases = [
        (0.01, torch.bfloat16),  # the value of the exercise: 350 additions, not 4 / 0.01 = 400
        (1e-3, torch.bfloat16),  # the lesson's value: 383, not 0.5 / v = 500
        (0.3, torch.bfloat16),
        (0.01, torch.float16),  # 3 more significant bits: a later stall, and more additions
        (2.0**-7, torch.bfloat16),  # a power of two: every addition is exact until the ties, n = stall / v
        (3.0, torch.float16),  # a value above 1
    ]
    for value, dtype in cases:
        got = g.call(fn, value, dtype)
        if not g.compare(
            f"value={value!r}, dtype={DTYPE_NAMES[dtype]}", got, _measured_additions_to_stall(value, dtype)
        ):
            break
    return g.result()


def _format_cases():
    """(description, (exponent_bits, mantissa_bits, ieee), (max, min_normal, min_subnormal)) from measurements."""
    for name, dtype, e, m in [
        ("fp32", torch.float32, 8, 23),
        ("bf16", torch.bfloat16, 8, 7),
        ("fp16", torch.float16, 5, 10),
    ]:
        fi = torch.finfo(dtype)
        yield name, (e, m, True), (fi.max, fi.smallest_normal, fi.smallest_normal * fi.eps)
    for name, fmt in FORMATS.items():
        yield (
            name.upper(),
            (fmt.exponent_bits, fmt.mantissa_bits, not fmt.saturates),
            (fmt.max, fmt.min_normal, fmt.min_subnormal),
        )
    # TF32 (no torch dtype): fp32's exponent with fp16's mantissa; its range is fp32's, to 10 bits
    fi = torch.finfo(torch.float32)
    yield "TF32", (8, 10, True), (2.0**127 * (2 - 2.0**-10), fi.smallest_normal, fi.smallest_normal * 2.0**-10)


def check_float_format(fn) -> CheckResult:
    """Grade ``fn(exponent_bits, mantissa_bits, ieee)`` on six formats against ``torch.finfo`` and ``FORMATS``."""
    g = Grader("check_float_format")
    for name, args, expected in _format_cases():
        got = g.call(fn, *args)
        if not g.expect(
            f"{name} (exponent_bits={args[0]}, mantissa_bits={args[1]}, ieee={args[2]})",
            got is not None and isinstance(got, (tuple, list)) and len(got) == 3,
            f"return a tuple (max, min_normal, min_subnormal), got {got!r}",
        ):
            break
        description = f"{name} (exponent_bits={args[0]}, mantissa_bits={args[1]}, ieee={args[2]}): (max, min_normal, min_subnormal)"
        if not g.compare(description, tuple(float(x) for x in got), expected, rtol=1e-12):
            break
    return g.result()


def _measured_state_bytes(numel: int, block_size: int, min_8bit_size: int) -> int:
    """The bytes of a real AdamW8bit's state after one step on one parameter of ``numel`` elements."""
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.linspace(-1.0, 1.0, numel)
    opt = AdamW8bit([p], block_size=block_size, min_8bit_size=min_8bit_size)
    opt.step()
    return state_bytes(opt)


def check_adam8bit_state_bytes(fn) -> CheckResult:
    """Grade ``fn(numel, block_size, min_8bit_size)`` against the state tensors of a real ``AdamW8bit``."""
    g = Grader("check_adam8bit_state_bytes")
    for numel, block_size, min_8bit_size in [
        (100_000, 2048, 4096),  # 49 blocks, the last one partly padding
        (64, 2048, 4096),  # a LayerNorm weight: below min_8bit_size, fp32 moments
        (4096, 2048, 4096),  # exactly at the threshold: quantized
        (4095, 256, 4096),  # one below it: fp32
        (10_000, 256, 0),  # everything quantized, small blocks
        (1, 2048, 0),  # one element still needs a whole block's absmax
    ]:
        got = g.call(fn, numel, block_size, min_8bit_size)
        expected = _measured_state_bytes(numel, block_size, min_8bit_size)
        if not g.compare(f"numel={numel:,}, block_size={block_size}, min_8bit_size={min_8bit_size}", got, expected):
            break
    return g.result()
