"""Graders for lesson 22, compression.

check_nf4_bytes(fn)            fn(n_params, block, double_quant) -> bytes of a 4-bit block-quantized tensor:
                               n/2 bytes of codes + one fp32 scale per block, or with double quantization
                               (Dettmers et al. 2023, QLoRA sec. 3) one 8-bit scale per block plus one fp32
                               scale per 256 first-level scales
check_int8_size_ratio(fn)      fn(d_out, d_in, per_channel) -> bytes of an int8 linear layer (int8 weights,
                               fp32 scale(s), fp32 bias) divided by the bytes of the fp32 layer
check_two_four_mask(fn)        fn(weight (out, in)) -> bool keep-mask: in each group of 4 consecutive inputs,
                               the 2 of largest magnitude (``llmedu.compress.pruning.nm_mask``)
check_distillation_loss(fn)    fn(student_logits, teacher_logits, T) -> T^2 KL(softmax(t/T) || softmax(s/T)),
                               averaged over the batch (Hinton et al. 2015)
check_packed_bytes(fn)         fn(d_out, d_in, bits) -> bytes of a GPTQ/RTN layer as ``gptq.PackedLinear`` stores it:
                               the d_out * d_in codes packed 8 // bits to a byte (the last byte padded), one fp32
                               scale and one uint8 zero point per output row, the fp32 bias (Frantar et al. 2022)
check_cosine_gradient(fn)      fn(student_hidden, teacher_hidden) (B, T, d) -> d L_cos / d student_hidden, by the
                               derivation, not autograd, of DistilBERT's L_cos = mean over the B*T tokens of
                               1 - cos(s, t): -(t / |t| - cos(s, t) s / |s|) / (|s| B T), the part of t-hat
                               perpendicular to s, over |s| (Sanh et al. 2019, sec. 2)
check_high_temperature_limit(fn)
                               fn(student_logits, teacher_logits) (B, C) -> the limit of T^2 KL as T -> infinity,
                               (1 / 2C) sum_c ((s_c - mean s) - (t_c - mean t))^2, averaged over the batch: distillation
                               becomes matching centred logits (Hinton et al. 2015, sec. 2.1), computed from the
                               logits alone (no softmax, exp or log: the grader records the torch calls)
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from llmedu.checks.core import CheckResult, Grader
from llmedu.compress.distillation import hidden_state_loss, soft_target_loss
from llmedu.compress.pruning import nm_mask

__all__ = [
    "check_nf4_bytes",
    "check_int8_size_ratio",
    "check_two_four_mask",
    "check_distillation_loss",
    "check_cosine_gradient",
    "check_packed_bytes",
    "check_high_temperature_limit",
]

SECOND_LEVEL_BLOCK = 256  # first-level scales per fp32 second-level scale (QLoRA's choice)


def nf4_bytes(n_params: int, block: int, double_quant: bool) -> float:
    """The reference: 4 bits a weight, and the scales (see the module docstring)."""
    n_blocks = n_params / block
    if double_quant:
        return n_params / 2 + n_blocks * 1 + n_blocks / SECOND_LEVEL_BLOCK * 4
    return n_params / 2 + n_blocks * 4


def int8_size_ratio(d_out: int, d_in: int, per_channel: bool) -> float:
    scales = d_out if per_channel else 1
    return (d_out * d_in + 4 * scales + 4 * d_out) / (4 * d_out * d_in + 4 * d_out)


def packed_bytes(d_out: int, d_in: int, bits: int) -> int:
    """The reference: what ``PackedLinear``'s buffers hold (the tests check the two agree)."""
    per_byte = 8 // bits
    return -(-d_out * d_in // per_byte) + 4 * d_out + 1 * d_out + 4 * d_out


def check_nf4_bytes(fn) -> CheckResult:
    g = Grader("check_nf4_bytes")
    for n, block in [(64 * 256, 64), (384 * 1536, 64), (4096 * 4096, 64), (1 << 20, 128)]:
        for dq in (False, True):
            g.compare(
                f"n_params={n}, block={block}, double_quant={dq}",
                g.call(fn, n, block, dq),
                nf4_bytes(n, block, dq),
                rtol=1e-9,
            )
    return g.result()


def check_int8_size_ratio(fn) -> CheckResult:
    g = Grader("check_int8_size_ratio")
    for d_out, d_in in [(384, 384), (1536, 384), (2, 384), (4096, 11008)]:
        for per_channel in (False, True):
            g.compare(
                f"d_out={d_out}, d_in={d_in}, per_channel={per_channel}",
                g.call(fn, d_out, d_in, per_channel),
                int8_size_ratio(d_out, d_in, per_channel),
                rtol=1e-9,
            )
    return g.result()


def check_two_four_mask(fn) -> CheckResult:
    g = Grader("check_two_four_mask")
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 4), (3, 8), (8, 4), (16, 32)]:  # (8, 4): a mask along the wrong axis fails here
        w = torch.randn(shape, generator=gen)
        w[0, 0] = -5.0  # a large negative weight: keeping the largest *values* drops it
        got = g.call(fn, w.clone())
        if isinstance(got, torch.Tensor):
            got = got.bool()  # a 0/1 float mask is fine too
        g.compare(f"weight of shape {shape}", got, nm_mask(w, 2, 4))
    return g.result()


def check_distillation_loss(fn) -> CheckResult:
    g = Grader("check_distillation_loss")
    gen = torch.Generator().manual_seed(1)
    for B, C in [(1, 2), (4, 2), (8, 5)]:
        for T in (1.0, 2.0, 4.0):
            s, t = torch.randn(B, C, generator=gen) * 3, torch.randn(B, C, generator=gen) * 3
            got = g.call(fn, s.clone(), t.clone(), T)
            g.compare(f"logits ({B}, {C}), T={T}", got, soft_target_loss(s, t, T), atol=1e-5, rtol=1e-5)
    return g.result()


_SOFTMAX_LIKE = ("softmax", "log_softmax", "exp", "log", "logsumexp", "kl_div", "sigmoid", "expm1", "log1p")


class _Calls(TorchFunctionMode):
    """The names of the torch functions and tensor methods called inside the ``with`` block."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", str(func)).strip("_"))
        return func(*args, **(kwargs or {}))


def _cosine_cases(gen: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, student (B, T, d), teacher (B, T, d)) pairs on which the usual slips give other numbers."""
    cases = []
    for B, T, d in [(1, 1, 2), (2, 3, 4), (4, 5, 16)]:
        s, t = torch.randn(B, T, d, generator=gen), torch.randn(B, T, d, generator=gen)
        # token norms from 0.25 to 8: an answer that takes |s| = 1 (or |t| = 1) is wrong here
        s = s * torch.exp2(torch.randint(-2, 4, (B, T, 1), generator=gen).float())
        t = t * torch.exp2(torch.randint(-2, 4, (B, T, 1), generator=gen).float())
        cases.append((f"hidden states ({B}, {T}, {d})", s, t))
    s = torch.randn(2, 2, 8, generator=gen)
    t = s * torch.tensor([0.5, 3.0, 1.0, 2.0]).reshape(2, 2, 1)  # every t along its s: the loss is at its minimum
    cases.append(("teacher tokens parallel to the student's (gradient zero)", s, t))
    return cases


def check_cosine_gradient(fn) -> CheckResult:
    """The gradient is compared with autograd's through ``hidden_state_loss``; the learner must not use autograd."""
    g = Grader("check_cosine_gradient")
    for name, s, t in _cosine_cases(torch.Generator().manual_seed(2)):
        leaf = s.clone().requires_grad_()
        (expected,) = torch.autograd.grad(hidden_state_loss(leaf, t), leaf)
        calls = _Calls()
        with torch.no_grad(), calls:
            got = g.call(fn, s.clone(), t.clone())
        used = sorted(calls.names & {"backward", "grad", "requires_grad", "enable_grad", "set_grad_enabled"})
        g.expect(f"{name}: by the derivation", not used, f"your function used autograd ({used}): derive it by hand")
        # fp32 norms and dot products of O(1)-O(10) vectors: relative error a few ulps; 1e-6 absolute covers the
        # zero-gradient case, where autograd's answer is itself rounding noise of order 1e-8
        g.compare(name, got, expected, atol=1e-6, rtol=1e-4)
    return g.result()


def check_packed_bytes(fn) -> CheckResult:
    g = Grader("check_packed_bytes")
    # (3, 5) and (5, 7): an odd number of codes, so the last byte is half (or a quarter) empty but stored
    for d_out, d_in, bits in [(384, 384, 4), (1536, 384, 4), (384, 1536, 8), (3, 5, 4), (5, 7, 2), (4096, 4096, 4)]:
        g.compare(
            f"d_out={d_out}, d_in={d_in}, bits={bits}",
            g.call(fn, d_out, d_in, bits),
            packed_bytes(d_out, d_in, bits),
            rtol=0,
            atol=0,
        )
    return g.result()


def high_temperature_limit(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The reference: T^2 KL(softmax(t/T) || softmax(s/T)) as T -> infinity, for logits (B, C)."""
    s = student_logits - student_logits.mean(-1, keepdim=True)  # (B, C): a softmax ignores a shift of its row
    t = teacher_logits - teacher_logits.mean(-1, keepdim=True)
    return (s - t).pow(2).sum(-1).mean() / (2 * student_logits.shape[-1])


def check_high_temperature_limit(fn) -> CheckResult:
    """The value against the closed form, and no softmax, exp or log in the learner's code (a large T is not
    the limit: evaluating the loss at T = 1e6 gives a number close to it by another road)."""
    g = Grader("check_high_temperature_limit")
    gen = torch.Generator().manual_seed(3)
    cases = []
    for B, C in [(1, 2), (4, 2), (3, 5), (8, 10)]:
        cases.append((f"logits ({B}, {C})", torch.randn(B, C, generator=gen, dtype=torch.float64) * 2))
    shift = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    cases.append(("teacher rows shifted by a constant (a softmax does not see it)", shift))
    for name, s in cases:
        t = torch.randn(s.shape, generator=gen, dtype=torch.float64) * 2
        if "shifted" in name:
            t = s + 0.3 * torch.randn(s.shape, generator=gen, dtype=torch.float64) + torch.arange(4.0)[:, None] * 5
        calls = _Calls()
        with calls:
            got = g.call(fn, s.clone(), t.clone())
        used = sorted(calls.names & set(_SOFTMAX_LIKE))
        g.expect(
            f"{name}: computed from the logits alone",
            not used,
            f"your function called {used}: derive the limit; do not evaluate the loss at a large T",
        )
        g.compare(name, got, high_temperature_limit(s, t), rtol=1e-6, atol=1e-9)
    return g.result()
