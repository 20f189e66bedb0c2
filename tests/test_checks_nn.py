"""The graders of lessons 02-05 pass correct answers and fail the common wrong ones."""

import math

import torch
import torch.nn.functional as F

from llmedu.checks import nn as checks
from llmedu.nn.attention import causal_mask, kv_cache_bytes, math_attention
from llmedu.nn.positions import alibi_slopes, apply_rope, rope_cos_sin, sinusoidal_table


def _rope(x, positions, base):
    return apply_rope(x, *rope_cos_sin(positions, x.shape[-1], base))


def _rope_interleaved(x, positions, base):  # the paper's (2i, 2i+1) pairing: a different layout
    D = x.shape[-1]
    angles = positions.float()[:, None] * base ** (-torch.arange(0, D, 2).float() / D)  # (T, D/2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * angles.cos() - x2 * angles.sin()
    out[..., 1::2] = x1 * angles.sin() + x2 * angles.cos()
    return out


def test_correct_answers_pass(capsys):
    assert checks.check_sinusoidal(sinusoidal_table)
    assert checks.check_alibi_slopes(alibi_slopes)
    assert checks.check_rope(_rope)
    assert checks.check_layernorm(lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps))
    assert checks.check_rmsnorm(lambda x, w, eps: F.rms_norm(x, x.shape[-1:], w, eps))
    assert checks.check_swiglu(lambda x, wg, wu, wd: (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T)
    assert checks.check_causal_mask(causal_mask)
    assert checks.check_gqa_attention(
        lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c, enable_gqa=True)
    )
    assert checks.check_kv_cache_bytes(kv_cache_bytes)
    assert checks.check_flops_per_token(lambda n, L, T, d: 6 * n + 12 * L * T * d)
    assert capsys.readouterr().out.count("PASS") == 10


def test_wrong_answers_fail(capsys):
    assert not checks.check_rope(_rope_interleaved)
    assert not checks.check_rmsnorm(lambda x, w, eps: F.layer_norm(x, x.shape[-1:], w, None, eps))
    assert "that is LayerNorm" in capsys.readouterr().out
    assert not checks.check_causal_mask(lambda t_q, t_k: torch.ones(t_q, t_k).tril().bool())  # top-left aligned
    assert not checks.check_gqa_attention(lambda q, k, v, c: math_attention(q, k[:, :1], v[:, :1], c, None))
    assert not checks.check_kv_cache_bytes(lambda L, H, D, T, B, s: L * H * D * T * B * s)  # forgot the values
    assert not checks.check_alibi_slopes(lambda n: torch.tensor([2 ** (-8 * (i + 1) / n) for i in range(n)]))
    assert not checks.check_flops_per_token(lambda n, L, T, d: 6 * n)
    assert not checks.check_sinusoidal(lambda p, d: sinusoidal_table(p, d).flip(-1))
    assert not checks.check_swiglu(lambda x, wg, wu, wd: (F.gelu(x @ wg.T) * (x @ wu.T)) @ wd.T)
    assert not checks.check_layernorm(
        lambda x, w, b, eps: (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True) * w + b
    )


# -- the understanding exercises of lessons 02-04 ----------------------------------------------------
def _score_by_offset(q, k, offset, base):  # <R_p q, R_{p-offset} k> = <R_offset q, k>
    cos, sin = rope_cos_sin(torch.tensor([offset]), q.shape[-1], base)
    return (apply_rope(q[None, None, None], cos, sin)[0, 0, 0] * k).sum()


def test_lesson02_graders():
    assert checks.check_sinusoid_wavelength(lambda i, d, base: 2 * math.pi * base ** (2 * i / d))
    assert not checks.check_sinusoid_wavelength(lambda i, d, base: base ** (2 * i / d))  # 1/frequency
    assert checks.check_rope_relative(_score_by_offset)
    assert not checks.check_rope_relative(lambda q, k, o, b: _score_by_offset(q, k, -o, b))  # wrong direction
    assert not checks.check_rope_relative(lambda q, k, o, b: (q * k).sum())  # ignores position
    assert checks.check_rope_interpolation(lambda p, D, tr, tg: rope_cos_sin(p * (tr / tg), D))
    assert not checks.check_rope_interpolation(lambda p, D, tr, tg: rope_cos_sin(p * (tg / tr), D))
    assert not checks.check_rope_interpolation(lambda p, D, tr, tg: rope_cos_sin(p, D, 10000.0 * tg / tr))  # base


def test_lesson03_graders():
    assert checks.check_glu_width(lambda d_ff: round(2 * d_ff / 3))
    assert checks.check_glu_width(lambda d_ff: 2 * d_ff // 3)  # rounded down, as the lesson's glu_hidden_size
    assert not checks.check_glu_width(lambda d_ff: 2 * d_ff / 3)  # not an integer width
    assert not checks.check_glu_width(lambda d_ff: d_ff)  # three matrices of the old width: 1.5x the parameters
    assert not checks.check_glu_width(lambda d_ff: d_ff // 2)
    assert checks.check_rmsnorm_as_layernorm(lambda x: x - x.mean(-1, keepdim=True))
    assert not checks.check_rmsnorm_as_layernorm(lambda x: x)
    assert not checks.check_rmsnorm_as_layernorm(lambda x: x / x.std(-1, keepdim=True))
    assert checks.check_depth_gradient_ratio(lambda p, a, b: math.sqrt(b / a) if p == "pre" else 1.0)
    assert not checks.check_depth_gradient_ratio(lambda p, a, b: b / a if p == "pre" else 1.0)  # 1/L, not 1/sqrt(L)
    assert not checks.check_depth_gradient_ratio(lambda p, a, b: math.sqrt(b / a))  # post-LN too


def _mean_pool(w, H, H_kv):
    return w.view(H_kv, H // H_kv, -1, w.shape[-1]).mean(1).flatten(0, 1)


def test_lesson04_graders():
    assert checks.check_gqa_from_mha(_mean_pool)
    assert not checks.check_gqa_from_mha(lambda w, H, Hk: w.view(Hk, H // Hk, -1, w.shape[-1])[:, 0].flatten(0, 1))
    # strided groups (heads j, j + H_kv, ...) are not the groups repeat_kv serves
    assert not checks.check_gqa_from_mha(lambda w, H, Hk: w.view(H // Hk, Hk, -1, w.shape[-1]).mean(0).flatten(0, 1))
    assert checks.check_decode_speedup(lambda W, C, H, Hk: (W + C) / (W + C * Hk / H))
    assert not checks.check_decode_speedup(lambda W, C, H, Hk: H / Hk)  # the cache ratio: ignores the weights
    assert not checks.check_decode_speedup(lambda W, C, H, Hk: C / (C * Hk / H) if C > W else 1.0)


def _layernorm(x, w, b, eps):  # each token on its own, the biased variance
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * w + b


def test_lesson03_fixed_layernorm_grader(capsys):
    assert checks.check_fixed_layernorm(_layernorm)
    # the library's own norm gives the right values but is not the exercise's method: refused
    assert not checks.check_fixed_layernorm(lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps))
    capsys.readouterr()

    def buggy(x, w, b, eps):  # the lesson's: statistics over the whole sequence, unbiased variance
        mean, var = x.mean(dim=(1, 2), keepdim=True), x.var(dim=(1, 2), keepdim=True)
        return (x - mean) / torch.sqrt(var + eps) * w + b

    assert not checks.check_fixed_layernorm(buggy)
    assert "your statistics mix tokens" in capsys.readouterr().out
    # the axis fixed, but torch.var's default divides by d - 1
    unbiased = lambda x, w, b, eps: (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + eps) * w + b
    assert not checks.check_fixed_layernorm(unbiased)
    assert "divide the variance by d - 1" in capsys.readouterr().out
    # statistics over the batch (BatchNorm's axis): no future leak, but sequences mix
    over_batch = lambda x, w, b, eps: F.batch_norm(x.flatten(0, 1), None, None, w, b, True, 0.0, eps).view_as(x)
    assert not checks.check_fixed_layernorm(over_batch)
    assert not checks.check_fixed_layernorm(lambda x, w, b, eps: _layernorm(x, w, b, eps) - b)  # forgot the bias


def _llama_flops(V, d, L, H, H_kv, d_ff, T, kv_heads=None, ffn_matrices=3):
    kv = (H_kv if kv_heads is None else kv_heads) * (d // H)
    n = L * (2 * d * d + 2 * d * kv + ffn_matrices * d * d_ff) + d * V  # matmuls only: no embedding table
    return 6 * n + 12 * L * T * d


def test_lesson05_llama_flops_grader(capsys):
    from llmedu.models import CausalLM, TransformerConfig
    from llmedu.models.counting import flops_per_token, matmul_parameters

    # the grader's reference is the library's count of models built on the meta device
    for V, d, L, H, H_kv, d_ff, T in ((384, 96, 2, 6, 2, 256, 16), (1000, 64, 3, 4, 1, 172, 128)):
        config = TransformerConfig.llama(
            vocab_size=V, d_model=d, n_layers=L, n_heads=H, n_kv_heads=H_kv, d_ff=d_ff, max_seq_len=T
        )
        with torch.device("meta"):
            n = matmul_parameters(CausalLM(config))
        assert checks.llama_matmul_parameters(V, d, L, H, H_kv, d_ff) == n
        assert flops_per_token(config, n, T) == _llama_flops(V, d, L, H, H_kv, d_ff, T)

    assert checks.check_llama_flops(_llama_flops)
    capsys.readouterr()
    assert not checks.check_llama_flops(lambda V, d, L, H, Hk, dff, T: _llama_flops(V, d, L, H, Hk, dff, T) + 6 * V * d)
    assert "embedding table" in capsys.readouterr().out
    # GQA's shared keys and values taken out of the attention core's FLOPs too
    assert not checks.check_llama_flops(
        lambda V, d, L, H, Hk, dff, T: _llama_flops(V, d, L, H, Hk, dff, T) - 12 * L * T * d * (1 - Hk / H)
    )
    assert "every query head still computes" in capsys.readouterr().out
    assert not checks.check_llama_flops(lambda V, d, L, H, Hk, dff, T: _llama_flops(V, d, L, H, Hk, dff, T, kv_heads=H))
    assert not checks.check_llama_flops(lambda *a: _llama_flops(*a, ffn_matrices=2))  # GPT-2's two FFN matrices
    assert not checks.check_llama_flops(  # Kaplan et al.'s attention term, 6LTd
        lambda V, d, L, H, Hk, dff, T: _llama_flops(V, d, L, H, Hk, dff, T) - 6 * L * T * d
    )
