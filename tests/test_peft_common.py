"""What every PEFT method promises besides parity: identity at init, merge, save/load, switches, errors.

Models are tiny random ``transformers`` models, so the file runs in seconds.
"""

import copy

import pytest
import torch

from llmedu.peft import (
    MultiLoRAModel,
    PrefixTuning,
    PromptTuning,
    adapter_state_dict,
    adapters_disabled,
    apply_adapters,
    apply_llama_adapter,
    apply_lora,
    count_parameters,
    load_adapter,
    mark_trainable,
    merge_and_unload,
    merge_lora,
    save_adapter,
    unmerge_lora,
)
from llmedu.peft.lora import LoRALinear


@pytest.fixture(scope="module")
def llama(make_tiny_llama):
    return make_tiny_llama()


IDS = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(3))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def randomise_lora(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)  # as if trained


# -- at initialisation the base model is untouched ------------------------------------------------------
@pytest.mark.parametrize(
    "family,method",
    [
        ("llama", lambda m: apply_lora(m, ["q_proj", "v_proj"], r=4)),
        ("llama", lambda m: apply_adapters(m, ["o_proj", "down_proj"], bottleneck=8)),
        ("llama", lambda m: apply_llama_adapter(m, "self_attn", n_layers=2, n_prompt=3)),
        ("bert", lambda m: apply_lora(m, ["query", "value"], r=4)),
        ("bert", lambda m: apply_adapters(m, r".*\.output\.dense", bottleneck=8)),
        ("bert", lambda m: apply_llama_adapter(m, "attention.self", n_layers=1, n_prompt=3)),
    ],
)
def test_identity_at_init(family, method, llama, tiny_bert):
    base = llama if family == "llama" else tiny_bert
    adapted = copy.deepcopy(base)
    method(adapted)
    assert torch.equal(logits(adapted), logits(base))
    trainable, total = count_parameters(adapted)
    assert 0 < trainable < total / 10


def test_llama_adapter_gate_is_what_keeps_the_identity(tiny_bert):
    adapted = copy.deepcopy(tiny_bert)
    apply_llama_adapter(adapted, "attention.self", n_layers=1, n_prompt=3)
    with torch.no_grad():
        adapted.bert.encoder.layer[1].attention.self.adaption_gate.fill_(0.5)
    with torch.no_grad():  # hidden states: the random classifier head would shrink any difference
        assert (
            adapted.bert(IDS).last_hidden_state - tiny_bert.bert(IDS).last_hidden_state
        ).abs().max() > 1e-3  # rounding is ~1e-6


# -- training touches only the adapter -------------------------------------------------------------------
def test_only_adapter_parameters_get_gradients(llama):
    model = copy.deepcopy(llama).train()
    apply_lora(model, ["q_proj", "v_proj"], r=2)
    model(input_ids=IDS, labels=IDS).loss.backward()
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.requires_grad and p.grad is not None
        else:
            assert not p.requires_grad and p.grad is None, name


# -- LoRA merge ------------------------------------------------------------------------------------------
def test_lora_merge_unmerge_round_trip(llama):
    model = copy.deepcopy(llama)
    apply_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj"], r=4, alpha=8)
    randomise_lora(model)
    before = logits(model)
    assert (before - logits(llama)).abs().max() > 1e-3  # the update matters, so the test can fail
    weights = {n: p.clone() for n, p in model.named_parameters() if n.endswith("base.weight")}
    merge_lora(model)
    assert (logits(model) - before).abs().max() < 1e-5  # float32 rounding of W0 + BA
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(5, 32)
    assert torch.equal(layer(x), layer.base(x))  # merged: one plain matmul, no adapter path
    unmerge_lora(model)
    assert max((p - weights[n]).abs().max().item() for n, p in model.named_parameters() if n in weights) < 1e-6
    assert (logits(model) - before).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="not merged"):
        unmerge_lora(model)


def test_merge_and_unload_round_trips_through_save_pretrained(tiny_bert, tmp_path):
    """BERT with LoRA on query and value, merged and unloaded, saves and loads in transformers as the
    plain model it is, computing what the adapted model computed (float32 rounding of W0 + BA)."""
    from transformers import BertForSequenceClassification

    model = copy.deepcopy(tiny_bert)
    apply_lora(model, ["query", "value"], r=4, alpha=8)
    randomise_lora(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    hidden = lambda m: m.bert(ids).last_hidden_state  # (B, T, d): the logits of a random head are tiny
    adapted, adapted_logits = hidden(model), model(ids).logits
    assert (adapted - hidden(tiny_bert)).abs().max() > 1e-2  # the update matters, so the test can fail
    assert merge_and_unload(model) is model
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert model.state_dict().keys() == tiny_bert.state_dict().keys()
    model.save_pretrained(tmp_path)
    loaded, info = BertForSequenceClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (hidden(loaded.eval()) - adapted).abs().max() < 1e-5
    assert (loaded(ids).logits - adapted_logits).abs().max() < 1e-5
    with pytest.raises(ValueError, match="no LoRA layer"):
        merge_and_unload(model)


# -- switching adapters off --------------------------------------------------------------------------------
def test_disabled_adapters_give_the_base_model(llama):
    model = copy.deepcopy(llama)
    apply_lora(model, ["q_proj", "v_proj"], r=4)
    randomise_lora(model)
    with adapters_disabled(model):
        assert torch.equal(logits(model), logits(llama))
    assert not torch.equal(logits(model), logits(llama))
    merge_lora(model)
    with pytest.raises(RuntimeError, match="unmerge"):
        with adapters_disabled(model):
            pass


# -- saving and loading only the adapter -------------------------------------------------------------------
@pytest.mark.parametrize("method", ["lora", "prefix", "prompt"])
def test_save_and_load_only_the_adapter(method, llama, tmp_path):
    def adapt(model):
        if method == "lora":
            apply_lora(model, ["q_proj", "v_proj"], r=4)
            return model
        return (
            PrefixTuning(model, n_virtual=4, projection=8) if method == "prefix" else PromptTuning(model, n_virtual=4)
        ).eval()

    torch.manual_seed(5)
    trained = adapt(copy.deepcopy(llama))
    randomise_lora(trained)
    size = save_adapter(trained, tmp_path / "adapter.safetensors")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter.safetensors"))
    assert set(saved) == set(adapter_state_dict(trained))
    assert sum(t.numel() for t in saved.values()) == count_parameters(trained)[0]
    assert size < 4 * count_parameters(trained)[1] / 10  # far smaller than the model

    torch.manual_seed(6)  # a fresh adapter with other random values ...
    fresh = adapt(copy.deepcopy(llama))
    assert not torch.equal(logits(fresh), logits(trained))
    load_adapter(fresh, tmp_path / "adapter.safetensors")  # ... becomes the saved one exactly
    assert torch.equal(logits(fresh), logits(trained))


def test_loading_into_a_different_adapter_is_refused(llama, tmp_path):
    a = copy.deepcopy(llama)
    apply_lora(a, ["q_proj", "v_proj"], r=4)
    save_adapter(a, tmp_path / "a.safetensors")
    b = copy.deepcopy(llama)
    apply_lora(b, ["q_proj"], r=4)
    with pytest.raises(ValueError, match="does not fit"):
        load_adapter(b, tmp_path / "a.safetensors")
    with pytest.raises(FileNotFoundError):
        load_adapter(b, tmp_path / "missing.safetensors")


def test_a_wrong_shaped_tensor_leaves_the_model_untouched(llama, tmp_path):
    """The last tensor of the file does not fit: nothing may have been copied before the error."""
    from safetensors.torch import load_file, save_file

    trained = copy.deepcopy(llama)
    apply_lora(trained, ["q_proj", "v_proj"], r=4)
    randomise_lora(trained)
    save_adapter(trained, tmp_path / "a.safetensors")
    tensors = load_file(str(tmp_path / "a.safetensors"))
    last = sorted(tensors)[-1]
    tensors[last] = tensors[last][:-1]  # one row short
    save_file(tensors, str(tmp_path / "cut.safetensors"))
    target = copy.deepcopy(llama)
    apply_lora(target, ["q_proj", "v_proj"], r=4)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=f"{last}: the file holds"):
        load_adapter(target, tmp_path / "cut.safetensors")
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items()), "half-loaded"


def test_an_adapter_of_another_base_is_refused_unless_asked(llama, tmp_path):
    trained = copy.deepcopy(llama)
    apply_lora(trained, ["q_proj", "v_proj"], r=4)
    save_adapter(trained, tmp_path / "a.safetensors")
    other = copy.deepcopy(llama)
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.add_(0.01)  # the same shapes, other weights
    apply_lora(other, ["q_proj", "v_proj"], r=4)
    with pytest.raises(ValueError, match="trained on another base model"):
        load_adapter(other, tmp_path / "a.safetensors")
    load_adapter(other, tmp_path / "a.safetensors", other_base=True)  # on purpose: allowed


# -- several adapters on one base, in one batch -------------------------------------------------------------
def test_two_lora_adapters_served_in_one_batch(llama):
    adapters = {}
    for seed, name in enumerate(["pos", "neg"]):
        model = copy.deepcopy(llama)
        apply_lora(model, ["q_proj", "v_proj"], r=4, alpha=8)
        randomise_lora(model, seed)
        adapters[name] = model
    served = MultiLoRAModel(llama, adapters)
    assert sum(isinstance(m, LoRALinear) for m in served.modules()) == 0  # one frozen base, stacked A and B
    route = ["pos", "neg", "pos"]
    with torch.no_grad():
        mixed = served(route, input_ids=IDS).logits
    for row, name in enumerate(route):
        alone = logits(adapters[name], IDS[row : row + 1])[0]
        assert (mixed[row] - alone).abs().max() < 1e-5
    with pytest.raises(KeyError, match="unknown adapters"):
        served(["pos", "other"], input_ids=IDS[:2])


def test_served_adapters_keep_their_own_trained_heads(tiny_bert):
    adapters = {}
    for seed, name in enumerate(["a", "b"]):
        model = copy.deepcopy(tiny_bert)
        apply_lora(model, ["query", "value"], r=2)
        mark_trainable(model, "classifier")
        randomise_lora(model, seed)
        with torch.no_grad():
            model.classifier.weight.normal_(generator=torch.Generator().manual_seed(seed))
        adapters[name] = model
    served = MultiLoRAModel(tiny_bert, adapters)
    with torch.no_grad():
        mixed = served(["b", "a", "b"], input_ids=IDS).logits
    for row, name in enumerate(["b", "a", "b"]):
        assert (mixed[row] - logits(adapters[name], IDS[row : row + 1])[0]).abs().max() < 1e-5


# -- bad input ----------------------------------------------------------------------------------------------
def test_a_target_that_matches_nothing_is_an_error(llama):
    with pytest.raises(ValueError, match="matches no module"):
        apply_lora(copy.deepcopy(llama), ["q_porj"], r=4)
    with pytest.raises(ValueError, match="matches no module"):
        apply_adapters(copy.deepcopy(llama), ["dense"], bottleneck=4)


@pytest.mark.parametrize("r", [0, -2, 1.5])
def test_rank_must_be_positive(r, llama):
    with pytest.raises(ValueError, match="rank"):
        apply_lora(copy.deepcopy(llama), ["q_proj"], r=r)


def test_a_target_that_is_not_linear_is_an_error(llama):
    with pytest.raises(TypeError, match="adapts Linear modules only"):
        apply_lora(copy.deepcopy(llama), ["self_attn"], r=4)


@pytest.mark.parametrize(
    "method",
    [
        lambda m: apply_lora(m, ["q_proj"], r=2),
        lambda m: apply_adapters(m, ["o_proj"], bottleneck=2),
        lambda m: apply_llama_adapter(m, "self_attn", n_layers=1),
        lambda m: PromptTuning(m, n_virtual=2),
        lambda m: PrefixTuning(m, n_virtual=2),
    ],
)
def test_applying_the_same_method_twice_is_an_error(method, llama):
    model = copy.deepcopy(llama)
    once = method(model)
    model = once if isinstance(once, torch.nn.Module) else model
    with pytest.raises(ValueError, match="already applied"):
        method(model)


def test_llama_adapter_layers_out_of_range(llama):
    with pytest.raises(ValueError, match="n_layers"):
        apply_llama_adapter(copy.deepcopy(llama), "self_attn", n_layers=3)
