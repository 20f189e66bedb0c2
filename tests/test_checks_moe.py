"""The graders of lesson 21 (llmedu.checks.moe) pass our answers and fail plausible wrong ones."""

import math

import torch

from llmedu.checks.moe import (
    check_all_to_all_bytes,
    check_dropped,
    check_internode_rows,
    check_moe_parameters,
    check_router,
)


def _dropped(choices, n_experts, capacity_factor, token_major=False, floor=False):
    n, k = len(choices), len(choices[0])
    capacity = (math.floor if floor else math.ceil)(capacity_factor * n * k / n_experts)
    order = (
        [(t, j) for t in range(n) for j in range(k)] if token_major else [(t, j) for j in range(k) for t in range(n)]
    )
    used, dropped = [0] * n_experts, []
    for t, j in order:
        e = choices[t][j]
        if used[e] < capacity:
            used[e] += 1
        else:
            dropped.append((t, j))
    return capacity, sorted(dropped)


def test_check_dropped():
    assert check_dropped(_dropped)
    assert not check_dropped(lambda c, e, cf: _dropped(c, e, cf, token_major=True))  # token 0's choices first
    assert not check_dropped(lambda c, e, cf: _dropped(c, e, cf, floor=True))  # floor instead of ceil


def _parameters(config, router=True):
    c, m = config, config.moe
    kv = c.n_kv_heads * c.head_dim
    attention = 2 * c.d_model * c.d_model + 2 * c.d_model * kv
    expert = 3 * c.d_model * c.d_ff
    layer_rest = attention + 2 * c.d_model + (m.n_experts * c.d_model if router else 0)  # norms, router
    outer = 2 * c.vocab_size * c.d_model + c.d_model  # embeddings, untied head, final norm
    total = c.n_layers * (layer_rest + m.n_experts * expert) + outer
    active = c.n_layers * (layer_rest + m.top_k * expert) + outer
    return total, active


def test_check_moe_parameters():
    assert check_moe_parameters(_parameters)
    assert not check_moe_parameters(lambda c: _parameters(c, router=False))  # forgot the router
    assert not check_moe_parameters(lambda c: (_parameters(c)[0], _parameters(c)[0]))  # every expert active


def _router(logits, top_k, renormalize=True, per_token=False):
    probs = logits.softmax(-1)
    top_p, experts = probs.topk(top_k, dim=-1)
    gates = top_p / top_p.sum(-1, keepdim=True) if renormalize else top_p
    n, e = logits.shape
    f = torch.bincount(experts.reshape(-1), minlength=e).double() / (n * top_k)  # share of the assignments
    aux = e * (f * probs.mean(0)).sum() * (top_k if per_token else 1)
    return experts, gates, aux


def test_check_router():
    assert check_router(_router)
    # the softmax over the k chosen logits is the same as renormalising: a correct alternative
    assert check_router(lambda x, k: (x.topk(k, -1).indices, x.topk(k, -1).values.softmax(-1), _router(x, k)[2]))
    assert not check_router(lambda x, k: _router(x, k, renormalize=False))  # Switch's gates, not Mixtral's

    def float32_counts(x, k):  # the lesson's minimal fix: bincount / (N k) in the default float32
        experts, gates, _ = _router(x, k)
        probs = x.softmax(-1)
        f = torch.bincount(experts.flatten(), minlength=x.shape[-1]) / (x.shape[0] * k)  # float32
        return experts, gates, x.shape[-1] * (f * probs.mean(0)).sum()

    assert check_router(float32_counts)
    assert not check_router(lambda x, k: _router(x, k, per_token=True))  # f counted per token: k times larger


def _bytes(kept, rank, d, v, own=False, combine=True):
    n, e = len(kept), len(kept[0])
    rows = [[sum(kept[i][j * e // n : (j + 1) * e // n]) for j in range(n)] for i in range(n)]
    out = sum(rows[rank][j] for j in range(n) if own or j != rank)
    back = sum(rows[i][rank] for i in range(n) if own or i != rank) if combine else 0
    return (e - e // n) * 8 + (out + back) * d * v


def test_check_all_to_all_bytes():
    assert check_all_to_all_bytes(_bytes)
    # the library's all_to_all_bytes gives the right number the wrong way: tests/test_graders_21.py
    assert not check_all_to_all_bytes(lambda k, r, d, v: _bytes(k, r, d, v, own=True))  # own rows never leave
    assert not check_all_to_all_bytes(lambda k, r, d, v: _bytes(k, r, d, v, combine=False))  # results come back


def _internode(choices, home, per_node, count_home=False, per_expert=False, per_token=False):
    flat = sum(1 for c in choices for e in c if count_home or e // per_node != home)
    nodes = [{e // per_node for e in c} - ({-1} if count_home else {home}) for c in choices]
    once = flat if per_expert else sum(min(len(n), 1) if per_token else len(n) for n in nodes)
    return flat, once


def test_check_internode_rows():
    assert check_internode_rows(_internode)
    assert not check_internode_rows(lambda c, h, p: _internode(c, h, p, count_home=True))  # home rows stay home
    assert not check_internode_rows(lambda c, h, p: _internode(c, h, p, per_expert=True))  # no saving at all
    assert not check_internode_rows(lambda c, h, p: _internode(c, h, p, per_token=True))  # one node per token
    assert not check_internode_rows(lambda c, h, p: _internode(c, h, p)[::-1])  # (once, flat)
