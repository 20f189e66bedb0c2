"""The lesson-20 graders pass a correct answer and fail the mistakes a learner is likely to make."""

import torch
from torch.nn import functional as F

from llmedu.checks.compress import (
    check_cosine_gradient,
    check_distillation_loss,
    check_int8_size_ratio,
    check_nf4_bytes,
    check_packed_bytes,
    check_two_four_mask,
)


def test_nf4_bytes_grader():
    def right(n, block, dq):
        return n / 2 + (n / block) * (1 + 4 / 256 if dq else 4)

    assert check_nf4_bytes(right)
    assert not check_nf4_bytes(lambda n, block, dq: n / 2)  # forgets the scales
    assert not check_nf4_bytes(lambda n, block, dq: n / 2 + (n / block) * 4)  # ignores double quantization
    assert not check_nf4_bytes(lambda n, block, dq: n * 4 / 8 * (1 + 1 / block))  # scales of 1 byte always


def test_int8_size_ratio_grader():
    def right(d_out, d_in, per_channel):
        return (d_out * d_in + 4 * (d_out if per_channel else 1) + 4 * d_out) / (4 * d_out * d_in + 4 * d_out)

    assert check_int8_size_ratio(right)
    assert not check_int8_size_ratio(lambda d_out, d_in, per_channel: 0.25)  # the weights alone
    assert not check_int8_size_ratio(  # forgets the per-channel scales
        lambda d_out, d_in, per_channel: (d_out * d_in + 4 + 4 * d_out) / (4 * d_out * d_in + 4 * d_out)
    )


def mask_right(w):
    out, inp = w.shape
    groups = w.abs().reshape(out, inp // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(2, dim=-1).indices, True)
    return keep.reshape(out, inp)


def mask_by_value(w):  # the planted bug: largest values, not magnitudes
    out, inp = w.shape
    groups = w.reshape(out, inp // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(2, dim=-1).indices, True)
    return keep.reshape(out, inp)


def mask_wrong_axis(w):  # groups of 4 consecutive outputs (down a column) instead of inputs
    return mask_right(w.T.contiguous()).T if w.shape[0] % 4 == 0 else mask_right(w)


def test_two_four_mask_grader():
    assert check_two_four_mask(mask_right)
    assert check_two_four_mask(lambda w: mask_right(w).float())  # a 0/1 mask is accepted
    assert not check_two_four_mask(mask_by_value)
    assert not check_two_four_mask(mask_wrong_axis)
    assert not check_two_four_mask(lambda w: w.abs() > w.abs().median())  # half of all, not 2 of each 4


def test_distillation_loss_grader():
    def right(s, t, T):
        return T**2 * F.kl_div(F.log_softmax(s / T, -1), F.softmax(t / T, -1), reduction="batchmean")

    assert check_distillation_loss(right)
    assert not check_distillation_loss(lambda s, t, T: right(s, t, T) / T**2)  # no T^2
    assert not check_distillation_loss(lambda s, t, T: right(t, s, T))  # KL the wrong way round
    assert not check_distillation_loss(  # summed over the batch, not averaged
        lambda s, t, T: T**2 * F.kl_div(F.log_softmax(s / T, -1), F.softmax(t / T, -1), reduction="sum")
    )


def cosine_right(s, t):
    s_norm, t_norm = s.norm(dim=-1, keepdim=True), t.norm(dim=-1, keepdim=True)  # (B, T, 1)
    cos = (s * t).sum(-1, keepdim=True) / (s_norm * t_norm)
    n_tokens = s.shape[0] * s.shape[1]
    return -(t / t_norm - cos * s / s_norm) / (s_norm * n_tokens)  # the part of t-hat across s, over |s|


def test_cosine_gradient_grader():
    assert check_cosine_gradient(cosine_right)
    assert check_cosine_gradient(lambda s, t: cosine_right(s.double(), t.double()).float())  # another precision

    def no_projection(s, t):  # d(s . t-hat)/ds without the derivative of 1/|s|
        return -t / t.norm(dim=-1, keepdim=True) / (s.norm(dim=-1, keepdim=True) * s.shape[0] * s.shape[1])

    def unit_student(s, t):  # takes |s| = 1: the direction right, the size wrong
        return cosine_right(s, t) * s.norm(dim=-1, keepdim=True)

    def unit_difference(s, t):  # s-hat - t-hat: points the right way only when s and t are already close
        s_hat, t_hat = s / s.norm(dim=-1, keepdim=True), t / t.norm(dim=-1, keepdim=True)
        return (s_hat - t_hat) / (s.norm(dim=-1, keepdim=True) * s.shape[0] * s.shape[1])

    assert not check_cosine_gradient(no_projection)
    assert not check_cosine_gradient(unit_student)
    assert not check_cosine_gradient(unit_difference)
    assert not check_cosine_gradient(lambda s, t: -cosine_right(s, t))  # the gradient of cos, not of 1 - cos
    assert not check_cosine_gradient(lambda s, t: cosine_right(s, t) * s.shape[0] * s.shape[1])  # summed
    assert not check_cosine_gradient(lambda s, t: cosine_right(s, t) * s.shape[1])  # averaged over B only


def test_packed_bytes_grader():
    import math

    from torch import nn

    from llmedu.compress.gptq import PackedLinear

    def right(d_out, d_in, bits):
        return math.ceil(d_out * d_in * bits / 8) + 4 * d_out + d_out + 4 * d_out

    assert check_packed_bytes(right)
    for d_out, d_in, bits in [(3, 5, 4), (5, 7, 2), (16, 8, 8)]:  # the reference is what the layer really stores
        layer = PackedLinear.rtn(nn.Linear(d_in, d_out), bits)
        assert sum(t.numel() * t.element_size() for t in layer.buffers()) == right(d_out, d_in, bits)
    assert not check_packed_bytes(lambda d_out, d_in, bits: d_out * d_in * bits / 8 + 9 * d_out)  # no padding
    assert not check_packed_bytes(lambda d_out, d_in, bits: right(d_out, d_in, bits) + 3 * d_out)  # fp32 zeros
    assert not check_packed_bytes(lambda d_out, d_in, bits: right(d_out, d_in, bits) - 4 * d_out)  # no bias
    assert not check_packed_bytes(lambda d_out, d_in, bits: right(d_out, d_in, 4))  # always two codes a byte
