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
torch 2.13 CPU, supports it), or, with ``impl="p2p"``, ours from send/recv (``_pairwise_all_to_all``:
N - 1 rounds, rank r sending to r + s and receiving from r - s in round s). Each adds the bytes it
sends to *other* ranks to the counters of ``p2p.traffic()``, so ``with traffic() as t:`` measures
forward and backward; a rank's own piece never leaves it. ``ExpertParallelStats`` reports the
forward's figures, and ``all_to_all_bytes`` is their formula from every rank's routing.

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
from .p2p import _exchange, count_sent
from .replicas import check_replicas_agree

__all__ = ["ExpertParallelMoE", "ExpertParallelStats", "all_to_all", "all_to_all_bytes", "all_reduce_replicated_grads"]

IMPLS = ("torch", "p2p")


@dataclass
class ExpertParallelStats(MoEStats):
    """``MoEStats`` of this rank's tokens, and what the forward pass moved."""

    rows_sent: list[int] = field(default_factory=list)  # token rows sent to each rank (own rank included)
    rows_received: list[int] = field(default_factory=list)  # rows received from each rank for our experts
    bytes_sent: int = 0  # to other ranks in the forward pass: counts, dispatch and combine


def _all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group, impl: str) -> torch.Tensor:
    """Send ``send_splits[j]`` rows of ``x`` to rank j; receive ``recv_splits[i]`` rows from rank i."""
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    if impl == "p2p":
        _pairwise_all_to_all(out, x.contiguous(), recv_splits, send_splits, group)  # _exchange counts the bytes
        return out
    rank = dist.get_rank(group)
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    sent = (sum(send_splits) - send_splits[rank]) * row_bytes  # p2p.traffic(): only what leaves this rank
    count_sent(sent, sum(1 for j, s in enumerate(send_splits) if s > 0 and j != rank))
    return out


def _pairwise_all_to_all(out: torch.Tensor, x: torch.Tensor, recv_splits, send_splits, group) -> None:
    """The all-to-all from send/recv: N - 1 rounds; in round s, rank r sends its piece for rank r + s
    and receives the piece of rank r - s (mod N), so every ordered pair exchanges once, and no rank
    sends to or receives from two ranks at once. Its own piece is a local copy."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    send_at = [sum(send_splits[:j]) for j in range(n)]  # where the piece for rank j starts in x
    recv_at = [sum(recv_splits[:i]) for i in range(n)]  # where the piece from rank i goes in out
    out[recv_at[rank] : recv_at[rank] + recv_splits[rank]] = x[send_at[rank] : send_at[rank] + send_splits[rank]]
    world = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    for step in range(1, n):
        dst, src = (rank + step) % n, (rank - step) % n
        piece = x[send_at[dst] : send_at[dst] + send_splits[dst]]  # rows: contiguous views
        into = out[recv_at[src] : recv_at[src] + recv_splits[src]]
        _exchange(piece, world(dst), into, world(src))


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all. Backward: the same all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, recv_splits, send_splits, group, impl):
        ctx.splits, ctx.group, ctx.impl = (recv_splits, send_splits), group, impl
        return _all_to_all(x, recv_splits, send_splits, group, impl)

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        return _all_to_all(grad, send_splits, recv_splits, ctx.group, ctx.impl), None, None, None, None


def all_to_all(
    x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group=None, impl: str = "torch"
) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` (M, ...) -> (sum(recv_splits), ...).

    ``impl="torch"``: ``dist.all_to_all_single``; ``impl="p2p"``: ours, N - 1 rounds of send/recv.
    """
    if impl not in IMPLS:
        raise ValueError(f"all_to_all impl must be one of {IMPLS}, got {impl!r}")
    n = dist.get_world_size(group)
    if len(recv_splits) != n or len(send_splits) != n:
        raise ValueError(f"all_to_all needs one split per rank ({n}), got {len(send_splits)} and {len(recv_splits)}")
    if sum(send_splits) != x.shape[0]:
        raise ValueError(f"send_splits add up to {sum(send_splits)} rows, but x has {x.shape[0]}")
    return _AllToAll.apply(x, recv_splits, send_splits, group, impl)


class ExpertParallelMoE(nn.Module):
    """This rank's share of ``moe``'s experts and a replica of its router: (B, T, d) -> (B, T, d), stats.

    Every rank builds the same full ``MoE`` (same seed; checked, ``replicas.py``) and keeps only its experts, as
    ``ParallelMLP`` keeps its shards; the parameter names of the kept ones change (``experts.0`` is
    global expert ``first_expert``).
    """

    def __init__(self, moe: MoE, group=None, impl: str = "torch"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"all_to_all impl must be one of {IMPLS}, got {impl!r}")
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        if moe.n_experts % n != 0:
            raise ValueError(
                f"expert parallelism: {moe.n_experts} experts do not split evenly over {n} ranks; "
                f"use a multiple of {n} experts"
            )
        check_replicas_agree({"": moe}, group, "ExpertParallelMoE")  # a router or expert from another seed
        self.group, self.world_size, self.d_model, self.impl = group, n, moe.d_model, impl
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
        pieces = [n_local] * n  # (E,) -> (E,) = (N, E/N): [i, e] from rank i, for our expert e
        recv_counts = _all_to_all(send_counts, pieces, pieces, self.group, self.impl).view(n, n_local)
        send_splits = send_counts.view(n, n_local).sum(1).tolist()  # rows to each rank
        recv_splits = recv_counts.sum(1).tolist()  # rows from each rank

        # 3. dispatch: (M, d) -> (R, d), ordered by source rank, then by our expert
        received = all_to_all(tokens[a.token], recv_splits, send_splits, self.group, self.impl)

        # 4. experts: regroup the rows by local expert (a stable sort), compute, restore the order
        local_expert = torch.arange(n_local).repeat(n).repeat_interleave(recv_counts.reshape(-1))  # (R,)
        order = torch.argsort(local_expert, stable=True)  # (R,)
        y_sorted = run_experts(self.experts, received[order], recv_counts.sum(0).tolist())  # (R, d)
        y = y_sorted[torch.argsort(order)]  # (R, d), in arrival order

        # 5. combine: each result back to its rank and row; scale by the gate; add into its token
        back = all_to_all(y, send_splits, recv_splits, self.group, self.impl)  # (M, d), in the order sent
        out = torch.zeros_like(tokens).index_add(0, a.token, back * a.gate[:, None])  # (N_tok, d)

        row_bytes = self.d_model * tokens.element_size()
        count_bytes = (self.n_experts - n_local) * send_counts.element_size()
        sent_rows = (sum(send_splits) - send_splits[rank]) + (sum(recv_splits) - recv_splits[rank])
        ep_stats = ExpertParallelStats(
            **vars(stats),
            rows_sent=send_splits,
            rows_received=recv_splits,
            bytes_sent=count_bytes + sent_rows * row_bytes,
        )
        return out.view_as(x), ep_stats


def all_to_all_bytes(
    kept: torch.Tensor, rank: int, d_model: int, bytes_per_value: int = 4, count_bytes: int = 8
) -> int:
    """Bytes rank ``rank`` sends to other ranks in one forward pass, from every rank's routing.

    ``kept`` (N, E): [i, e] the (token, expert) pairs rank i keeps for expert e. With R[i, j] the rows
    rank i sends to rank j (the sum of ``kept[i]`` over rank j's E/N experts), rank r sends

        (E - E/N) * count_bytes                    the counts for the other ranks' experts
        + sum_{j != r} R[r, j] * d * bytes         dispatch: its tokens to their experts
        + sum_{i != r} R[i, r] * d * bytes         combine: the results back to their ranks

    and the backward pass the two row terms again. With tokens spread evenly over the experts and
    none dropped, R[r, j] = n_tok * k / N, so each row term is n_tok * k * (N - 1) / N rows.
    """
    n, n_experts = kept.shape
    if n_experts % n:
        raise ValueError(f"{n_experts} experts do not split evenly over {n} ranks")
    rows = kept.reshape(n, n, n_experts // n).sum(-1)  # (N, N): [i, j] rows rank i sends to rank j
    out, back = rows[rank].sum() - rows[rank, rank], rows[:, rank].sum() - rows[rank, rank]
    return int((n_experts - n_experts // n) * count_bytes + (out + back) * d_model * bytes_per_value)


def all_reduce_replicated_grads(module: ExpertParallelMoE) -> None:
    """Sum the router's gradient over the ranks (the experts' are complete already); call after backward."""
    for p in module.router.parameters():
        if p.grad is None:  # every rank must take part in the all-reduce
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=module.group)
