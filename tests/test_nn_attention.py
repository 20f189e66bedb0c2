"""Attention: both registered functions against ``F.scaled_dot_product_attention`` used plainly,
masks, grouped key/value heads, the KV cache and the registry.

Tolerance 1e-5: float32 softmax-weighted sums over <= 32 keys, summed in a different order.
"""

import pytest
import torch
import torch.nn.functional as F

from llmedu.nn.attention import (
    ATTENTION_FUNCTIONS,
    Attention,
    causal_mask,
    get_attention,
    kv_cache_bytes,
    padding_bias,
    register_attention,
    set_attention,
)
from llmedu.nn.kv_cache import KVCache

TOL = dict(atol=1e-5, rtol=0)


def _qkv(B=2, H=6, Hkv=2, Tq=9, Tk=9, D=8):
    torch.manual_seed(0)
    return torch.randn(B, H, Tq, D), torch.randn(B, Hkv, Tk, D), torch.randn(B, Hkv, Tk, D)


def _reference(q, k, v, causal, mask):
    """PyTorch's own, with GQA and a top-left causal mask: the plain square case."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


@pytest.mark.parametrize("impl", ["math", "sdpa"])
@pytest.mark.parametrize("n_kv", [6, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("causal", [False, True])
def test_functions_match_torch(impl, n_kv, causal):
    q, k, v = _qkv(Hkv=n_kv)
    bias = torch.randn(1, 6, 9, 9)
    torch.testing.assert_close(get_attention(impl)(q, k, v, causal, None), _reference(q, k, v, causal, None), **TOL)
    if not causal:
        torch.testing.assert_close(get_attention(impl)(q, k, v, False, bias), _reference(q, k, v, False, bias), **TOL)


@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_causal_with_fewer_queries_is_aligned_bottom_right(impl):
    """The last Tq queries of a causal square attention: what a decoding step with a cache computes."""
    q, k, v = _qkv(Tq=9, Tk=9)
    full = _reference(q, k, v, True, None)  # (B, H, 9, D)
    for t_q in (1, 4):
        out = get_attention(impl)(q[:, :, -t_q:], k, v, True, None)
        torch.testing.assert_close(out, full[:, :, -t_q:], **TOL)
    with pytest.raises(ValueError, match="more queries"):
        causal_mask(5, 3)


def test_math_equals_sdpa_with_padding_and_causal_mask():
    q, k, v = _qkv(Tq=4, Tk=9)
    keep = torch.ones(2, 9)
    keep[1, :3] = 0  # left padding in the second sequence
    bias = padding_bias(keep)  # (B, 1, 1, Tk)
    torch.testing.assert_close(
        get_attention("math")(q, k, v, True, bias), get_attention("sdpa")(q, k, v, True, bias), **TOL
    )


def test_padding_changes_nothing_for_real_tokens():
    torch.manual_seed(0)
    attn = Attention(d_model=48, n_heads=6, n_kv_heads=3, impl="math").eval()
    x = torch.randn(1, 7, 48)
    padded = torch.cat([x, torch.randn(1, 4, 48) * 100], dim=1)  # garbage in the padding
    mask = padding_bias(torch.tensor([[1] * 7 + [0] * 4]))
    torch.testing.assert_close(attn(padded, causal=False, attn_mask=mask)[:, :7], attn(x, causal=False), **TOL)
    # without the mask the garbage leaks in: the test above can fail
    assert not torch.allclose(attn(padded, causal=False)[:, :7], attn(x, causal=False), atol=1e-3)


@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_future_tokens_cannot_change_the_past(impl):
    torch.manual_seed(0)
    attn = Attention(d_model=48, n_heads=6, n_kv_heads=2, impl=impl).eval()
    x = torch.randn(2, 10, 48)
    y = x.clone()
    y[:, 6:] = torch.randn(2, 4, 48)
    torch.testing.assert_close(attn(x, causal=True)[:, :6], attn(y, causal=True)[:, :6], atol=0, rtol=0)
    assert not torch.allclose(attn(x, causal=False)[:, :6], attn(y, causal=False)[:, :6], atol=1e-3)


def test_attention_with_a_cache_equals_one_pass():
    torch.manual_seed(0)
    attn = Attention(d_model=48, n_heads=6, n_kv_heads=2).eval()
    x = torch.randn(2, 10, 48)
    cache = KVCache(n_layers=1, batch=2, n_kv_heads=2, head_dim=8, max_len=10)
    steps = [attn(x[:, :6], causal=True, cache=cache)] + [
        attn(x[:, t : t + 1], causal=True, cache=cache) for t in range(6, 10)
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), attn(x, causal=True), **TOL)
    assert cache.length == 10
    assert cache.nbytes == kv_cache_bytes(n_layers=1, n_kv_heads=2, head_dim=8, seq_len=10, batch=2, bytes_per_value=4)
    with pytest.raises(ValueError, match="holds 10 tokens"):
        attn(x[:, :1], causal=True, cache=cache)


def test_kv_cache_formula_by_hand():
    # Llama-2-7B (32 layers, 32 KV heads of 128) at 4096 tokens in fp16: 2 GiB per sequence
    assert kv_cache_bytes(32, 32, 128, 4096, batch=1, bytes_per_value=2) == 2 * 1024**3


def test_shapes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="not divisible"):
        Attention(d_model=100, n_heads=3)
    with pytest.raises(ValueError, match="must divide"):
        Attention(d_model=96, n_heads=6, n_kv_heads=4)


def test_registering_a_new_function_is_one_call():
    calls = []

    def traced(q, k, v, causal, attn_mask):
        calls.append(q.shape)
        return get_attention("math")(q, k, v, causal, attn_mask)

    register_attention("traced_for_test", traced)
    try:
        torch.manual_seed(0)
        attn = Attention(d_model=48, n_heads=6, impl="traced_for_test")
        x = torch.randn(1, 5, 48)
        out = attn(x, causal=True)
        attn.impl = "sdpa"
        torch.testing.assert_close(out, attn(x, causal=True), **TOL)
        assert calls == [(1, 6, 5, 8)]
        with pytest.raises(ValueError, match="already registered"):
            register_attention("traced_for_test", traced)
    finally:
        del ATTENTION_FUNCTIONS["traced_for_test"]
    with pytest.raises(KeyError, match="registered: "):
        get_attention("traced_for_test")


def test_set_attention_switches_a_whole_model():
    from llmedu.models import CausalLM, TransformerConfig

    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.llama(vocab_size=64, d_model=48, n_heads=6, n_kv_heads=2, n_layers=2)).eval()
    ids = torch.randint(0, 64, (2, 9))
    sdpa = model(ids)
    set_attention(model, "math")
    assert {m.impl for m in model.modules() if isinstance(m, Attention)} == {"math"}
    torch.testing.assert_close(model(ids), sdpa, **TOL)
    with pytest.raises(KeyError, match="no attention function"):
        set_attention(model, "nonexistent")
