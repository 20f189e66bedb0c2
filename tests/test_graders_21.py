"""The graders of lesson 21 fail a right value computed the wrong way: by asking the library for it."""

import torch
from test_checks_moe import _bytes, _dropped, _parameters, _router

from llmedu.checks.moe import check_all_to_all_bytes, check_dropped, check_moe_parameters, check_router
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


def test_check_router_fails_the_librarys_balancing_loss():
    def with_library_loss(logits, k):
        experts, gates, _ = _router(logits, k)
        return experts, gates, load_balancing_loss(logits.softmax(-1), experts, logits.shape[-1])

    assert not check_router(with_library_loss)
    assert check_router(_router)


def test_check_all_to_all_bytes_fails_the_librarys_formula():
    assert not check_all_to_all_bytes(lambda k, r, d, v: all_to_all_bytes(torch.tensor(k), r, d, v))
    assert not check_all_to_all_bytes(lambda k, r, d, v: _bytes(k, r, d, v) + 8)  # a plausible wrong value
    assert check_all_to_all_bytes(_bytes)
