"""The graders of lesson 21 fail a right value computed the wrong way: by asking the library for it."""

import pytest
import torch
from test_checks_moe import _bytes, _dropped, _internode, _parameters, _router

from llmedu.checks import moe as checks_moe
from llmedu.checks.moe import (
    check_all_to_all_bytes,
    check_dropped,
    check_internode_rows,
    check_moe_parameters,
    check_router,
)
from llmedu.models.counting import count_parameters
from llmedu.models.gpt import CausalLM
from llmedu.nn.moe import assign, expert_capacity, load_balancing_loss
from llmedu.parallel.experts import all_to_all_bytes


def test_check_dropped_fails_the_librarys_assign():
    def with_assign(choices, n_experts, cf):
        experts = torch.tensor(choices)  # (N, k)
        n, k = experts.shape
        capacity = expert_capacity(n, n_experts, k, cf)
        a = assign(experts, torch.ones(n, k), n_experts, capacity)
        kept = {(int(t), int(e)) for t, e in zip(a.token, a.expert)}
        return capacity, sorted((t, j) for t in range(n) for j in range(k) if (t, choices[t][j]) not in kept)

    assert with_assign([[0], [1]], 2, 1.0) == _dropped([[0], [1]], 2, 1.0)  # the right value...
    assert not check_dropped(with_assign)  # ...the wrong way
    assert check_dropped(_dropped)


def test_check_moe_parameters_fails_a_model_built_and_counted():
    def built(config):
        with torch.device("meta"):
            model = CausalLM(config)
        return count_parameters(model), count_parameters(model, active=True)

    assert not check_moe_parameters(built)
    assert check_moe_parameters(_parameters)  # reading config properties (head_dim, ...) is allowed


def _shape(c):  # the grader's own description of a config: (d, layers, heads, kv_heads, d_ff, vocab, E, k)
    return (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.d_ff, c.vocab_size, c.moe.n_experts, c.moe.top_k)


def test_check_moe_parameters_fails_mixtral_built_by_transformers():
    transformers = pytest.importorskip("transformers")

    def mixtral(c):
        cfg = transformers.MixtralConfig(
            vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff, num_hidden_layers=c.n_layers,
            num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, num_local_experts=c.moe.n_experts,
            num_experts_per_tok=c.moe.top_k, tie_word_embeddings=False,
        )  # fmt: skip
        with torch.device("meta"):
            total = sum(p.numel() for p in transformers.MixtralForCausalLM(cfg).parameters())
        unused = c.n_layers * (c.moe.n_experts - c.moe.top_k) * 3 * c.d_model * c.d_ff  # experts a token skips
        return total, total - unused

    config = checks_moe._mixtral_shaped(*checks_moe._CONFIGS[2])
    assert mixtral(config) == _parameters(config)  # the right value...
    assert not check_moe_parameters(mixtral)  # ...the wrong way


def test_check_moe_parameters_fails_torch_nn_layers_counted():
    def layers_counted(c):
        with torch.device("meta"):
            expert = sum(p.numel() for p in torch.nn.Linear(c.d_model, 3 * c.d_ff, bias=False).parameters())
        total, active = _parameters(c)
        return total - 3 * c.d_model * c.d_ff + expert, active

    config = checks_moe._mixtral_shaped(*checks_moe._CONFIGS[2])
    assert layers_counted(config) == _parameters(config)
    assert not check_moe_parameters(layers_counted)


def test_check_moe_parameters_fails_the_graders_own_count_even_after_a_graded_run():
    assert check_moe_parameters(_parameters)  # a graded run first: nothing it computed may serve the next answer
    assert not check_moe_parameters(lambda c: checks_moe._counted(_shape(c)))


def test_check_router_fails_the_librarys_balancing_loss():
    def with_library_loss(logits, k):
        experts, gates, _ = _router(logits, k)
        return experts, gates, load_balancing_loss(logits.softmax(-1), experts, logits.shape[-1])

    assert not check_router(with_library_loss)
    assert check_router(_router)


def test_check_router_fails_mixtrals_balancing_loss_divided_by_k():
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")

    def with_mixtral_loss(logits, k):
        experts, gates, _ = _router(logits, k)
        return experts, gates, modeling.load_balancing_loss_func((logits,), logits.shape[-1], k) / k

    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert float(with_mixtral_loss(logits, 2)[2]) == pytest.approx(float(_router(logits, 2)[2]), abs=1e-6)
    assert not check_router(with_mixtral_loss)


def test_check_all_to_all_bytes_fails_the_librarys_formula():
    assert not check_all_to_all_bytes(lambda k, r, d, v: all_to_all_bytes(torch.tensor(k), r, d, v))
    assert not check_all_to_all_bytes(lambda k, r, d, v: _bytes(k, r, d, v) + 8)  # a plausible wrong value
    assert check_all_to_all_bytes(_bytes)


def test_check_internode_rows_fails_the_graders_reference():
    assert checks_moe._internode_rows([[0, 3]], 0, 2) == _internode([[0, 3]], 0, 2)
    assert not check_internode_rows(checks_moe._internode_rows)
    assert check_internode_rows(_internode)
