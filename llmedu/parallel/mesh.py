"""3D parallelism: one world of DP x TP x PP processes, and our GPT trained with any layout.

The world's ranks are laid out on a grid (Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", sec. 3):

    rank = (pp * DP + dp) * TP + tp          tensor parallel fastest, then data, then pipeline

Tensor parallelism all-reduces activations twice per layer, forward and backward, so its groups are
neighbouring ranks (one node, the fastest links). Data parallelism all-reduces gradients once per
step; pipeline parallelism sends one activation per micro-batch between neighbouring stages, the
lightest traffic, so it can cross the slowest links. Each rank belongs to three groups:

    tp group    the TP ranks that together hold one stage's layers, split by ``tensor_parallel``
    pp group    the PP stages of one pipeline replica (same dp, same tp), in stage order
    dp group    the DP replicas of the same shard (same pp, same tp): gradients averaged here

A step: every pipeline replica runs its share of the batch through ``Pipeline.step`` (the loss on
the last stage is the vocabulary-parallel cross-entropy of its TP group), gradients are averaged
over the DP group, and every rank steps its own optimizer on its own shard.

Left out: ZeRO sharding of the optimizer state across the DP group, interleaved pipelines,
sequence and context parallelism, expert parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models.config import TransformerConfig
from ..models.gpt import CausalLM, lm_loss
from .pipeline_parallel import Pipeline, PipelineStage
from .tensor_parallel import check_tp_size, tensor_parallel, vocab_parallel_lm_loss

__all__ = ["Mesh", "make_mesh", "rank_of", "byte_batches", "train_3d"]


def rank_of(dp: int, tp: int, pp: int, sizes: tuple[int, int, int]) -> int:
    """The global rank at grid coordinates (dp, tp, pp) of a (DP, TP, PP) mesh."""
    DP, TP, _ = sizes
    return (pp * DP + dp) * TP + tp


@dataclass
class Mesh:
    """This rank's place on the grid and its three process groups."""

    dp: int
    tp: int
    pp: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    pp_ranks: list[int]  # global ranks of this rank's pipeline, stage 0 first


def make_mesh(dp: int, tp: int, pp: int) -> Mesh:
    """Build every DP, TP and PP group of the world (all ranks must call this, with the same sizes)."""
    for name, size in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    world, me = dist.get_world_size(), dist.get_rank()
    if dp * tp * pp != world:
        raise ValueError(f"dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp} is not the world size {world}")
    sizes = (dp, tp, pp)
    groups = {}
    # every rank creates every group, in the same order (new_group is a collective), and keeps its own
    for kind, members in (
        ("tp", [[rank_of(d, t, p, sizes) for t in range(tp)] for p in range(pp) for d in range(dp)]),
        ("dp", [[rank_of(d, t, p, sizes) for d in range(dp)] for p in range(pp) for t in range(tp)]),
        ("pp", [[rank_of(d, t, p, sizes) for p in range(pp)] for d in range(dp) for t in range(tp)]),
    ):
        for ranks in members:
            group = dist.new_group(ranks)
            if me in ranks:
                groups[kind] = (group, ranks)
    return Mesh(
        dp,
        tp,
        pp,
        dp_rank=groups["dp"][1].index(me),
        tp_rank=groups["tp"][1].index(me),
        pp_rank=groups["pp"][1].index(me),
        dp_group=groups["dp"][0],
        tp_group=groups["tp"][0],
        pp_group=groups["pp"][0],
        pp_ranks=groups["pp"][1],
    )


def byte_batches(text: str, batch: int, seq_len: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` batches (batch, seq_len) of random windows of ``text``'s UTF-8 bytes (vocabulary 256).

    Every window start in 0 .. N - seq_len is equally likely, the last one included (randint's upper
    bound is exclusive, hence the + 1); a text of exactly seq_len bytes has one window, itself.
    """
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()  # (N,)
    if data.numel() < seq_len:
        raise ValueError(f"a text of {data.numel()} bytes is too short for windows of {seq_len}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq_len + 1, (steps, batch), generator=g)  # (steps, batch)
    return [data[s[:, None] + torch.arange(seq_len)] for s in starts]  # each (batch, seq_len)


def train_3d(
    config: TransformerConfig,
    batches: list[torch.Tensor],
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    n_micro: int = 1,
    lr: float = 0.1,
    optimizer: str = "sgd",
    schedule: str = "1f1b",
    seed: int = 0,
) -> list[float]:
    """Train a fresh ``CausalLM(config)`` on ``batches`` with a DP x TP x PP layout; the loss of each step.

    Call it on every rank of a world of dp * tp * pp processes (from ``launch``). Every rank builds
    the same full model from ``seed`` and keeps its shard, so any layout starts from the same
    weights as one process. Each DP replica takes a contiguous 1/dp of every batch, cut into
    ``n_micro`` micro-batches. Returns the same list of losses on every rank.
    """
    mesh = make_mesh(dp, tp, pp)
    check_tp_size(
        tp, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, d_ff=config.d_ff, vocab_size=config.vocab_size
    )
    torch.manual_seed(seed)
    model = CausalLM(config)
    if tp > 1:
        model = tensor_parallel(model, mesh.tp_group)
        loss_fn = lambda logits, ids: vocab_parallel_lm_loss(logits, ids, mesh.tp_group)  # noqa: E731
    else:
        loss_fn = lm_loss
    stage = PipelineStage(model, mesh.pp_rank, pp)
    del model
    act_shape = lambda ids: (*ids.shape, config.d_model)  # noqa: E731
    # activations cross in the model's dtype (float64 when the caller made that the default)
    pipe = Pipeline(stage, mesh.pp_ranks, loss_fn, act_shape, dtype=torch.get_default_dtype())
    params = list(stage.parameters())
    opt = torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.AdamW(params, lr=lr)
    losses = []
    for batch in batches:
        if batch.shape[0] % (dp * n_micro):
            raise ValueError(f"a batch of {batch.shape[0]} does not split into {dp} replicas x {n_micro} micro-batches")
        mine = batch.chunk(dp)[mesh.dp_rank]  # (batch / dp, T)
        opt.zero_grad(set_to_none=False)
        loss = pipe.step(mine, mine, n_micro, schedule)
        for p in params:  # data parallelism: the mean of the replicas' gradients
            dist.all_reduce(p.grad, group=mesh.dp_group)
            p.grad /= dp
        opt.step()
        loss = torch.zeros(()) if loss is None else loss.detach().clone()
        dist.all_reduce(loss, group=mesh.dp_group)  # the mean over replicas: the loss of the whole batch
        dist.broadcast(loss, src=mesh.pp_ranks[-1], group=mesh.pp_group)  # from the last stage to all
        losses.append(loss.item() / dp)
    return losses
