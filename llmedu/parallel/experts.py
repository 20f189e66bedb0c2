"""Expert parallelism: the E experts of a mixture-of-experts layer split over N ranks.

GShard (Lepikhin et al. 2020, sec. 2.2-3) and Switch Transformer (Fedus et al. 2021, sec. 2.2):
rank r holds experts ``r * E/N .. (r + 1) * E/N - 1`` and is, for everything else, a data-parallel
rank with its own tokens. One forward pass of ``ExpertParallelMoE`` on rank r:

    1. route    the router (replicated) picks k experts for each of this rank's tokens and applies
                the capacity, counted on this rank's tokens (each rank is one GShard "group");
                the kept (token, expert) pairs are sorted by expert, so by destination rank too
    2. counts   all-to-all of the per-expert counts (E,): rank r learns how many rows each rank
                sends to each of its experts, and so the sizes of what it will receive
    3. dispatch all-to-all of the token rows, uneven splits: (M, d) -> (R, d), grouped by source
    4. experts  the rows regrouped by local expert, each expert on its slice, put back in order
    5. combine  the reverse all-to-all: each result returns to the rank and row it came from,
                is scaled by its gate and added into its token's output row

The backward pass of an all-to-all is the all-to-all with the splits swapped (``_AllToAll``), so
gradients retrace the same route: an expert's weight gradient sums the tokens of *every* rank,
and needs no all-reduce. The router (and any other non-expert weight) is replicated and sees only
this rank's tokens: its gradient is all-reduced over the ranks (``all_reduce_replicated_grads``),
exactly as under data parallelism. We take the global loss to be the **sum** of the ranks' losses;
for the mean that DDP computes, divide each rank's loss by N before ``backward`` (the expert
gradients then come out averaged too, and the all-reduce stays a sum). One process running the
same layer on each rank's tokens in turn, with the losses summed, computes the same outputs and
gradients; with no token dropped and no auxiliary loss, so does one run on the concatenation.
The auxiliary loss is each rank's, on its own tokens, as in Switch's implementation.

The all-to-alls are ``torch.distributed.all_to_all_single`` with uneven split sizes (gloo, on
torch 2.13 CPU, supports it). Each call adds the bytes it sends to *other* ranks to the counters
of ``p2p.traffic()``, so ``with traffic() as t:`` measures forward and backward; a rank's own
piece never leaves it. ``ExpertParallelStats`` reports the forward's figures.

Left out: expert parallelism over a subgroup with data parallelism across groups (the expert
weights would then need an all-reduce over the ranks holding the same experts), overlapping the
all-to-all with computation, hierarchical all-to-all across nodes, and capacity counted over the
global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..nn.moe import MoE, MoEStats, run_experts
from .p2p import count_sent

__all__ = ["ExpertParallelMoE", "ExpertParallelStats", "all_to_all", "all_reduce_replicated_grads"]


@dataclass
class ExpertParallelStats(MoEStats):
    """``MoEStats`` of this rank's tokens, and what the forward pass moved."""

    rows_sent: list[int] = field(default_factory=list)  # token rows sent to each rank (own rank included)
    rows_received: list[int] = field(default_factory=list)  # rows received from each rank for our experts
    bytes_sent: int = 0  # to other ranks in the forward pass: counts, dispatch and combine


def _all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """Send ``send_splits[j]`` rows of ``x`` to rank j; receive ``recv_splits[i]`` rows from rank i."""
    rank = dist.get_rank(group)
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    sent = (sum(send_splits) - send_splits[rank]) * row_bytes  # p2p.traffic(): only what leaves this rank
    count_sent(sent, sum(1 for j, s in enumerate(send_splits) if s > 0 and j != rank))
    return out


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all. Backward: the same all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        return _all_to_all(x, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        return _all_to_all(grad, send_splits, recv_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group=None) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` (M, ...) -> (sum(recv_splits), ...)."""
    return _AllToAll.apply(x, recv_splits, send_splits, group)


class ExpertParallelMoE(nn.Module):
    """This rank's share of ``moe``'s experts and a replica of its router: (B, T, d) -> (B, T, d), stats.

    Every rank builds the same full ``MoE`` (same seed) and keeps only its experts, as
    ``ParallelMLP`` keeps its shards; the parameter names of the kept ones change (``experts.0`` is
    global expert ``first_expert``).
    """

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        if moe.n_experts % n != 0:
            raise ValueError(
                f"expert parallelism: {moe.n_experts} experts do not split evenly over {n} ranks; "
                f"use a multiple of {n} experts"
            )
        self.group, self.world_size, self.d_model = group, n, moe.d_model
        self.n_experts, self.n_local = moe.n_experts, moe.n_experts // n
        self.first_expert = rank * self.n_local
        self.router = moe.router  # replicated: data-parallel
        self.experts = nn.ModuleList(moe.experts[self.first_expert : self.first_expert + self.n_local])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ExpertParallelStats]:  # (..., d)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"expected inputs of d_model={self.d_model} features, got shape {tuple(x.shape)}")
        n, n_local, rank = self.world_size, self.n_local, dist.get_rank(self.group)
        tokens = x.reshape(-1, self.d_model)  # (N_tok, d)
        a, stats = self.router(tokens)  # 1. route: pairs sorted by expert, so by destination rank

        # 2. counts: piece j of our (E,) kept counts is for rank j's experts; we get (N, E/N)
        send_counts = a.kept  # (E,)
        recv_counts = torch.empty_like(send_counts)  # (E,) = (N, E/N): [i, e] from rank i, for our expert e
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        recv_counts = recv_counts.view(n, n_local)
        send_splits = send_counts.view(n, n_local).sum(1).tolist()  # rows to each rank
        recv_splits = recv_counts.sum(1).tolist()  # rows from each rank

        # 3. dispatch: (M, d) -> (R, d), ordered by source rank, then by our expert
        received = all_to_all(tokens[a.token], recv_splits, send_splits, self.group)

        # 4. experts: regroup the rows by local expert (a stable sort), compute, restore the order
        local_expert = torch.arange(n_local).repeat(n).repeat_interleave(recv_counts.reshape(-1))  # (R,)
        order = torch.argsort(local_expert, stable=True)  # (R,)
        y_sorted = run_experts(self.experts, received[order], recv_counts.sum(0).tolist())  # (R, d)
        y = y_sorted[torch.argsort(order)]  # (R, d), in arrival order

        # 5. combine: each result back to its rank and row; scale by the gate; add into its token
        back = all_to_all(y, send_splits, recv_splits, self.group)  # (M, d), in the order sent
        out = torch.zeros_like(tokens).index_add(0, a.token, back * a.gate[:, None])  # (N_tok, d)

        row_bytes = self.d_model * tokens.element_size()
        count_bytes = (self.n_experts - n_local) * send_counts.element_size()
        count_sent(count_bytes, n - 1)  # the counts all-to-all, which _all_to_all did not see
        sent_rows = (sum(send_splits) - send_splits[rank]) + (sum(recv_splits) - recv_splits[rank])
        ep_stats = ExpertParallelStats(
            **vars(stats),
            rows_sent=send_splits,
            rows_received=recv_splits,
            bytes_sent=count_bytes + sent_rows * row_bytes,
        )
        return out.view_as(x), ep_stats


def all_reduce_replicated_grads(module: ExpertParallelMoE) -> None:
    """Sum the router's gradient over the ranks (the experts' are complete already); call after backward."""
    for p in module.router.parameters():
        if p.grad is None:  # every rank must take part in the all-reduce
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=module.group)
