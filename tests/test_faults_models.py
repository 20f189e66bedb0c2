"""Bad inputs to the models: each is refused with a message that names the value and what to do.

Each test injects one fault that used to pass silently or fail deep inside torch with a bare error:
float or string sizes in ``TransformerConfig``, embeddings of another dtype than the weights, segment ids
past the type vocabulary, and a ``transformers`` model whose block list no longer matches its config.
"""

import re

import numpy as np
import pytest
import torch
import transformers as tf

from llmedu.models import MaskedLM, Transformer, TransformerConfig, from_hf

SIZES = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "type_vocab_size"]


@pytest.mark.parametrize("field", SIZES + ["relative_buckets", "relative_max_distance"])
@pytest.mark.parametrize("bad", [128.0, "4", True, 2.5])
def test_a_size_that_is_not_an_int_is_refused_by_name(field, bad):
    """d_model=128.0 used to build a model (128.0 % 4 == 0), n_layers=True one layer, n_heads='4' a bare '<' error."""
    with pytest.raises(TypeError, match=rf"{field} must be an int, got {re.escape(repr(bad))}"):
        TransformerConfig(**{field: bad})


def test_numpy_integers_are_sizes_and_become_plain_ints():
    cfg = TransformerConfig(d_model=np.int64(64), n_heads=np.int32(4), d_ff=None)
    assert type(cfg.d_model) is int and type(cfg.n_heads) is int and cfg.d_ff == 256
    assert Transformer(cfg)(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 64)


def test_a_negative_type_vocabulary_is_refused():
    with pytest.raises(ValueError, match="type_vocab_size must be >= 0.*got -1"):
        TransformerConfig(type_vocab_size=-1)


def test_embeddings_of_another_dtype_than_the_weights_are_refused_naming_both():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_heads=4)).to(torch.bfloat16).eval()
    ids = torch.randint(0, 50, (2, 5))
    embeds = model.tok_embed(ids)  # (2, 5, 32) bf16
    with pytest.raises(TypeError, match=r"inputs_embeds are torch.float32 but the model's weights are torch.bfloat16"):
        model(inputs_embeds=embeds.float())
    with torch.no_grad():  # the advised cast gives what the ids give
        torch.testing.assert_close(model(inputs_embeds=embeds.float().to(torch.bfloat16)), model(ids))


def test_autocast_still_takes_embeddings_of_another_dtype():
    """Under autocast the matmuls cast their inputs themselves: that is a documented mix, not a fault."""
    model = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_heads=4)).eval()  # fp32 weights
    embeds = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(inputs_embeds=embeds).shape == (2, 5, 32)


@pytest.mark.parametrize("bad", [2, -1])
def test_a_segment_id_outside_the_type_vocabulary_is_named(bad):
    model = MaskedLM(TransformerConfig.bert(vocab_size=50, d_model=32, n_heads=4, type_vocab_size=2)).eval()
    ids = torch.randint(0, 50, (2, 5))
    types = torch.zeros(2, 5, dtype=torch.long)
    types[1, 3] = bad
    with pytest.raises(ValueError, match=rf"token_type_ids holds {bad}, outside the 2 segment types \(ids 0..1\)"):
        model(ids, token_type_ids=types)
    with torch.no_grad():
        assert model(ids, token_type_ids=types.clamp(0, 1)).shape == (2, 5, 50)  # in range: runs as before


# -- from_hf: the config's layer count against the blocks the model holds ---------------------------------
def _hf(family: str, n_layers: int):
    torch.manual_seed(0)
    common = dict(vocab_size=40, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "bert":
        return tf.BertForMaskedLM(
            tf.BertConfig(
                hidden_size=32,
                num_attention_heads=4,
                num_hidden_layers=n_layers,
                intermediate_size=64,
                max_position_embeddings=16,
                **common,
            )
        )
    if family == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_head=4, n_layer=n_layers, n_positions=16, **common))
    return tf.LlamaForCausalLM(
        tf.LlamaConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=n_layers,
            intermediate_size=64,
            **common,
        )
    )


def _blocks(hf_model, family: str) -> tuple[torch.nn.Module, str]:
    """The module that holds the block list, and the list's attribute name."""
    base = {"bert": lambda m: m.bert.encoder, "gpt2": lambda m: m.transformer, "llama": lambda m: m.model}[family]
    return base(hf_model), {"bert": "layer", "gpt2": "h", "llama": "layers"}[family]


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_a_config_with_more_layers_than_the_model_holds_is_named(family):
    """A block list cut to 2 after building (layer dropping) under a config that still says 4: a bare KeyError
    on the first missing name used to be all the user saw."""
    hf_model = _hf(family, 4)
    owner, name = _blocks(hf_model, family)
    setattr(owner, name, getattr(owner, name)[:2])
    with pytest.raises(ValueError, match=r"config says 4 layers but its weights hold 2 blocks"):
        from_hf(hf_model)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_a_config_with_fewer_layers_than_the_model_holds_is_named(family):
    """The other way round the extra blocks used to be dropped without a word."""
    hf_model = _hf(family, 2)
    owner, name = _blocks(hf_model, family)
    getattr(owner, name).append(_blocks(_hf(family, 3), family)[0].get_submodule(f"{name}.2"))
    with pytest.raises(ValueError, match=r"config says 2 layers but its weights hold 3 blocks"):
        from_hf(hf_model)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_a_model_whose_config_is_set_to_its_blocks_converts(family):
    """The advice works: after the cut, the layer count set to the blocks held converts as a 2-layer model."""
    hf_model = _hf(family, 4).eval()
    owner, name = _blocks(hf_model, family)
    setattr(owner, name, getattr(owner, name)[:2])
    setattr(hf_model.config, "n_layer" if family == "gpt2" else "num_hidden_layers", 2)
    ours = from_hf(hf_model).eval()
    ids = torch.randint(0, 40, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_model(ids).logits, atol=1e-5, rtol=0)
