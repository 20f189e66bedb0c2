"""Fixtures shared by several test files (the settings for every test are in the root conftest.py)."""

import pytest


@pytest.fixture(scope="module")
def tiny_bert():
    """A tiny random ``transformers`` BERT classifier (2 layers, width 32, 2 labels, no dropout), in eval
    mode: the PEFT tests adapt copies of it. One per test module, so no module sees another's changes."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(1)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config).eval()


@pytest.fixture(scope="module")
def make_tiny_llama():
    """Builds a tiny random ``transformers`` Llama (width 32, 4 query heads sharing 2 K/V heads, so that
    grouped-query attention is exercised), seeded and in eval mode: ``make_tiny_llama(num_hidden_layers=3)``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(num_hidden_layers: int = 2):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return LlamaForCausalLM(config).eval()

    return make


@pytest.fixture(scope="module")
def tiny_cramming_run(tmp_path_factory):
    """Three optimizer steps of the capstone's tiny shape on 20,000 characters of one corpus: a pretraining run
    folder (run.json, tokenizer, checkpoint, summary) for the study and more-seeds tests, one per test module."""
    from llmedu.cramming.pretrain import PretrainRun, pretrain
    from llmedu.cramming.recipe import TINY_SHAPE, crammed

    out = tmp_path_factory.mktemp("run") / "crammed"
    run = PretrainRun(crammed(**{**TINY_SHAPE, "micro_batch": 8}), None, max_steps=3, corpora=["kjv"], max_chars=20_000)
    pretrain(out, run, tokenizer_chars=30_000, progress=False, eval_batches=1)
    return out


@pytest.fixture
def seed_dependent_scores(monkeypatch):
    """A fine-tune's score read from its weights (a sum), not its accuracy: a tiny model may answer one class
    whatever the seed, which would hide a seed that was not used. Linear probes keep their own accuracy."""
    import llmedu.cramming.studies.encoders as encoders

    monkeypatch.setattr(
        encoders, "_accuracy", lambda model, encode, test: sum(p.sum().item() for p in model.parameters())
    )
