"""Lesson 22's quantization graders: each fails a plausible wrong value and a right value computed the wrong way
(the library's own function, or a float product where int8 is asked for), and passes a right answer."""

import torch

from llmedu.checks.quantization import check_gptq_fix, check_llm_int8, check_smoothing_scales
from llmedu.compress.gptq import gptq_codes
from llmedu.compress.int8 import int8_matmul, quantize
from llmedu.compress.llm_int8 import llm_int8_matmul
from llmedu.compress.smoothquant import smoothing_scales


def failed(result, words):
    return not result and words in result.failure


# -- SmoothQuant's scales --------------------------------------------------------------------------------------
def smooth(hidden, mask, weights, alpha, act_axis=True, w_dim=0, readers=None, swap=False):
    act = hidden[mask.bool()].abs().amax(0) if act_axis else hidden.abs().amax((0, 1))  # (d,)
    w = torch.stack([w.abs().amax(w_dim) for w in weights[: readers or len(weights)]]).amax(0)  # (d,)
    return act ** (1 - alpha) / w**alpha if swap else act**alpha / w ** (1 - alpha)


def test_smoothing_scales_passes_the_masked_max_over_every_reader():
    assert check_smoothing_scales(smooth)


def test_smoothing_scales_fails_the_wrong_axis_the_padding_one_reader_and_swapped_exponents():
    assert failed(check_smoothing_scales(lambda *a: smooth(*a, w_dim=1)), "values differ")  # a square W: by value
    assert not check_smoothing_scales(lambda *a: smooth(*a, act_axis=False))  # padded positions counted
    assert not check_smoothing_scales(lambda *a: smooth(*a, readers=1))  # only the query's weight
    assert not check_smoothing_scales(lambda *a: smooth(*a, swap=True))  # alpha on the weights' side


def test_smoothing_scales_fails_the_librarys_function_with_the_right_value():
    def library(hidden, mask, weights, alpha):
        return smoothing_scales(hidden[mask.bool()].abs().amax(0), weights, alpha)  # the right value

    assert failed(check_smoothing_scales(library), "smoothing_scales")


# -- GPTQ, the lesson's loop with H^-1 updated by Gaussian elimination ----------------------------------------
def gptq_loop(weight, x, bits, eliminate=True, divide=True):
    W = weight.double().clone()  # (d_out, d_in)
    _, scale, zero = quantize(weight.float(), bits, symmetric=False, axis=0)  # (d_out, 1): RTN's grid
    scale, zero = scale.double()[:, 0], zero.double()[:, 0]
    x2 = x.reshape(-1, x.shape[-1]).double()
    H = 2 * x2.T @ x2 / x2.shape[0]  # (d_in, d_in)
    H += 0.01 * torch.diag(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    for i in range(W.shape[1]):
        Q[:, i] = (torch.round(W[:, i] / scale) + zero).clamp(0, 2**bits - 1)
        err = (W[:, i] - scale * (Q[:, i] - zero)) / (Hinv[i, i] if divide else 1)
        W[:, i + 1 :] -= err[:, None] * Hinv[i, i + 1 :]
        if eliminate:  # the fix: H^-1 of the columns not yet quantized
            Hinv = Hinv - Hinv[:, i : i + 1] @ Hinv[i : i + 1, :] / Hinv[i, i]
    return Q


def test_gptq_fix_passes_the_fixed_loop_and_fails_the_given_bug():
    assert check_gptq_fix(gptq_loop)
    assert failed(check_gptq_fix(lambda w, x, b: gptq_loop(w, x, b, eliminate=False)), "the codes")
    assert not check_gptq_fix(lambda w, x, b: gptq_loop(w, x, b, divide=False))


def test_gptq_fix_fails_round_to_nearest_and_the_librarys_gptq():
    def rtn(weight, x, bits):
        _, scale, zero = quantize(weight.float(), bits, symmetric=False, axis=0)
        return (torch.round(weight.double() / scale.double()) + zero.double()).clamp(0, 2**bits - 1)

    assert failed(check_gptq_fix(rtn), "the codes")
    assert failed(check_gptq_fix(lambda w, x, b: gptq_codes(w, x, b)[0]), "gptq_codes")


# -- LLM.int8 ----------------------------------------------------------------------------------------------------
def llm_int8(x, weight, threshold, float_codes=False, per_tensor=False, strict=False):
    cols = (x.abs() > threshold if strict else x.abs() >= threshold).any(0)  # (d_in,)
    y = x[:, cols] @ weight[:, cols].T  # (N, d_out) the outliers, in float
    axis = None if per_tensor else 0
    qx, sx, _ = quantize(x[:, ~cols], 8, symmetric=True, axis=axis)  # per token
    qw, sw, _ = quantize(weight[:, ~cols], 8, symmetric=True, axis=axis)  # per output row
    product = qx.float() @ qw.float().T if float_codes else int8_matmul(qx, qw.T).float()
    return y + product * (sx * sw.reshape(1, -1) if not per_tensor else sx * sw)


def test_llm_int8_passes_the_decomposition_with_an_int8_product():
    assert check_llm_int8(llm_int8)


def test_llm_int8_fails_a_float_product_of_the_codes_although_its_value_is_right():
    assert failed(check_llm_int8(lambda *a: llm_int8(*a, float_codes=True)), "floating-point mm")

    def broadcast(x, weight, threshold):  # the same float product, summed by hand
        cols = (x.abs() >= threshold).any(0)
        qx, sx, _ = quantize(x[:, ~cols], 8, symmetric=True, axis=0)
        qw, sw, _ = quantize(weight[:, ~cols], 8, symmetric=True, axis=0)
        rest = (qx.float()[:, None, :] * qw.float()[None]).sum(-1) * (sx * sw.T)
        return x[:, cols] @ weight[:, cols].T + rest

    assert failed(check_llm_int8(broadcast), "no broadcast product")


def test_llm_int8_fails_plausible_slips_and_the_librarys_function():
    assert failed(check_llm_int8(lambda x, w, t: x @ w.T), "floating-point mm")  # all in float
    assert failed(check_llm_int8(lambda *a: llm_int8(*a, per_tensor=True)), "relative difference")
    assert not check_llm_int8(lambda *a: llm_int8(*a, strict=True))  # |x| == threshold left out
    assert failed(check_llm_int8(lambda x, w, t: llm_int8_matmul(x, w, t)[0]), "llm_int8_matmul")


def test_llm_int8_passes_bitsandbytes_zeroed_columns_over_all_of_d_in():
    def zeroed(x, weight, threshold):  # bitsandbytes: the outlier columns zeroed, one int8 product over all d_in
        cols = (x.abs() >= threshold).any(0)  # (d_in,)
        qx, sx, _ = quantize(x.masked_fill(cols, 0.0), 8, symmetric=True, axis=0)  # (N, d_in), 0 at O
        qw, sw, _ = quantize(weight.masked_fill(cols, 0.0), 8, symmetric=True, axis=0)  # (d_out, d_in)
        return x[:, cols] @ weight[:, cols].T + int8_matmul(qx, qw.T).float() * (sx * sw.T)

    assert check_llm_int8(zeroed)


def test_llm_int8_fails_a_thrown_away_int8_product_beside_float_outer_products():
    def bypass(x, weight, threshold):  # the codes multiplied in float, one column at a time; the int8 call discarded
        cols = (x.abs() >= threshold).any(0)  # (d_in,)
        qx, sx, _ = quantize(x[:, ~cols], 8, symmetric=True, axis=0)
        qw, sw, _ = quantize(weight[:, ~cols], 8, symmetric=True, axis=0)
        int8_matmul(qx, qw.T)  # runs, and nothing reads it
        rest = sum(qx[:, j : j + 1].float() @ qw[:, j : j + 1].float().T for j in range(qx.shape[1]))
        return x[:, cols] @ weight[:, cols].T + rest * (sx * sw.T)

    assert failed(check_llm_int8(bypass), "feeds the output")
