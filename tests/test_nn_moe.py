"""The mixture-of-experts layer against a loop over tokens, its capacity, and its auxiliary losses.

The reference routes each token on its own and adds ``gate * expert(x)`` over its top-k experts:
the sorted, batched dispatch of ``moe.py`` must give the same output and gradients (float64, so
1e-6 leaves only a different order of additions). The capacity and loss tests use hand-made routings.
"""

import math

import pytest
import torch

from llmedu.nn.moe import MoE, assign, expert_capacity, load_balancing_loss, router_z_loss


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time: softmax over the router's logits, top-k, renormalise, sum of gated experts."""
    rows = []
    for token in x.reshape(-1, x.shape[-1]):  # (d,)
        probs = moe.router.linear(token).softmax(-1)  # (E,)
        top_p, top_e = probs.topk(moe.router.top_k)
        gates = top_p / top_p.sum() if moe.router.renormalize else top_p
        rows.append(sum(g * moe.experts[int(e)](token) for g, e in zip(gates, top_e)))
    return torch.stack(rows).view_as(x)


def _grads(module) -> list[torch.Tensor]:  # an expert no token chose has no gradient in the loop: zero
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize(
    "top_k, capacity_factor, renormalize, activation",
    [(1, None, False, "gelu"), (2, None, True, "swiglu"), (2, 2.0, True, "gelu"), (4, 1.0, True, "gelu")],
)
def test_equals_a_loop_over_tokens(top_k, capacity_factor, renormalize, activation):
    # capacity_factor E / k makes C = tokens: nothing can be dropped; k = E = 4 is a dense mixture
    torch.manual_seed(0)
    moe = MoE(8, 16, n_experts=4, top_k=top_k, capacity_factor=capacity_factor, renormalize=renormalize)
    moe = moe.double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    w = torch.randn(2, 5, 8, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, stats = moe(xa)
    (out * w).sum().backward()
    ours = _grads(moe)
    moe.zero_grad()
    expected = _reference(moe, xb)
    (expected * w).sum().backward()
    assert stats.dropped == 0 and int(stats.kept_per_expert.sum()) == 10 * top_k
    assert (out - expected).abs().max() < 1e-6
    assert (xa.grad - xb.grad).abs().max() < 1e-6
    for mine, theirs in zip(ours, _grads(moe), strict=True):
        assert (mine - theirs).abs().max() < 1e-6


def test_all_experts_is_the_softmax_weighted_sum():
    torch.manual_seed(0)
    moe = MoE(8, 16, n_experts=3, top_k=3, capacity_factor=None).double()
    x = torch.randn(7, 8, dtype=torch.float64)
    probs = moe.router.linear(x).softmax(-1)  # (N, E)
    dense = sum(probs[:, e : e + 1] * moe.experts[e](x) for e in range(3))
    assert (moe(x)[0] - dense).abs().max() < 1e-6


def test_capacity_drops_and_counts():
    # six tokens, top-1, two experts; five choose expert 0. C = ceil(1.0 * 6 * 1 / 2) = 3
    experts = torch.tensor([[0], [0], [0], [0], [1], [0]])
    a = assign(experts, torch.ones(6, 1), n_experts=2, capacity=expert_capacity(6, 2, 1, 1.0))
    assert a.capacity == 3
    assert a.routed.tolist() == [5, 1] and a.kept.tolist() == [3, 1]
    assert a.token.tolist() == [0, 1, 2, 4]  # first come, first served: tokens 3 and 5 are dropped
    assert a.expert.tolist() == [0, 0, 0, 1]
    # top-2: every first choice before any second choice (GShard), whatever the token order
    experts = torch.tensor([[1, 0], [0, 1], [0, 1]])
    a = assign(experts, torch.ones(3, 2), n_experts=2, capacity=2)
    assert a.routed.tolist() == [3, 3] and a.kept.tolist() == [2, 2]
    assert a.token.tolist() == [1, 2, 0, 1]  # expert 0: firsts of tokens 1, 2; expert 1: first of 0, second of 1


def test_dropped_tokens_get_zero_output():
    torch.manual_seed(0)
    moe = MoE(8, 16, n_experts=4, top_k=1, capacity_factor=0.5)
    x = torch.randn(3, 8, 8)
    out, stats = moe(x)
    assert stats.capacity == math.ceil(0.5 * 24 * 1 / 4) == 3
    assert stats.kept_per_expert.tolist() == stats.tokens_per_expert.clamp(max=3).tolist()
    assert stats.dropped == 24 - int(stats.kept_per_expert.sum()) > 0
    zero_rows = (out.reshape(24, 8) == 0).all(-1).sum().item()  # top-1: a dropped token has no expert at all
    assert zero_rows == stats.dropped


def test_load_balancing_loss_on_a_hand_made_routing():
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [0.2, 0.8]])
    experts = torch.tensor([[0], [0], [0], [1]])  # f = (3/4, 1/4), P = (0.6, 0.4)
    assert load_balancing_loss(probs, experts, 2).item() == pytest.approx(2 * (0.75 * 0.6 + 0.25 * 0.4))
    uniform = torch.full((8, 4), 0.25)
    balanced = torch.tensor([[0, 1], [2, 3]] * 4)  # top-2, every expert chosen equally often
    assert load_balancing_loss(uniform, balanced, 4).item() == pytest.approx(1.0)
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    z = (math.log(2) ** 2 + math.log(math.e + math.e**2) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(z)


def test_the_losses_reach_the_router():
    torch.manual_seed(0)
    moe = MoE(8, 16, n_experts=4, top_k=2)
    _, stats = moe(torch.randn(10, 8))
    (stats.aux_loss + stats.z_loss).backward()
    assert moe.router.linear.weight.grad.abs().sum() > 0


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="top_k must be in 1..n_experts=4"):
        MoE(8, 16, n_experts=4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoE(8, 16, n_experts=4, capacity_factor=0.0)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoE(8, 16, n_experts=4, capacity_factor=-1.0)
    with pytest.raises(ValueError, match="d_model=8"):
        MoE(8, 16, n_experts=4)(torch.randn(2, 7))


def test_equals_mixtrals_sparse_moe_block():
    """Our layer with Mixtral's settings against ``transformers``' ``MixtralSparseMoeBlock``, same weights.

    Mixtral (Jiang et al. 2024): top-2 of 8 SwiGLU experts, gates renormalised over the two, no
    capacity limit, no biases. Their experts are stacked 3-D tensors, the gate and up projections
    fused as ``gate_up_proj`` (E, 2 d_ff, d), gate first. In fp32 the two compute the same sums in
    different orders: 1e-5 is a few ulps of outputs of order 0.1-1. Their load-balancing loss counts
    the assignments per token (its f sums to k) where Switch's (ours) counts them per assignment
    (f sums to 1), so theirs is k times ours.
    """
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

    d, d_ff, n_experts, k = 16, 24, 8, 2
    config = MixtralConfig(
        hidden_size=d, intermediate_size=d_ff, num_local_experts=n_experts, num_experts_per_tok=k, hidden_act="silu"
    )
    torch.manual_seed(0)
    theirs = MixtralSparseMoeBlock(config).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = MoE(d, d_ff, n_experts, k, capacity_factor=None, activation="swiglu", bias=False, renormalize=True)
    with torch.no_grad():
        ours.router.linear.weight.copy_(theirs.gate.weight)  # (E, d)
        for e, expert in enumerate(ours.experts):
            gate, up = theirs.experts.gate_up_proj[e].chunk(2, dim=0)  # each (d_ff, d)
            expert.gate_proj.weight.copy_(gate)
            expert.up_proj.weight.copy_(up)
            expert.down_proj.weight.copy_(theirs.experts.down_proj[e])  # (d, d_ff)
    x = torch.randn(3, 10, d)
    with torch.no_grad():
        expected = theirs(x.clone())
        got, stats = ours(x)
        logits = theirs.gate(x.reshape(-1, d))[0]  # (N, E)
    print(f"max |ours - Mixtral| = {(got - expected).abs().max():.2e}")
    assert (got - expected).abs().max() < 1e-5
    assert stats.dropped == 0
    their_aux = load_balancing_loss_func((logits,), n_experts, k)
    assert their_aux.item() == pytest.approx(k * stats.aux_loss.item(), rel=1e-6)
