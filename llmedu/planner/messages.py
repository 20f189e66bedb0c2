"""The messages a layout sends, counted from our wrappers' code: how many, of what kind, how many bytes.

``step_time`` prices these messages in seconds; this module only counts them, for one ``Layout`` of a
``TransformerConfig`` and a ``Batch`` (what each rank holds comes from ``memory``):

    tp_collective_counts, tp_collectives   the tensor-parallel all-reduces of one micro-batch slot
                                           (Megatron-LM's f and g, and the vocabulary-parallel ends)
    dp_pieces, dp_collectives              the data-parallel sync of one step: DDP's bucket all-reduces,
                                           ZeRO's reduce-scatters and all-gathers of each unit
    messages_per_micro_batch, ...step      the blocking messages of the busiest rank, by kind
    hops, blocking_hops                    the ring steps of those messages: each wakes a process, and
                                           where ranks share one CPU each pays a measured wait
                                           (``shared_cores``, ``step_time``'s "waits")

The counts are checked against what our wrappers really send (tests/test_planner_shared_cores.py counts
the collectives of ``tensor_parallel``, ``DDP`` and ``ZeRO`` as they run).

Left out: sequence parallelism's all-gathers and reduce-scatters are counted as the all-reduces they
replace (the same bytes); messages that do not block the busiest rank are not counted.
"""

from __future__ import annotations

import math

from ..models.config import TransformerConfig
from .memory import BF16, Batch, Layout, held_parameters, stage_layers

__all__ = [
    "tp_collective_counts",
    "tp_collectives",
    "dp_pieces",
    "dp_collectives",
    "messages_per_micro_batch",
    "messages_per_step",
    "hops",
    "blocking_hops",
]

DDP_BUCKET = 25 * 2**20  # bytes: torch DDP's default bucket (ours too)


def tp_collective_counts(cfg: TransformerConfig, layout: Layout) -> dict[str, int]:
    """All-reduces of the busiest pipeline stage's tensor-parallel group in one micro-batch slot, by kind, as
    our wrapper sends them (``tensor_parallel``; Megatron-LM's are the same, Shoeybi et al. 2019 §3):

    layers      4 a layer: f and g around attention and around the MLP, one forward and one backward each
                (2 more forward with full recomputation, which reruns each layer's forward)
    vocabulary  the embedding's g (forward, first stage) and the head's f (backward, last stage)
    loss        the vocabulary-parallel cross-entropy's max, sum of exponentials and target logit (forward,
                last stage)

    The busiest stage is the last (with a pipeline it has the head and the loss, not the embedding)."""
    if layout.tp == 1:
        return {"layers": 0, "vocabulary": 0, "loss": 0}
    layers = stage_layers(cfg, layout) * (4 + 2 * (layout.recompute == "full"))
    return {"layers": layers, "vocabulary": 2 if layout.pp == 1 else 1, "loss": 3}


def tp_collectives(cfg: TransformerConfig, layout: Layout, batch: Batch, v: int = BF16) -> dict[str, tuple[int, float]]:
    """``tp_collective_counts``, each kind as (all-reduces in one micro-batch slot, bytes of each buffer): the
    layers' and the vocabulary's b (s/cp) h values of ``v`` bytes; the loss's one fp32 number a token (the
    wrapper casts the logits to fp32; the shift of ``lm_loss`` drops one token a sequence, left out)."""
    tokens = layout.micro_batch * batch.seq_len / layout.cp
    size = {"layers": v * tokens * cfg.d_model, "vocabulary": v * tokens * cfg.d_model, "loss": 4 * tokens}
    return {kind: (n, size[kind]) for kind, n in tp_collective_counts(cfg, layout).items()}


def dp_pieces(cfg: TransformerConfig, layout: Layout, v: int = BF16) -> int:
    """How many pieces the data-parallel gradients move in: DDP's 25 MiB buckets, or ZeRO's units (each
    layer of the busiest stage, and the embedding and head together)."""
    if layout.zero:
        return stage_layers(cfg, layout) + 1
    return max(1, math.ceil(v * held_parameters(cfg, layout) / DDP_BUCKET))


def dp_collectives(
    cfg: TransformerConfig, layout: Layout, batch: Batch, v: int = BF16
) -> dict[str, tuple[str, int, float]]:
    """The data-parallel group's collectives in one step, as (kind, how many, bytes of each buffer), counted
    from our wrappers (``data_parallel.DDP``, ``zero.ZeRO``) over ``dp_pieces`` pieces of ``v``-byte gradients:

    "all-reduce"           DDP: one a bucket, after the last micro-batch (``no_sync`` before it)
    "reduce-scatter"       ZeRO-1: one a unit at the step, of the accumulated gradients; ZeRO-2 and 3: one a
                           unit in every micro-batch's backward (each micro-batch's gradient goes straight
                           into the shard), m a unit a step
    "all-gather"           ZeRO-1/2: one a unit after the step (the updated weights); ZeRO-3: two a unit in
                           every micro-batch (forward, and backward's regather), 2m a unit a step
    "gradient norm"        ZeRO: one all-reduce of a 4-byte number (clipping)

    DeepSpeed does the same: its stage 2 reduces each micro-batch's gradients into the partitioned
    buffer during backward, its stage 1 only at the accumulation boundary (deepspeedai/DeepSpeed PR #338,
    "Adding gradient accumulation support for ZeRO Stage 2": engine ``allreduce_gradients``, "Zero stage 2
    communicates during non gradient accumulation boundaries as well")."""
    if layout.dp * layout.cp == 1:
        return {}
    m = batch.sequences // (layout.dp * layout.micro_batch)
    pieces = dp_pieces(cfg, layout, v)
    piece = v * held_parameters(cfg, layout) / pieces
    if not layout.zero:
        return {"all-reduce": ("all_reduce", pieces, piece)}
    return {
        "reduce-scatter": ("reduce_scatter", pieces * (m if layout.zero >= 2 else 1), piece),
        "all-gather": ("all_gather", pieces * (2 * m if layout.zero >= 3 else 1), piece),
        "gradient norm": ("all_reduce", 1, 4.0),
    }


def messages_per_micro_batch(cfg, layout) -> dict[str, int]:
    """Blocking messages of the busiest rank in one micro-batch slot, by kind, counted from our wrappers' code:

    tp   ``tp_collective_counts``: 4 all-reduces a layer (2 forward, 2 backward; 2 more forward
         with full recomputation), and the vocabulary-parallel ends (``tensor_parallel``): the embedding's
         all-reduce, the head's in backward and the loss's three (max, sum of exponentials, target logit),
         the last four on the last stage
    cp   3 (cp - 1) ring sends a layer (K and V forward, twice that in backward); ep 4 all-to-alls a MoE layer
    pp   the receives a stage blocks on: 1 (an end stage of two) or 2 (an activation and a gradient)
    """
    layers = stage_layers(cfg, layout)
    tp = sum(tp_collective_counts(cfg, layout).values())
    moe = cfg.moe is not None and layout.ep > 1
    pp = 0 if layout.pp == 1 else 1 if layout.pp == 2 else 2
    return {"tp": tp, "cp": layers * 3 * (layout.cp - 1), "ep": layers * 4 * moe, "pp": pp}


def messages_per_step(moves: dict[str, tuple[str, int, float]]) -> dict[str, int]:
    """Blocking collectives of the data-parallel sync in one step, from ``dp_collectives`` (the
    counts ``step_time``'s alpha-beta charges): its all-reduces (DDP's buckets, ZeRO's gradient norm) as
    "dp all-reduce", its reduce-scatters and all-gathers (ZeRO's units) as "dp shard"."""
    counts = {"dp all-reduce": 0, "dp shard": 0}
    for op, n, _ in moves.values():
        counts["dp all-reduce" if op == "all_reduce" else "dp shard"] += n
    return counts


def hops(kind: str, layout) -> int:
    """Ring steps of one message of ``kind``, each a process to wake: 2 (p - 1) for an all-reduce over p ranks,
    p - 1 for a reduce-scatter, all-gather or all-to-all, 1 for a send (``clusters``' formulas)."""
    shards = layout.dp * layout.cp
    steps = {
        "tp": 2 * (layout.tp - 1),
        "cp": 1,
        "ep": layout.ep - 1,
        "pp": 1,
        "dp all-reduce": 2 * (shards - 1),
        "dp shard": shards - 1,
    }
    if kind not in steps:
        raise ValueError(f"unknown kind of message {kind!r}; one of {list(steps)}")
    return steps[kind]


def blocking_hops(cfg, layout, dp_moves: dict, micro_batches: int) -> float:
    """Hops of the busiest rank's blocking messages in one step: the micro-batch's in every slot of the
    pipeline (m + (pp - 1) / v, as ``step_time`` charges their alpha-beta), then the data-parallel sync's
    (``dp_moves``: ``dp_collectives`` of the layout)."""
    slots = micro_batches + (layout.pp - 1) / layout.virtual
    per_slot = sum(n * hops(k, layout) for k, n in messages_per_micro_batch(cfg, layout).items())
    return slots * per_slot + sum(n * hops(k, layout) for k, n in messages_per_step(dp_moves).items())
