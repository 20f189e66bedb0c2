"""Our PEFT methods against Hugging Face ``peft`` on tiny ``transformers`` models with the same weights.

Each test builds a random tiny model, adapts one copy with ``peft`` and one with ``llmedu.peft``,
copies ``peft``'s (randomised) adapter weights into ours, and asks for the same logits and the same
number of trainable parameters. Tolerance 1e-5: both sides run the same float32 operations on the
same numbers (the measured difference is 0 or ~1e-7), so anything larger is a different method.
"""

import copy

import peft
import pytest
import torch

from llmedu.peft import (
    AdaptionPromptAttention,
    LoRALinear,
    PrefixTuning,
    PromptTuning,
    apply_llama_adapter,
    apply_lora,
    count_parameters,
    mark_trainable,
)

ATOL = 1e-5


@pytest.fixture(scope="module")
def llama(make_tiny_llama):
    return make_tiny_llama(num_hidden_layers=3)


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # a padded row, so that the masks are exercised
    return ids, mask


def peft_model(base, config):
    return peft.get_peft_model(copy.deepcopy(base), config).eval()


def trainable(model):
    return count_parameters(model)[0]


def logits_difference(theirs, ours, batch):
    ids, mask = batch
    with torch.no_grad():
        return (
            (theirs(input_ids=ids, attention_mask=mask).logits - ours(input_ids=ids, attention_mask=mask).logits)
            .abs()
            .max()
            .item()
        )


@pytest.mark.parametrize("family,targets", [("llama", ["q_proj", "v_proj"]), ("bert", ["query", "value"])])
def test_lora_matches_peft(family, targets, llama, tiny_bert, batch):
    base = llama if family == "llama" else tiny_bert
    task = "CAUSAL_LM" if family == "llama" else "SEQ_CLS"
    theirs = peft_model(base, peft.LoraConfig(task_type=task, r=4, lora_alpha=8, target_modules=targets))
    their_params = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, p in their_params.items():
            if "lora_B" in name:
                p.normal_()  # B is zero at init: randomise it, or the test could not fail
    ours = copy.deepcopy(base)
    adapted = apply_lora(ours, targets, r=4, alpha=8)
    assert len(adapted) == 2 * base.config.num_hidden_layers
    with torch.no_grad():
        for name, module in ours.named_modules():
            if isinstance(module, LoRALinear):
                module.lora_A.copy_(their_params[f"base_model.model.{name}.lora_A.default.weight"])
                module.lora_B.copy_(their_params[f"base_model.model.{name}.lora_B.default.weight"])
    if family == "bert":  # peft also trains the new head of a sequence classifier
        assert mark_trainable(ours, "classifier") == ["classifier"]
    assert trainable(ours) == trainable(theirs)
    assert logits_difference(theirs, ours, batch) < ATOL


def test_prompt_tuning_matches_peft(llama, batch):
    theirs = peft_model(llama, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5))
    ours = PromptTuning(copy.deepcopy(llama), n_virtual=5).eval()
    with torch.no_grad():
        ours.prompt.copy_(theirs.prompt_encoder.default.embedding.weight)
    assert trainable(ours) == trainable(theirs) == 5 * 32
    assert logits_difference(theirs, ours, batch) < ATOL


@pytest.mark.parametrize("projection", [None, 16])
def test_prefix_tuning_matches_peft(projection, llama, batch):
    config = peft.PrefixTuningConfig(
        task_type="CAUSAL_LM",
        num_virtual_tokens=5,
        prefix_projection=projection is not None,
        encoder_hidden_size=projection or 1,
    )
    theirs = peft_model(llama, config)
    ours = PrefixTuning(copy.deepcopy(llama), n_virtual=5, projection=projection).eval()
    encoder = theirs.prompt_encoder.default
    with torch.no_grad():
        ours.prefix.copy_(encoder.embedding.weight)
        if projection is not None:
            ours.mlp.load_state_dict(encoder.transform.state_dict())
    assert trainable(ours) == trainable(theirs)
    assert logits_difference(theirs, ours, batch) < ATOL


def test_prefix_tuning_on_bert_matches_peft(tiny_bert, batch):
    theirs = peft_model(tiny_bert, peft.PrefixTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=3))
    ours = PrefixTuning(copy.deepcopy(tiny_bert), n_virtual=3).eval()
    with torch.no_grad():
        ours.prefix.copy_(theirs.prompt_encoder.default.embedding.weight)
    assert logits_difference(theirs, ours, batch) < ATOL


def test_llama_adapter_matches_peft_adaption_prompt(llama, batch):
    theirs = peft_model(llama, peft.AdaptionPromptConfig(task_type="CAUSAL_LM", adapter_len=4, adapter_layers=2))
    their_params = dict(theirs.named_parameters())
    ours = copy.deepcopy(llama)
    adapted = apply_llama_adapter(ours, "self_attn", n_layers=2, n_prompt=4)
    assert adapted == ["model.layers.1.self_attn", "model.layers.2.self_attn"]  # the top layers
    with torch.no_grad():
        for name, module in ours.named_modules():
            if isinstance(module, AdaptionPromptAttention):
                module.adaption_prompt.copy_(their_params[f"base_model.model.{name}.adaption_prompt"][0])
                gate = torch.tensor([0.7])  # zero at init: open the gate on both sides
                module.adaption_gate.copy_(gate)
                their_params[f"base_model.model.{name}.adaption_gate"].copy_(gate)
    assert trainable(ours) == trainable(theirs) == 2 * (4 * 32 + 1)
    assert logits_difference(theirs, ours, batch) < ATOL
