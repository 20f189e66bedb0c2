"""Graders for lesson 20, compression.

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
check_soft_target_gradient(fn) fn(student_logits, teacher_logits, T) -> d L_soft / d student_logits, by the
                               derivation, not autograd: T^2 * (q - p) / T / B, with p, q the softmaxes at T
"""

from __future__ import annotations

import torch

from llmedu.checks.core import CheckResult, Grader
from llmedu.compress.distillation import soft_target_loss
from llmedu.compress.pruning import nm_mask

__all__ = [
    "check_nf4_bytes",
    "check_int8_size_ratio",
    "check_two_four_mask",
    "check_distillation_loss",
    "check_soft_target_gradient",
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


def check_soft_target_gradient(fn) -> CheckResult:
    """The gradient is compared with autograd's through ``soft_target_loss``; the learner must not use autograd."""
    g = Grader("check_soft_target_gradient")
    gen = torch.Generator().manual_seed(2)
    for B, C in [(1, 2), (4, 3), (8, 5)]:
        for T in (1.0, 2.0, 8.0):
            s, t = torch.randn(B, C, generator=gen) * 3, torch.randn(B, C, generator=gen) * 3
            leaf = s.clone().requires_grad_()
            (expected,) = torch.autograd.grad(soft_target_loss(leaf, t, T), leaf)
            with torch.no_grad():
                got = g.call(fn, s.clone(), t.clone(), T)
            # fp32 softmaxes of O(1) logits: a few ulps each, 1e-6 absolute is ample
            g.compare(f"logits ({B}, {C}), T={T}", got, expected, atol=1e-6, rtol=1e-5)
    return g.result()
