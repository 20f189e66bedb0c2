"""Norms, activations and the block placements against PyTorch, ``transformers`` and the equations.

Tolerance (float32, same formula, different order of operations) unless said: 1e-6 absolute near zero,
and 8 float32 ulps relative (9.5e-7) for larger values: the mean and the variance are sums of 24 terms
taken in another order, each off by a few ulps, and outputs reach |x| ~ 5. Every test seeds its inputs.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from llmedu.models import MaskedLM, TransformerConfig
from llmedu.nn.activations import FUSED, FeedForward, gelu, gelu_tanh, glu_hidden_size, relu, silu
from llmedu.nn.blocks import ParallelBlock, SerialBlock
from llmedu.nn.norms import LayerNorm, RMSNorm, deepnorm_constants, deepnorm_init_

TOL = dict(atol=1e-6, rtol=8 * torch.finfo(torch.float32).eps)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # inputs drawn from the global generator must not depend on which tests ran before


def _randomise(module):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return module


def test_layernorm_matches_torch():
    x = torch.randn(3, 5, 24) * 4 + 2
    ours = _randomise(LayerNorm(24, eps=1e-5))
    torch.testing.assert_close(ours(x), F.layer_norm(x, (24,), ours.weight, ours.bias, 1e-5), **TOL)
    no_bias = LayerNorm(24, bias=False)
    assert no_bias.bias is None and no_bias(x).shape == x.shape


def test_rmsnorm_matches_torch_and_llama():
    x = torch.randn(3, 5, 24) * 4 + 2
    ours = _randomise(RMSNorm(24, eps=1e-6))
    theirs = LlamaRMSNorm(24, eps=1e-6)
    theirs.weight.data.copy_(ours.weight)
    torch.testing.assert_close(ours(x), theirs(x), **TOL)
    torch.testing.assert_close(ours(x), F.rms_norm(x, (24,), ours.weight, 1e-6), **TOL)


@pytest.mark.parametrize(
    "make",
    [
        lambda fused: LayerNorm(24, 1e-5, fused=fused),
        lambda fused: LayerNorm(24, 1e-5, bias=False, fused=fused),
        lambda fused: RMSNorm(24, 1e-6, fused=fused),
    ],
    ids=["layernorm", "layernorm-no-bias", "rmsnorm"],
)
def test_fused_norms_equal_the_written_out_ones_forward_and_backward(make):
    x = (torch.randn(3, 5, 24) * 4 + 2).requires_grad_()
    written, fused = _randomise(make(False)), make(True)
    fused.load_state_dict(written.state_dict())
    grads = []
    for norm in (written, fused):
        y = norm(x)
        (y * torch.linspace(-1, 1, 24)).sum().backward()  # a non-uniform upstream gradient
        grads.append([x.grad.clone(), *(p.grad.clone() for p in norm.parameters())])
        x.grad = None
    torch.testing.assert_close(fused(x), written(x), **TOL)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # gradients sum over 15 rows: looser


def test_fused_activations_and_model_equal_the_written_out_ones():
    x = torch.linspace(-6, 6, 1001)
    for name, f in FUSED.items():
        torch.testing.assert_close(f(x), FeedForward(4, 8, name).act(x), **TOL)
    config = TransformerConfig.bert(
        vocab_size=60, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, activation="geglu", bias=False
    )
    torch.manual_seed(0)
    written = MaskedLM(config).eval()
    fused = MaskedLM(TransformerConfig(**{**config.to_dict(), "fused": True})).eval()
    fused.load_state_dict(written.state_dict())
    ids = torch.randint(0, 60, (2, 16))
    torch.testing.assert_close(fused(ids), written(ids), atol=1e-5, rtol=0)


def test_rmsnorm_by_hand():
    y = RMSNorm(2, eps=0.0)(torch.tensor([[3.0, 4.0]]))  # rms = sqrt((9 + 16) / 2)
    torch.testing.assert_close(y, torch.tensor([[3.0, 4.0]]) / math.sqrt(12.5))


def test_activations_match_torch_and_transformers():
    x = torch.linspace(-6, 6, 1001)
    torch.testing.assert_close(relu(x), F.relu(x))
    torch.testing.assert_close(gelu(x), F.gelu(x), **TOL)
    torch.testing.assert_close(gelu_tanh(x), F.gelu(x, approximate="tanh"), **TOL)
    torch.testing.assert_close(gelu_tanh(x), ACT2FN["gelu_new"](x), **TOL)
    torch.testing.assert_close(silu(x), F.silu(x), **TOL)


def test_swiglu_and_geglu_follow_shazeer():
    x = torch.randn(2, 3, 16)
    for name, act in (("swiglu", F.silu), ("geglu", F.gelu)):
        ffn = FeedForward(16, 40, name, bias=False)
        expected = ffn.down_proj(act(ffn.gate_proj(x)) * ffn.up_proj(x))
        torch.testing.assert_close(ffn(x), expected, **TOL)
    with pytest.raises(ValueError, match="unknown activation"):
        FeedForward(16, 40, "swish-ish")


def test_glu_width_keeps_the_parameter_count():
    plain = FeedForward(96, 384, "gelu", bias=False)
    gated = FeedForward(96, glu_hidden_size(384), "swiglu", bias=False)
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(gated) == n(plain)


def test_deepnorm_constants_by_hand():
    alpha, beta = deepnorm_constants(6)
    assert alpha == pytest.approx(12**0.25) and beta == pytest.approx(48**-0.25)


def _block(placement, **kw):
    torch.manual_seed(0)
    return SerialBlock(d_model=32, n_heads=4, d_ff=64, placement=placement, attn_impl="math", **kw).eval()


def test_placements_compute_their_equations():
    x = torch.randn(2, 5, 32)
    kw = dict(causal=True)
    pre = _block("pre")
    h = x + pre.attn(pre.attn_norm(x), **kw)
    torch.testing.assert_close(pre(x, **kw), h + pre.mlp(pre.mlp_norm(h)), **TOL)

    post = _block("post")
    h = post.attn_norm(x + post.attn(x, **kw))
    torch.testing.assert_close(post(x, **kw), post.mlp_norm(h + post.mlp(h)), **TOL)

    sandwich = _block("sandwich")
    h = x + sandwich.attn_out_norm(sandwich.attn(sandwich.attn_norm(x), **kw))
    expected = h + sandwich.mlp_out_norm(sandwich.mlp(sandwich.mlp_norm(h)))
    torch.testing.assert_close(sandwich(x, **kw), expected, **TOL)

    alpha = deepnorm_constants(12)[0]
    deep = _block("deepnorm", deepnorm_alpha=alpha)
    h = deep.attn_norm(alpha * x + deep.attn(x, **kw))
    torch.testing.assert_close(deep(x, **kw), deep.mlp_norm(alpha * h + deep.mlp(h)), **TOL)

    par = ParallelBlock(d_model=32, n_heads=4, d_ff=64, attn_impl="math")
    h = par.norm(x)
    torch.testing.assert_close(par(x, **kw), x + par.attn(h, **kw) + par.mlp(h), **TOL)
    with pytest.raises(ValueError, match="pre-LN"):
        ParallelBlock(d_model=32, n_heads=4, d_ff=64, placement="post")
    with pytest.raises(ValueError, match="unknown norm placement"):
        _block("middle")


def test_deepnorm_init_is_xavier_with_gain_beta_on_v_o_and_ffn():
    torch.manual_seed(1)
    block = SerialBlock(d_model=512, n_heads=8, d_ff=1024, placement="deepnorm")
    beta = 0.25
    deepnorm_init_(block, beta)

    def xavier_std(linear, gain):
        fan_out, fan_in = linear.weight.shape
        return gain * math.sqrt(2.0 / (fan_in + fan_out))

    # 2% relative: the sample std of >= 262k normal draws is within 0.3% of the true one
    for linear, gain in (
        (block.attn.q_proj, 1.0),
        (block.attn.k_proj, 1.0),
        (block.attn.v_proj, beta),
        (block.attn.o_proj, beta),
        (block.mlp.up_proj, beta),
        (block.mlp.down_proj, beta),
    ):
        assert linear.weight.std().item() == pytest.approx(xavier_std(linear, gain), rel=0.02)
