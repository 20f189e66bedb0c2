"""Mixture of experts: a router sends each token to k of E feed-forward networks.

Shazeer et al. 2017, "Outrageously Large Neural Networks" (the sparsely-gated layer); GShard,
Lepikhin et al. 2020 (top-2, expert capacity); Switch Transformer, Fedus et al. 2021 (top-1,
capacity factor, load-balancing loss, eq. 4-6); ST-MoE, Zoph et al. 2022 (router z-loss, eq. 5).
For one token x (d,), with the router's weight W_r (E, d):

    logits = W_r x                             (E,)
    p      = softmax(logits)                   (E,)
    S      = the k experts of largest p
    g_e    = p_e / sum_{j in S} p_j, e in S    renormalize=True (Mixtral; Shazeer 2017's softmax over
                                               the k kept logits is the same); False keeps g_e = p_e
                                               (Switch, whose k = 1: renormalised, its gate would be 1)
    y      = sum_{e in S} g_e * FFN_e(x)

The gates g are differentiable, and are the router's only path to a gradient from the output.

**Capacity.** So that experts run as fixed-size batches (and, split over devices, receive
bounded messages), expert e accepts at most ``C = ceil(capacity_factor * tokens * k / E)``
(token, expert) assignments. Those over it are dropped: that expert adds nothing to the token,
whose residual connection (outside this layer) carries it on unchanged. Priority as in GShard:
every first choice before any second choice, and within one choice, tokens in order.
``capacity_factor=None`` drops nothing.

**Load-balancing loss** (Switch eq. 4): ``aux = E * sum_i f_i * P_i``, with f_i the fraction of
the N * k assignments routed to expert i (before capacity) and P_i the mean over tokens of p_i.
f is a count and carries no gradient; P does, and the loss pushes probability away from the
experts that are over-used. Perfect balance gives 1 for every k (Hugging Face's Mixtral loss
divides the counts by N, not N * k, and so gives k). **Router z-loss** (ST-MoE eq. 5):
``z = mean over tokens of logsumexp(logits)^2``, which keeps the logits small. Both are returned
in ``MoEStats``; the training loop adds them to its loss with small coefficients (Switch:
0.01 * aux; ST-MoE: 0.001 * z).

**Dispatch.** The kept assignments are stably sorted by expert, so each expert's tokens form one
contiguous slice: gather the rows, run each expert on its slice, scale by the gates, and add the
results back into their tokens' rows (``index_add``). GShard and Switch instead build a one-hot
(N, E, C) dispatch tensor and use einsums, a formulation made for the static shapes of TPUs.

Left out: the noise of noisy top-k gating (Shazeer 2017), GShard's random routing of the second
expert, expert-choice routing (Zhou et al. 2022), shared experts (DeepSeekMoE), dropless grouped
matmuls (MegaBlocks), and the router's input jitter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .activations import FeedForward

__all__ = [
    "MoE",
    "MoEFeedForward",
    "Router",
    "Assignment",
    "MoEStats",
    "expert_capacity",
    "assign",
    "load_balancing_loss",
    "router_z_loss",
    "run_experts",
]


@dataclass
class Assignment:
    """The kept (token, expert) pairs, sorted by expert: expert e's pairs are a contiguous slice."""

    token: torch.Tensor  # (M,) which token (row of the flattened input)
    expert: torch.Tensor  # (M,) which expert, non-decreasing
    gate: torch.Tensor  # (M,) its gate weight
    kept: torch.Tensor  # (E,) pairs kept per expert (M in all)
    routed: torch.Tensor  # (E,) pairs routed to each expert before capacity (N * k in all)
    capacity: int | None


@dataclass
class MoEStats:
    """What one forward pass of the layer did, and its auxiliary losses (differentiable)."""

    tokens_per_expert: torch.Tensor  # (E,) assignments routed to each expert, before capacity
    kept_per_expert: torch.Tensor  # (E,) assignments each expert computed
    dropped: int  # assignments over capacity: tokens * k - kept_per_expert.sum()
    capacity: int | None  # C, or None for no limit
    aux_loss: torch.Tensor  # () Switch's load-balancing loss
    z_loss: torch.Tensor  # () ST-MoE's router z-loss


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """``ceil(capacity_factor * n_tokens * top_k / n_experts)``: assignments one expert accepts."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def assign(experts: torch.Tensor, gates: torch.Tensor, n_experts: int, capacity: int | None) -> Assignment:
    """Sort the (token, expert) pairs of a top-k routing by expert and drop those over capacity.

    ``experts`` and ``gates`` are (N, k): token t's j-th choice and its gate. Priority within an
    expert: all first choices (in token order), then all second choices, and so on.
    """
    n, k = experts.shape
    expert = experts.t().reshape(-1)  # (k N,): every first choice, then every second choice, ...
    token = torch.arange(n, device=experts.device).repeat(k)  # (k N,)
    gate = gates.t().reshape(-1)  # (k N,)
    order = torch.argsort(expert, stable=True)  # stable: each expert's queue keeps the priority order
    expert, token, gate = expert[order], token[order], gate[order]
    routed = torch.bincount(expert, minlength=n_experts)  # (E,)
    starts = routed.cumsum(0) - routed  # (E,) where each expert's queue begins
    place = torch.arange(expert.numel(), device=expert.device) - starts[expert]  # (k N,) place in its queue
    keep = place < capacity if capacity is not None else torch.ones_like(place, dtype=torch.bool)
    kept = torch.bincount(expert[keep], minlength=n_experts)
    return Assignment(token[keep], expert[keep], gate[keep], kept, routed, capacity)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch eq. 4: ``E * sum_i f_i * P_i``. ``probs`` (N, E) router probabilities, ``experts`` (N, k) choices."""
    f = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype) / experts.numel()  # (E,)
    p = probs.mean(dim=0)  # (E,)
    return n_experts * (f * p).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE eq. 5: the mean over tokens of ``logsumexp(logits)^2``. ``logits`` (N, E)."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def run_experts(experts: Sequence[nn.Module], x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Expert i on the i-th slice of ``x`` (M, d), the slices being ``counts`` rows long; (M, d)."""
    return torch.cat([expert(rows) for expert, rows in zip(experts, x.split(list(counts)), strict=True)])


class Router(nn.Module):
    """A linear map to E logits, softmax, top-k, gates, capacity: the routing of ``x`` (N, d)."""

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int = 2,
        capacity_factor: float | None = 1.25,
        renormalize: bool = True,
    ):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in 1..n_experts={n_experts}, got top_k={top_k}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None for no limit), got {capacity_factor}")
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor, self.renormalize = capacity_factor, renormalize
        self.linear = nn.Linear(d_model, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[Assignment, MoEStats]:  # x: (N, d)
        logits = self.linear(x)  # (N, E)
        probs = logits.float().softmax(dim=-1)  # (N, E), in fp32 as Switch advises
        top_p, experts = probs.topk(self.top_k, dim=-1)  # (N, k), (N, k)
        gates = top_p / top_p.sum(dim=-1, keepdim=True) if self.renormalize else top_p
        capacity = expert_capacity(x.shape[0], self.n_experts, self.top_k, self.capacity_factor)
        a = assign(experts, gates.to(x.dtype), self.n_experts, capacity)
        stats = MoEStats(
            tokens_per_expert=a.routed,
            kept_per_expert=a.kept,
            dropped=int(a.routed.sum() - a.kept.sum()),
            capacity=capacity,
            aux_loss=load_balancing_loss(probs, experts, self.n_experts),
            z_loss=router_z_loss(logits),
        )
        return a, stats


class MoE(nn.Module):
    """Top-k routed mixture of ``n_experts`` ``FeedForward`` networks: (B, T, d) -> (B, T, d), stats."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int = 2,
        capacity_factor: float | None = 1.25,
        activation: str = "gelu",
        bias: bool = True,
        renormalize: bool = True,
        fused: bool = False,
    ):
        super().__init__()
        if n_experts < 1:
            raise ValueError(f"n_experts must be >= 1, got {n_experts}")
        self.d_model, self.n_experts = d_model, n_experts
        self.router = Router(d_model, n_experts, top_k, capacity_factor, renormalize)
        self.experts = nn.ModuleList(FeedForward(d_model, d_ff, activation, bias, fused) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:  # (..., d)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"expected inputs of d_model={self.d_model} features, got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, self.d_model)  # (N, d)
        a, stats = self.router(tokens)
        y = run_experts(self.experts, tokens[a.token], a.kept.tolist())  # (M, d), sorted by expert
        out = torch.zeros_like(tokens).index_add(0, a.token, y * a.gate[:, None])  # (N, d)
        return out.view_as(x), stats


class MoEFeedForward(MoE):
    """An ``MoE`` that fits a block's FFN slot: (B, T, d) -> (B, T, d), its stats kept in ``self.stats``.

    A block calls its FFN as ``self.mlp(h)`` and adds a tensor; the auxiliary losses must still reach
    the training loss, so the last forward's ``MoEStats`` stay on the layer until the next forward
    (``Transformer.moe_loss`` collects them). They hold the aux losses' graph until then.
    """

    stats: MoEStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., d)
        out, self.stats = super().forward(x)
        return out

    def projections(self) -> list[nn.Linear]:
        """Every expert's matrices (what ``deepnorm_init_`` and the GPT-2 init scale), router excluded."""
        return [p for expert in self.experts for p in expert.projections()]
