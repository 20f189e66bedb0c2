"""The lesson-20 graders pass a correct answer and fail the mistakes a learner is likely to make."""

import torch
from torch.nn import functional as F

from llmedu.checks.compress import (
    check_distillation_loss,
    check_int8_size_ratio,
    check_nf4_bytes,
    check_soft_target_gradient,
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


def test_soft_target_gradient_grader():
    def right(s, t, T):
        p, q = F.softmax(t / T, -1), F.softmax(s / T, -1)
        return T * (q - p) / s.shape[0]  # T^2 x (q - p) / T, averaged over the batch

    assert check_soft_target_gradient(right)
    assert not check_soft_target_gradient(lambda s, t, T: right(s, t, T) / T**2)  # the loss without its T^2
    assert not check_soft_target_gradient(lambda s, t, T: right(s, t, T) * T)  # forgets the 1/T of the chain rule
    assert not check_soft_target_gradient(lambda s, t, T: -right(s, t, T))  # p - q: the sign of a gradient ascent
    assert not check_soft_target_gradient(lambda s, t, T: right(s, t, T) * s.shape[0])  # summed, not averaged
