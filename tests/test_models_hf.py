"""Parity with ``transformers``: BERT, GPT-2 and Llama (GQA, RoPE) built from random configs of odd
sizes, converted with ``from_hf``, must give the same hidden states and logits; ``to_hf`` must give
back the same weights.

Tolerance 1e-5 (float32): the same products summed in a different order (our attention vs theirs,
a written-out LayerNorm vs the fused one) differ by ~1e-6 after two layers; a wrong name, transpose
or constant gives differences of order 0.1 to 1.
"""

import pytest
import torch
import transformers as tf

from llmedu.models import CausalLM, MaskedLM, Transformer, TransformerConfig, from_hf, generate, to_hf
from llmedu.models.hf import _family_of

TOL = dict(atol=1e-5, rtol=0)
VOCAB = 101
CONFIGS = {
    "bert": lambda: tf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        num_attention_heads=3,
        num_hidden_layers=2,
        intermediate_size=136,
        max_position_embeddings=40,
        type_vocab_size=2,
    ),
    "gpt2": lambda: tf.GPT2Config(
        vocab_size=VOCAB,
        n_embd=96,
        n_head=3,
        n_layer=2,
        n_positions=40,
        n_inner=136,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "llama": lambda: tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=136,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    ),
}
CLASSES = [
    ("bert", tf.BertModel),
    ("bert", tf.BertForMaskedLM),
    ("gpt2", tf.GPT2Model),
    ("gpt2", tf.GPT2LMHeadModel),
    ("llama", tf.LlamaModel),
    ("llama", tf.LlamaForCausalLM),
]


def _hf_model(family, cls):
    torch.manual_seed(0)
    kwargs = {"add_pooling_layer": False} if cls is tf.BertModel else {}
    model = cls(CONFIGS[family](), **kwargs).eval()
    with torch.no_grad():  # norms start at 1 and 0: move them so that a swapped weight/bias would show
        for name, p in model.named_parameters():
            if "norm" in name.lower() or ".ln" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _hf_out(model, ids, mask, **kw):
    out = model(input_ids=ids, attention_mask=mask, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _inputs():
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 23))
    mask = torch.ones(3, 23, dtype=torch.long)
    mask[1, 15:] = 0  # right padding
    return ids, mask


@pytest.mark.parametrize("family,cls", CLASSES, ids=[c.__name__ for _, c in CLASSES])
def test_from_hf_gives_the_same_outputs(family, cls):
    hf_model = _hf_model(family, cls)
    ours = from_hf(hf_model).eval()
    assert isinstance(
        ours,
        Transformer
        if cls in (tf.BertModel, tf.GPT2Model, tf.LlamaModel)
        else (MaskedLM if family == "bert" else CausalLM),
    )
    ids, mask = _inputs()
    real = mask.bool()
    with torch.no_grad():
        kw = {"token_type_ids": (torch.arange(23) > 10).long().expand(3, -1)} if family == "bert" else {}
        theirs = _hf_out(hf_model, ids, mask, **kw)
        got = ours(ids, mask, **kw) if family == "bert" else ours(ids, mask)
    diff = (got - theirs)[real].abs().max().item()
    assert diff < 1e-5, f"max |ours - transformers| = {diff:.2e}"
    assert theirs[real].abs().max().item() > 0.1  # a meaningful comparison, not of zeros


@pytest.mark.parametrize("family,cls", CLASSES, ids=[c.__name__ for _, c in CLASSES])
def test_to_hf_round_trip(family, cls):
    hf_model = _hf_model(family, cls)
    back = to_hf(from_hf(hf_model)).eval()
    assert type(back) is cls
    theirs, again = hf_model.state_dict(), back.state_dict()
    assert set(theirs) == set(again)
    for name in theirs:
        assert torch.equal(theirs[name], again[name]), name
    ids, mask = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(_hf_out(back, ids, mask), _hf_out(hf_model, ids, mask), atol=0, rtol=0)


def test_our_model_to_hf_and_back():
    torch.manual_seed(0)
    ours = CausalLM(
        TransformerConfig.llama(vocab_size=VOCAB, d_model=96, n_heads=6, n_kv_heads=3, n_layers=2, d_ff=136)
    ).eval()
    hf_model = to_hf(ours).eval()
    assert hf_model.config.num_key_value_heads == 3
    ids, mask = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, mask)[mask.bool()], _hf_out(hf_model, ids, mask)[mask.bool()], **TOL)


@pytest.mark.parametrize("family,cls", [("gpt2", tf.GPT2LMHeadModel), ("llama", tf.LlamaForCausalLM)])
def test_greedy_generation_matches_transformers(family, cls):
    hf_model = _hf_model(family, cls)
    ours = from_hf(hf_model).eval()
    prompt = torch.randint(0, VOCAB, (2, 5))
    theirs = hf_model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, pad_token_id=0
    )
    assert torch.equal(generate(ours, prompt, 12), theirs)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_a_family_is_recognised_by_its_preset(family):
    """to_hf knows a family by the fields of its TransformerConfig preset, whatever the sizes."""
    preset = getattr(TransformerConfig, family)
    assert _family_of(preset(d_model=96, n_heads=3, n_layers=1, norm_eps=1e-3)) == family
    for change in (dict(position="alibi"), dict(norm_placement="sandwich"), dict(activation="silu")):
        with pytest.raises(ValueError, match="matches none of"):
            _family_of(preset(**change))


def test_unsupported_models_are_refused():
    with pytest.raises(TypeError, match="from_hf takes one of"):
        from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="matches none of"):
        to_hf(CausalLM(TransformerConfig(position="alibi")))
    scaled = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        num_attention_heads=6,
        num_hidden_layers=1,
        intermediate_size=64,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    )
    with pytest.raises(ValueError, match="RoPE scaling"):
        from_hf(tf.LlamaModel(scaled))


def test_a_config_edited_after_building_is_refused():
    """GPT-2 built with 4 heads, then its config says 8: the weights have the same shapes either way, so
    only the attention modules know; converting must refuse rather than give other logits."""
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=1, n_positions=16))
    from_hf(model)  # as built: fine
    model.config.n_head = 8
    with pytest.raises(ValueError, match=r"attn\.num_heads is 4, but the model's config implies 8"):
        from_hf(model)
