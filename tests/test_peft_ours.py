"""The same PEFT methods on our own models (``llmedu.models``), with ``transformers`` as the oracle.

``from_hf`` gives our model the weights of a tiny random Hugging Face model (Llama or BERT). The
same method is applied to both, with the same adapter weights, and the outputs must agree to
1e-5 (float32; the base models themselves agree to ~1e-7). This proves that name-pattern
injection works on a model that was not written for ``transformers``.
"""

import copy

import pytest
import torch
from transformers import BertConfig, BertModel

from llmedu.models.hf import from_hf
from llmedu.peft import PrefixTuning, PromptTuning, apply_adapters, apply_llama_adapter, apply_lora, count_parameters
from llmedu.peft.inject import adapter_parameter_names

ATOL = 1e-5


@pytest.fixture(scope="module")
def llamas(make_tiny_llama):
    hf = make_tiny_llama()
    return hf, from_hf(hf).eval()


@pytest.fixture(scope="module")
def berts():
    torch.manual_seed(1)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = BertModel(config, add_pooling_layer=False).eval()
    return hf, from_hf(hf).eval()


IDS = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
MASK = torch.tensor([[1] * 7, [0, 0] + [1] * 5])


def outputs(model):
    with torch.no_grad():
        out = model(input_ids=IDS, attention_mask=MASK)
    out = out if isinstance(out, torch.Tensor) else (out.logits if hasattr(out, "logits") else out.last_hidden_state)
    return out[MASK.bool()]  # padded positions are garbage on both sides


def copy_adapter(source, target, seed=0):
    """Randomise ``source``'s adapter tensors, then copy them into ``target`` (both in model order)."""
    g = torch.Generator().manual_seed(seed)
    src = [p for n, p in source.named_parameters() if n in adapter_parameter_names(source)]
    dst = [p for n, p in target.named_parameters() if n in adapter_parameter_names(target)]
    assert [p.shape for p in src] == [p.shape for p in dst]
    with torch.no_grad():
        for a, b in zip(src, dst):
            a.copy_(torch.randn(a.shape, generator=g) * 0.3)
            b.copy_(a)


def check_same(hf, ours, apply_hf, apply_ours):
    hf, ours = copy.deepcopy(hf), copy.deepcopy(ours)
    wrapped_hf, wrapped_ours = apply_hf(hf), apply_ours(ours)  # a wrapper, or the names adapted in place
    hf = wrapped_hf if isinstance(wrapped_hf, torch.nn.Module) else hf
    ours = wrapped_ours if isinstance(wrapped_ours, torch.nn.Module) else ours
    assert count_parameters(hf)[0] == count_parameters(ours)[0]
    copy_adapter(hf, ours)
    assert (outputs(hf) - outputs(ours)).abs().max() < ATOL


@pytest.mark.parametrize("method", ["lora", "adapters", "llama_adapter", "prefix"])
def test_methods_on_our_llama(method, llamas):
    hf, ours = llamas
    if method == "lora":
        check_same(
            hf,
            ours,
            lambda m: apply_lora(m, ["q_proj", "v_proj"], r=4),
            lambda m: apply_lora(m, ["q_proj", "v_proj"], r=4),
        )
    elif method == "adapters":
        same = lambda m: apply_adapters(m, ["o_proj", "down_proj"], bottleneck=4)  # noqa: E731
        check_same(hf, ours, same, same)
    elif method == "llama_adapter":
        check_same(
            hf,
            ours,
            lambda m: apply_llama_adapter(m, "self_attn", 1, 3),
            lambda m: apply_llama_adapter(m, "attn", 1, 3),
        )
    else:
        prefix = lambda m: PrefixTuning(m, n_virtual=3).eval()  # noqa: E731
        check_same(hf, ours, prefix, prefix)


def test_methods_on_our_bert(berts):
    hf, ours = berts
    check_same(
        hf, ours, lambda m: apply_lora(m, ["query", "value"], r=4), lambda m: apply_lora(m, ["q_proj", "v_proj"], r=4)
    )
    # Their adapter sits before BERT's output projection, ours after o_proj: the same sum, one bias.
    check_same(
        hf,
        ours,
        lambda m: apply_llama_adapter(m, "attention.self", 2, 3),
        lambda m: apply_llama_adapter(m, "attn", 2, 3),
    )


def test_prefix_tuning_trains_on_our_model(llamas):
    _, ours = llamas
    model = PrefixTuning(copy.deepcopy(ours), n_virtual=3, projection=8).train()
    logits = model(IDS, attention_mask=MASK)  # (B, T, V): the prefix adds no output position
    assert logits.shape == (2, 7, 64)
    logits.logsumexp(-1).mean().backward()
    assert model.prefix.grad is not None and model.mlp[0].weight.grad is not None
    assert all(p.grad is None for p in model.base.parameters())


@pytest.mark.parametrize("models", ["llamas", "berts"])
def test_prompt_tuning_on_our_model_matches_transformers(models, request):
    hf, ours = request.getfixturevalue(models)
    theirs, mine = PromptTuning(copy.deepcopy(hf), n_virtual=3), PromptTuning(copy.deepcopy(ours), n_virtual=3)
    copy_adapter(theirs, mine)
    with torch.no_grad():
        a, b = theirs(IDS, attention_mask=MASK), mine(IDS, attention_mask=MASK)
    a = a.logits if hasattr(a, "logits") else a.last_hidden_state
    assert a.shape == b.shape and b.shape[1] == 3 + IDS.shape[1]  # the virtual tokens come first
    torch.testing.assert_close(b[:, 3:][MASK.bool()], a[:, 3:][MASK.bool()], rtol=0, atol=ATOL)
    torch.testing.assert_close(b[:, :3], a[:, :3], rtol=0, atol=ATOL)
    assert count_parameters(mine)[0] == count_parameters(theirs)[0] == 3 * 32


@pytest.mark.parametrize("shift", [True, False], ids=["after-the-prefix", "from-zero"])
def test_prefix_tuning_on_our_bert_and_llama_in_both_position_modes(shift, berts, llamas):
    """BERT's learned positions and Llama's RoPE both see where the real tokens start: the two
    implementations (ours through the cache's first_position, transformers' through position_ids) agree."""
    prefix = lambda m: PrefixTuning(m, n_virtual=3, shift_positions=shift).eval()  # noqa: E731
    for hf, ours in (berts, llamas):
        check_same(hf, ours, prefix, prefix)


def test_shifting_the_positions_changes_a_learned_position_model(berts):
    """The switch does something: with learned absolute positions, 0..T-1 and P..P+T-1 differ."""
    hf, _ = berts
    shifted = PrefixTuning(copy.deepcopy(hf), n_virtual=3).eval()
    kept = PrefixTuning(copy.deepcopy(hf), n_virtual=3, shift_positions=False).eval()
    kept.load_state_dict(shifted.state_dict())
    assert (outputs(shifted) - outputs(kept)).abs().max() > 1e-3


def test_prompt_tuning_needs_input_embeddings():
    with pytest.raises(TypeError, match="inputs_embeds"):
        PromptTuning(torch.nn.Linear(4, 4), n_virtual=3)


def test_prefix_tuning_reaches_every_layer_of_our_classifier():
    from llmedu.models import SequenceClassifier, TransformerConfig

    torch.manual_seed(4)
    base = SequenceClassifier(TransformerConfig.bert(vocab_size=64, d_model=32, n_heads=4, n_layers=2), n_classes=2)
    model = PrefixTuning(base, n_virtual=3).eval()
    with torch.no_grad():
        before = model(IDS, attention_mask=MASK)  # (B, 2)
        model.prefix.add_(1.0)  # were the prefix not passed down to attention, this would change nothing
        after = model(IDS, attention_mask=MASK)
    assert before.shape == (2, 2) and (after - before).abs().max() > 1e-4
