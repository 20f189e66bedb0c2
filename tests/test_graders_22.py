"""Lessons 22 and 23's graders: each passes a right answer, and fails a plausible wrong value AND a right
value computed the wrong way (a method the exercise rules out, or a shortcut that holds on some cases only)."""

import math

import torch

from llmedu.checks.compress import (
    check_cosine_gradient,
    check_high_temperature_limit,
    check_int8_size_ratio,
    check_nf4_bytes,
    check_packed_bytes,
    check_two_four_mask,
    high_temperature_limit,
)
from llmedu.compress.baselines import BagOfWords
from llmedu.compress.distillation import hidden_state_loss, soft_target_loss


# -- lesson 22 -------------------------------------------------------------------------------------------------
def test_nf4_bytes_fails_the_lessons_rate_used_as_a_formula():
    assert check_nf4_bytes(lambda n, block, dq: n / 2 + n / block * (1 + 4 / 256 if dq else 4))
    assert not check_nf4_bytes(lambda n, block, dq: n / 2 + n / block * 4)  # wrong: double quantization ignored
    # right at block 64 with double quantization to three digits, by reading off the lesson's 4.127 bits
    assert not check_nf4_bytes(lambda n, block, dq: n * (4.127 if dq else 4.5) / 8)


def test_int8_size_ratio_fails_the_large_layer_approximation():
    assert check_int8_size_ratio(
        lambda d_out, d_in, pc: (d_out * d_in + 4 * (d_out if pc else 1) + 4 * d_out) / (4 * d_out * d_in + 4 * d_out)
    )
    assert not check_int8_size_ratio(lambda d_out, d_in, pc: 0.25)  # wrong: the weights alone
    # right to three digits for 384 x 384 and larger, by the asymptote 1/4 + (scale + bias) / d_in
    assert not check_int8_size_ratio(lambda d_out, d_in, pc: 0.25 + (2 if pc else 1) / d_in)


def test_packed_bytes_fails_a_formula_that_holds_at_4_bits_only():
    def right(d_out, d_in, bits):
        return math.ceil(d_out * d_in * bits / 8) + 9 * d_out

    assert check_packed_bytes(right)
    assert not check_packed_bytes(lambda d_out, d_in, bits: d_out * d_in * bits // 8 + 9 * d_out)  # wrong: no padding
    # right at 4 bits, padding included, by assuming two codes a byte whatever the bits
    assert not check_packed_bytes(lambda d_out, d_in, bits: (d_out * d_in + 1) // 2 + 9 * d_out)


# -- lesson 23 ------------------------------------------------------------------------------------------------
def _two_four(w, by=torch.abs):
    out, inp = w.shape
    groups = by(w).reshape(out, inp // 4, 4)  # (out, in/4, 4)
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(2, -1).indices, True).reshape(out, inp)


def test_two_four_mask_fails_values_and_the_wrong_axis():
    assert check_two_four_mask(_two_four)
    assert not check_two_four_mask(lambda w: _two_four(w, by=lambda x: x))  # wrong: largest values, not magnitudes
    # right whenever the rows do not divide by 4 (then it falls back), but groups outputs where they do
    assert not check_two_four_mask(lambda w: _two_four(w.T.contiguous()).T if w.shape[0] % 4 == 0 else _two_four(w))


def _cosine(s, t):
    s_norm, t_norm = s.norm(dim=-1, keepdim=True), t.norm(dim=-1, keepdim=True)  # (B, T, 1)
    cos = (s * t).sum(-1, keepdim=True) / (s_norm * t_norm)
    return -(t / t_norm - cos * s / s_norm) / (s_norm * s.shape[0] * s.shape[1])


def test_cosine_gradient_fails_autograd_and_the_sum():
    assert check_cosine_gradient(_cosine)
    assert not check_cosine_gradient(lambda s, t: _cosine(s, t) * s.shape[0] * s.shape[1])  # wrong: summed

    def by_autograd(s, t):  # the right numbers, by the method the exercise rules out
        with torch.enable_grad():
            leaf = s.clone().requires_grad_()
            (grad,) = torch.autograd.grad(hidden_state_loss(leaf, t), leaf)
        return grad

    def by_backward(s, t):
        with torch.enable_grad():
            leaf = s.clone().requires_grad_()
            hidden_state_loss(leaf, t).backward()
        return leaf.grad

    assert not check_cosine_gradient(by_autograd)
    assert not check_cosine_gradient(by_backward)


def test_high_temperature_limit_is_the_large_T_loss():
    gen = torch.Generator().manual_seed(0)
    s, t = (torch.randn(6, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    limit = high_temperature_limit(s, t).item()
    gaps = [abs(soft_target_loss(s, t, T).item() / limit - 1) for T in (1e2, 1e3, 1e4)]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-4  # the loss converges on the reference as T grows


def test_high_temperature_limit_fails_uncentred_logits_and_a_large_T():
    assert check_high_temperature_limit(high_temperature_limit)

    def uncentred(s, t):  # wrong: forgets that a softmax ignores a shift of each row
        return (s - t).pow(2).sum(-1).mean() / (2 * s.shape[-1])

    def per_class_mean(s, t):  # wrong: 1/2 the mean over classes, i.e. 1/(2C) summed but no centring
        return 0.5 * (s - t).pow(2).mean(-1).mean()

    assert not check_high_temperature_limit(uncentred)
    assert not check_high_temperature_limit(per_class_mean)
    # the right number to 1e-10, by evaluating the loss at a huge temperature instead of deriving the limit
    assert not check_high_temperature_limit(lambda s, t: soft_target_loss(s, t, 1e6))


# -- the baseline both lessons print ---------------------------------------------------------------------------
def test_bag_of_words_tunes_its_penalty_on_training_data_only():
    good = ["good fun", "great fun film", "good film", "great great", "fun fun good", "good great film"] * 4
    bad = ["bad dull", "awful dull film", "bad film", "awful awful", "dull dull bad", "bad awful film"] * 4
    texts, labels = good + bad, [1] * len(good) + [0] * len(bad)
    bow = BagOfWords(min_count=1, steps=30)
    dev = bow.tune(texts, labels, l2s=(1.0, 1e-4), dev_fraction=0.25, seed=0)
    assert set(dev) == {1.0, 1e-4} and bow.l2 == max(dev, key=dev.get)
    assert (bow.predict(["good fun", "awful film"]) == torch.tensor([1, 0])).all()


def test_bag_of_words_tune_refuses_a_dev_fraction_outside_0_1():
    import pytest

    for bad in (0, 1, 1.5):
        with pytest.raises(ValueError, match="dev_fraction"):
            BagOfWords().tune(["a b"] * 4, [0, 1, 0, 1], dev_fraction=bad)


# -- the table both lessons print ------------------------------------------------------------------------------
def test_latency_verdict_needs_every_pair_outside_the_noise_of_fp32():
    from llmedu.compress.compare import Row
    from llmedu.compress.report import latency_verdict

    fp32 = Row("fp32", "32 bit", 100, 0.1, 0.1, 0.8, ratio=1.0, ratio_lo=0.9, ratio_hi=1.2)

    def row(lo, hi):
        return Row("x", "-", 50, 0.1, 0.1, 0.8, ratio=(lo + hi) / 2, ratio_lo=lo, ratio_hi=hi)

    assert latency_verdict(row(0.4, 0.8), fp32) == "faster"
    assert latency_verdict(row(1.3, 2.0), fp32) == "slower"
    assert latency_verdict(row(0.5, 0.95), fp32) == "not resolved"  # a median of 0.72, but one pair inside the noise
    assert latency_verdict(row(1.1, 1.5), fp32) == "not resolved"
    assert latency_verdict(fp32, fp32) == "(the noise)"


def test_print_rows_refuses_a_table_without_a_paired_reference():
    import pytest

    from llmedu.compress.compare import Row
    from llmedu.compress.report import print_rows

    with pytest.raises(ValueError, match="reference=base"):
        print_rows([Row("majority class", "-", 0, 0.0, 0.0, 0.5)], 10, {})
