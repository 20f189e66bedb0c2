"""Position encodings against hand-computed values and the implementations in ``transformers``.

Tolerances: 1e-6 where both sides do the same float32 arithmetic in a different order; exact
equality for integer buckets.
"""

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.t5.modeling_t5 import T5Attention

from llmedu.nn.positions import (
    ALiBi,
    LearnedPositions,
    RelativePositionBias,
    ScaledSinusoidalPositions,
    SinusoidalPositions,
    alibi_slopes,
    apply_rope,
    relative_position_bucket,
    rope_cos_sin,
    sinusoidal_table,
)


def test_sinusoidal_by_hand():
    table = sinusoidal_table(torch.arange(3), d_model=4)
    # p = 1: channel pairs use frequencies 10000^0 = 1 and 10000^(-2/4) = 1/100
    expected_p1 = torch.tensor([math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)])
    torch.testing.assert_close(table[0], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    torch.testing.assert_close(table[1], expected_p1, atol=1e-6, rtol=0)
    torch.testing.assert_close(SinusoidalPositions(4)(torch.arange(3)), table)


def test_scaled_sinusoidal_starts_at_one_over_sqrt_d():
    pe = ScaledSinusoidalPositions(16)
    assert pe.scale.requires_grad
    torch.testing.assert_close(pe(torch.arange(5)), sinusoidal_table(torch.arange(5), 16) / 4.0)


def test_learned_positions_refuse_positions_past_the_table():
    pe = LearnedPositions(max_len=8, d_model=4)
    assert pe(torch.arange(8)).shape == (8, 4)
    with pytest.raises(ValueError, match="past the learned table of 8"):
        pe(torch.arange(9))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_buckets_match_t5(bidirectional):
    relative = torch.arange(-300, 300)[None, :] - torch.zeros(1, 1, dtype=torch.long)
    ours = relative_position_bucket(relative, bidirectional, num_buckets=32, max_distance=128)
    theirs = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets=32, max_distance=128)
    assert torch.equal(ours, theirs)


def test_relative_bias_reads_one_scalar_per_bucket_and_head():
    bias = RelativePositionBias(n_heads=3, num_buckets=8, max_distance=16)
    torch.nn.init.normal_(bias.weight)
    q, k = torch.arange(5), torch.arange(7)
    out = bias(q, k)  # (1, H, Tq, Tk)
    assert out.shape == (1, 3, 5, 7)
    bucket = relative_position_bucket(k[None, :] - q[:, None], True, 8, 16)
    assert torch.equal(out[0, 2, 4, 1], bias.weight[bucket[4, 1], 2])


@pytest.mark.parametrize("n_heads", [8, 6, 12, 1])
def test_alibi_slopes_match_bloom(n_heads):
    alibi = build_alibi_tensor(torch.ones(1, 4), n_heads, torch.float32)  # (H, 1, T): slope * key position
    torch.testing.assert_close(alibi_slopes(n_heads), alibi[:, 0, 1], atol=1e-7, rtol=0)
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))


def test_alibi_gives_bloom_attention_under_a_causal_mask():
    """BLOOM adds m * j; we add -m * |i - j|. Per row they differ by a constant, so softmax agrees."""
    T, H = 6, 4
    ours = ALiBi(H)(torch.arange(T), torch.arange(T))[0]  # (H, T, T)
    bloom = build_alibi_tensor(torch.ones(1, T), H, torch.float32).expand(H, T, T)  # (H, T, T)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    scores = torch.randn(H, T, T)
    p_ours = (scores + ours).masked_fill(future, -1e9).softmax(-1)
    p_bloom = (scores + bloom).masked_fill(future, -1e9).softmax(-1)
    torch.testing.assert_close(p_ours, p_bloom, atol=1e-6, rtol=0)


def test_rope_matches_llama():
    D, T, base = 16, 11, 500.0
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_parameters={"rope_type": "default", "rope_theta": base}
    )
    q, k = torch.randn(2, 4, T, D), torch.randn(2, 2, T, D)
    positions = torch.arange(3, 3 + T)
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(q, positions[None])
    q_hf, _ = apply_rotary_pos_emb(q, q, cos_hf, sin_hf)
    _, k_hf = apply_rotary_pos_emb(k, k, cos_hf, sin_hf)
    cos, sin = rope_cos_sin(positions, D, base)
    torch.testing.assert_close(apply_rope(q, cos, sin), q_hf, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), k_hf, atol=1e-6, rtol=0)


def test_rope_scores_depend_only_on_the_offset():
    D = 8
    q, k = torch.randn(D), torch.randn(D)

    def score(p, r):
        cos, sin = rope_cos_sin(torch.tensor([p, r]), D)
        rq = apply_rope(q[None], cos[:1], sin[:1])
        rk = apply_rope(k[None], cos[1:], sin[1:])
        return (rq * rk).sum().item()

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)
    cos, sin = rope_cos_sin(torch.arange(5), D)
    x = torch.randn(5, D)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths


def test_odd_sizes_are_refused():
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(torch.arange(3), 7)
    with pytest.raises(ValueError, match="even"):
        sinusoidal_table(torch.arange(3), 5)
