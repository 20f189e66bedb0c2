"""Graders for lessons 07 and 08: accumulation, number formats, fp8 casts, AdamW, 8-bit state.

Lesson 07's loss-scaling grader, ``check_skipped_steps``, is in ``llmedu.checks.loss_scaling``.

check_stall_point(fn)           fn(value, dtype) -> where a running sum of dtype(value), kept in
                                dtype, stops growing (bf16, fp16, fp32; ties included)
check_additions_to_stall(fn)    fn(value, dtype) -> how many additions of dtype(value) change a running
                                sum kept in dtype before it stalls (bf16, fp16): not stall / value
check_float_format(fn)          fn(exponent_bits, mantissa_bits, ieee) -> (max, min_normal, min_subnormal)
                                of a binary float format: fp32, TF32, bf16, fp16, fp8 E5M2 and E4M3, and
                                two formats no table holds (E6M9, E3M4), decoded bit pattern by bit pattern
check_adam8bit_state_bytes(fn)  fn(numel, block_size, min_8bit_size) -> bytes of ``AdamW8bit``'s state
                                for one parameter tensor after its first step, as ``state_bytes`` counts
                                them, counted in Python (no torch call, no quantize_blockwise)
check_fp8_underflow(fn)         fn(std, fmt, scale) -> the share of N(0, std^2) values that fp8(x * scale)
                                sends to 0 (the step-0 underflow of delayed scaling)
check_adamw_fix(fn)             ``check_adamw_step`` for the find-the-bug exercise, refusing library steps

For the first case of an exercise (its own question) a wrong answer hears only "too high" or "too low".

The references are the library's (``stall_point``) or measured (a real running sum, ``torch.finfo``,
``FORMATS``, every bit pattern of a made-up format decoded, the state tensors of a real ``AdamW8bit``, ``cast_to_fp8`` on
normal quantiles), never a second copy of the formula being tested. The graders also enforce the
method: an answer that counts by running the thing it should predict (a running sum in the dtype, a
real ``AdamW8bit``, ``torch.finfo``, a sampled and cast tensor, a library AdamW step)
fails with a message that says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from llmedu.checks.adamw_fix import check_adamw_fix
from llmedu.checks.core import CheckResult, Grader, profiled
from llmedu.optim.eight_bit import AdamW8bit, state_bytes
from llmedu.train.accumulation import stall_point
from llmedu.train.fp8 import FORMATS, cast_to_fp8

__all__ = ["check_stall_point", "check_additions_to_stall", "check_float_format", "check_adam8bit_state_bytes"]
__all__ += ["check_fp8_underflow", "check_adamw_fix"]


class MethodError(RuntimeError):
    """The answer used the tool the exercise asks you to predict or replace."""


class _RecordOps(TorchFunctionMode):
    """Records the name of every torch function and tensor method called inside ``with``."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _recorded(fn, ops: list[str]):
    """``fn`` with the torch ops of each call appended to ``ops``."""

    def call(*args):
        recorder = _RecordOps()
        with recorder:
            out = fn(*args)
        ops.extend(recorder.names)
        return out

    return call


@contextlib.contextmanager
def _refusing(reason: str, *attributes: tuple[object, str]) -> Iterator[None]:
    """Replace each ``getattr(owner, name)`` by a function that raises ``MethodError(reason)``."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name in attributes]

    def refuse(*args, **kwargs):
        raise MethodError(reason)

    try:
        for owner, name, _ in saved:
            setattr(owner, name, refuse)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _compare_headline(g: Grader, description: str, got, expected: float, rtol=0.0, atol=0.0) -> bool:
    """``g.compare`` for the exercise's own case, without printing the expected value: only higher or lower."""
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        return g.expect(description, False, f"return a number, got {type(got).__name__}")
    ok = abs(got - expected) <= atol + rtol * abs(expected)
    return g.expect(description, ok, f"got {got!r}, which is too {'high' if got > expected else 'low'}")


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


MAX_TORCH_OPS_PER_CALL = 4  # torch.tensor(value, dtype).item() is 2; a loop through torch is hundreds


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
    ops: list[str] = []
    for value, dtype in cases:
        expected = _measured_additions_to_stall(value, dtype)
        before = len(ops)
        got = g.call(_recorded(fn, ops), value, dtype)
        summed = sorted({op for op in ops if "add" in op or "sum" in op})
        if summed:  # a method check is a case only when it fails: "case n" then numbers the values asked
            g.expect(
                f"value={value!r}, dtype={DTYPE_NAMES[dtype]}: the method",
                False,
                f"your function adds tensors ({', '.join(summed)}): that runs the sum instead of predicting it. "
                "Reason with the grid in Python floats: torch only to round the value, torch.tensor(value, dtype).item()",
            )
            break
        calls = len(ops) - before  # rounding each partial sum through torch is the running sum again
        if calls > MAX_TORCH_OPS_PER_CALL:
            g.expect(
                f"value={value!r}, dtype={DTYPE_NAMES[dtype]}: the method",
                False,
                f"your function made {calls} torch calls for one answer: rounding every partial sum with torch "
                f"(torch.tensor(s + v, dtype)) runs the sum in the dtype. Round the value once (at most "
                f"{MAX_TORCH_OPS_PER_CALL} torch calls) and do the grid arithmetic in Python floats",
            )
            break
        compare = _compare_headline if (value, dtype) == cases[0] else Grader.compare
        if not compare(g, f"value={value!r}, dtype={DTYPE_NAMES[dtype]}", got, expected):
            break
    return g.result()


UNLISTED_FORMATS = {"E6M9": (6, 9, True), "E3M4": (3, 4, False)}  # made up: no dtype, no datasheet


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
    for name, (e, m, ieee) in UNLISTED_FORMATS.items():  # in no table: only a derivation from the bits answers
        yield name, (e, m, ieee), _decoded_range(e, m, ieee)


def _decoded_range(exponent_bits: int, mantissa_bits: int, ieee: bool) -> tuple[float, float, float]:
    """(max, min_normal, min_subnormal) of a small format, by decoding every positive bit pattern.

    Exponent field E, mantissa field M: E = 0 is subnormal, 2^(1-bias) * M/2^m; otherwise 2^(E-bias) * (1 + M/2^m).
    The all-ones exponent is inf/NaN (ieee) or, without ieee, finite except for its all-ones mantissa (NaN).
    """
    bias, top, m_max = 2 ** (exponent_bits - 1) - 1, 2**exponent_bits - 1, 2**mantissa_bits - 1
    finite, normal = [], []
    for field_e in range(top + 1):
        for field_m in range(m_max + 1):
            if field_e == top and (ieee or field_m == m_max):
                continue  # inf or NaN
            if field_e == 0:
                finite.append(2.0 ** (1 - bias) * field_m / 2**mantissa_bits)
            else:
                normal.append(2.0 ** (field_e - bias) * (1 + field_m / 2**mantissa_bits))
    return max(normal), min(normal), min(v for v in finite if v > 0)


def check_float_format(fn) -> CheckResult:
    """Grade ``fn(exponent_bits, mantissa_bits, ieee)`` on six known formats and two that no table holds."""
    g = Grader("check_float_format")
    cases = list(_format_cases())
    saved_formats = dict(FORMATS)
    reason = "derive the three numbers from the bits; torch.finfo and FORMATS are the answer key"
    for name, args, expected in cases:
        with _refusing(reason, (torch, "finfo")):
            FORMATS.clear()  # a lookup in the table of formats finds nothing while the answer runs
            try:
                got = g.call(fn, *args)
            finally:
                FORMATS.update(saved_formats)
        if g.failure is not None:  # it raised: perhaps it looked a format up
            if "NotImplementedError" not in g.failure:
                g.failure = f"{name} (exponent_bits={args[0]}, mantissa_bits={args[1]}, ieee={args[2]}): {g.failure}"
                hint = (
                    f"{name} is in no table" if name in UNLISTED_FORMATS else "torch.finfo and FORMATS are switched off"
                )
                g.failure += f" ({hint}: {reason})"
            break
        if not (isinstance(got, (tuple, list)) and len(got) == 3):  # counted only when it fails: case n is format n
            g.expect(
                f"{name} (exponent_bits={args[0]}, mantissa_bits={args[1]}, ieee={args[2]})",
                False,
                f"return a tuple (max, min_normal, min_subnormal), got {got!r}",
            )
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
        expected = _measured_state_bytes(numel, block_size, min_8bit_size)
        ops: list[str] = []
        with _refusing("count the bytes from the sizes; building an AdamW8bit measures them", (AdamW8bit, "__init__")):
            got = g.call(_recorded(fn, ops), numel, block_size, min_8bit_size)
        if not g.expect(
            f"numel={numel:,}, block_size={block_size}, min_8bit_size={min_8bit_size}: the method",
            not ops,
            f"your function calls torch ({', '.join(sorted(set(ops)))}): quantizing a tensor (quantize_blockwise) "
            "and measuring what comes back is the grader's job; count the bytes from the sizes in Python",
        ):
            break
        if not g.compare(f"numel={numel:,}, block_size={block_size}, min_8bit_size={min_8bit_size}", got, expected):
            break
    return g.result()


# -- fp8: the underflow of a cast at a given scale ---------------------------------------------------
def _measured_underflow(std: float, fmt: str, scale: float, n: int = 1_000_000) -> float:
    """Cast n evenly spaced quantiles of N(0, std^2), times ``scale``, to fp8: the share that becomes 0."""
    q = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    x = std * torch.special.ndtri(q)  # (n,) the normal distribution, without sampling noise
    return float((cast_to_fp8((x * scale).float(), fmt) == 0).double().mean())


def _numpy_recorded(fn, ops: list[str]):
    """``fn`` with every numpy function it enters appended to ``ops``: Python ones (np.round, np.mean) and C ones
    (np.random's samplers); a bare ufunc (np.exp) makes no call event and passes unseen."""

    def watch(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__", "").startswith("numpy"):
            ops.append("numpy." + frame.f_code.co_name)
        elif event == "c_call":
            owner = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__module__
            if (owner or "").startswith("numpy"):
                ops.append("numpy." + getattr(arg, "__name__", "?"))

    return profiled(fn, watch)


def check_fp8_underflow(fn) -> CheckResult:
    """Grade ``fn(std, fmt, scale)`` against casts of normal quantiles with ``cast_to_fp8`` (to 1e-5)."""
    g = Grader("check_fp8_underflow")
    ops: list[str] = []
    cases = [
        (0.02, "e4m3", 1.0),  # a weight matrix at GPT-2's initialisation, step 0 (no history: scale 1)
        (0.02, "e4m3", 448 / 0.08),  # the same once delayed scaling has seen an amax of 4 std
        (1e-5, "e5m2", 1.0),  # small gradients at scale 1
        (1e-5, "e5m2", 2.0**10),
        (1.0, "e4m3", 1.0),  # activations of unit size
        (3e-6, "e5m2", 1.0),
    ]
    for std, fmt, scale in cases:
        expected = _measured_underflow(std, fmt, scale)
        got = g.call(_numpy_recorded(_recorded(fn, ops), ops), std, fmt, scale)
        if not g.expect(
            f"std={std:g}, fmt={fmt!r}, scale={scale:g}: the method",
            not ops,
            f"your function calls torch or numpy ({', '.join(sorted(set(ops)))}): predict the share with a formula "
            "(math.erf), without sampling or casting a tensor",
        ):
            break
        compare = _compare_headline if (std, fmt, scale) == cases[0] else Grader.compare
        if not compare(g, f"std={std:g}, fmt={fmt!r}, scale={scale:g}", got, expected, rtol=1e-3, atol=1e-5):
            break
    return g.result()
