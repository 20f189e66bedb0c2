"""The memory and the step time of one parallel layout, on paper: the planner's cost model.

A layout splits ``world = dp * tp * pp * cp`` ranks (``ep`` experts groups inside dp) and picks a ZeRO
stage, activation recomputation, a micro-batch size and optimizer offload. For a causal transformer
(``TransformerConfig``) and a global batch of ``B`` sequences of ``s`` tokens, per rank:

**Memory** = model states + activations + logits + working memory, each from an earlier lesson:

    states       (2 + 2 + 12) bytes per parameter held, sharded by ZeRO over dp*cp    (lesson 14; ZeRO §3.1)
                 held: the layers of one stage, split by tp (experts also by ep), and the embedding
    activations  per layer and micro-batch, 16-bit, Korthikanti et al. 2022 (Table 2):
                   tp = 1          sbh (34 + 5as/h)
                   tp, no SP       sbh (10 + 24/t + 5as/(ht))
                   tp with SP      sbh/t (34 + 5as/h)
                   full recompute  2sbh (only each layer's input is kept)
                 the 5as/h term (the s x s scores) is gone with FlashAttention or selective recomputation;
                 s is the local sequence s/cp; 1F1B stage i holds min(m, pp - i) micro-batches in flight
                 (interleaved: pp (1 + (pp-1)/(pp v)), Korthikanti et al. 2022 §4.2.3)   (lessons 06, 08, 12)
    logits       b (s/cp) V / t values, bf16 and an fp32 copy for the loss, on the last stage, and the
                 final norm's input and output, 2 b (s/cp) h values (fp32 training: 4-byte values, 4 + 4 + 8
                 bytes of states per parameter, no dropout masks unless the model has dropout)
    working      backward's gradients of one layer's intermediates (one micro-batch) on a stage without
                 the logits; ZeRO-3's gathered unit (weights and gradient of a layer); ZeRO-1's full
                 gradient counts only where it outgrows the activations it replaces in backward

**Step time** = the pipeline's (m + (pp-1)/v) micro-batch slots (GPipe's bubble, lesson 12) of
compute + the communication on the critical path, then what of the data-parallel sync backward
does not hide, then the optimizer step:

    compute    (6N + 12 L s d) FLOPs per token (``counting.flops_per_token``; 8N with full recompute)
               at ``cluster.flops`` (peak x an efficiency, stated with its source), plus the cluster's
               fixed cost of launching a layer's and a stage's ops (0 on GPUs; measured on a CPU)
    TP         4 all-reduces per layer and micro-batch (2 forward, 2 backward) of b (s/cp) h 16-bit
               values; SP swaps each for an all-gather + reduce-scatter of the same bytes (lesson 11);
               and the vocabulary-parallel ends our wrapper (and Megatron-LM) adds: the embedding's
               all-reduce of b (s/cp) h values (forward, first stage), the head's (backward, last
               stage) and the loss's three of b (s/cp) fp32 numbers (last stage) (``tp_collectives``)
    CP         K and V of the other cp - 1 chunks pass around the ring (forward; twice that in
               backward), overlapped with attention: only what exceeds attention's time shows
    EP         4 all-to-alls per MoE layer (dispatch and combine, forward and backward) of the top_k
               copies of b (s/cp) h values (lesson 19)
    PP         one send forward and one backward per micro-batch, of b (s/cp) h values
    DP         an all-reduce of the 16-bit gradients, in DDP's 25 MiB buckets, each paying its latency,
               hidden behind the last micro-batch's backward as far as it lasts; ZeRO, in its units (a
               layer; the embedding and head together), ring reduce-scatters and all-gathers of the same
               bytes (``dp_collectives``): ZeRO-1 reduce-scatters the accumulated gradients once a step;
               ZeRO-2 and 3 in every micro-batch's backward (our ``zero.py``, as DeepSpeed's stage 2),
               each hidden behind its own micro-batch's backward; ZeRO-1/2 all-gather the updated
               weights after the step; ZeRO-3 instead gathers the weights in every micro-batch's
               forward and backward (lesson 10, 14)
    optimizer  32 bytes read and written per parameter of the shard, at HBM bandwidth; offloaded:
               16-bit gradients down and weights up over PCIe, and ~28 bytes per parameter through
               host memory for the CPU's Adam (ZeRO-Offload, Ren et al. 2021), not overlapped

Every collective is costed by ``cost_model`` on the slowest link its group crosses. Where ranks share
one CPU (this machine: ``cluster.sharing``, measured by ``shared_cores``, else ideal turns on
``cluster.cores``), the step is the longer of that critical path and each rank's CPU work at the speed
it keeps while all compute, plus its communication ("shared cores" in the breakdown); each hop of a
blocking message also pays the measured wait ("waits"; 0 on GPUs).

Left out: overlap of TP communication with compute, zero-bubble schedules, memory fragmentation
and the CUDA context (the planner keeps a margin instead), kernel launch overheads, stragglers,
the causal mask halving attention FLOPs, gated FFNs' extra activations beyond the width ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..models.config import TransformerConfig
from ..models.counting import flops_per_token
from .cost_model import PRECISIONS, Cluster, all_reduce_time, collective_time
from .shared_cores import blocking_hops

__all__ = [
    "Layout",
    "Batch",
    "parameters",
    "active_matmul_parameters",
    "stage_layers",
    "tp_collectives",
    "dp_collectives",
    "in_flight",
    "memory_per_rank",
    "step_time",
]

RECOMPUTE = ("none", "selective", "full")
BF16 = 2
DDP_BUCKET = 25 * 2**20  # bytes: torch DDP's default bucket (ours too)


@dataclass(frozen=True, order=True)
class Layout:
    """One way to run: degrees of parallelism and the memory-saving switches."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0  # ZeRO stage over the dp*cp ranks that hold the same weights
    recompute: str = "none"  # none, selective (the attention scores), full (each layer's input only)
    micro_batch: int = 1
    offload: bool = False  # optimizer states and step on the host (ZeRO-Offload)
    virtual: int = 1  # interleaved pipeline: model chunks per rank
    sequence_parallel: bool = True  # with tp > 1, norms and dropout split along the sequence

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        extra = [f"ZeRO-{self.zero}"] if self.zero else []
        extra += [f"recompute {self.recompute}"] if self.recompute != "none" else []
        extra += ["offload"] if self.offload else []
        extra += [f"v={self.virtual}"] if self.virtual > 1 else []
        dims = f"DP{self.dp} TP{self.tp} PP{self.pp} CP{self.cp}" + (f" EP{self.ep}" if self.ep > 1 else "")
        return " ".join([dims, f"mb{self.micro_batch}", *extra])


@dataclass(frozen=True)
class Batch:
    """``sequences`` of ``seq_len`` tokens per optimizer step, over all ranks."""

    sequences: int
    seq_len: int

    def __post_init__(self):
        if self.sequences < 1 or self.seq_len < 1:
            raise ValueError(f"batch needs positive sequences and seq_len, got {self.sequences}, {self.seq_len}")


def parameters(cfg: TransformerConfig) -> dict[str, int]:
    """Parameters of a causal LM by kind: per layer (dense part and experts), embeddings, output head.

    Counted from the shapes, as ``llmedu.models`` builds them (the tests check it against the real model).
    """
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    bias = int(cfg.bias)
    gated = cfg.activation in ("swiglu", "geglu")
    attention = d * (d + 2 * kv) + bias * (d + 2 * kv) + d * d + bias * d
    ffn = (3 if gated else 2) * d * cfg.d_ff + bias * ((2 if gated else 1) * cfg.d_ff + d)
    n_norms = 1 if cfg.block == "parallel" else 4 if cfg.norm_placement == "sandwich" else 2
    norms = n_norms * d * (1 + bias)
    experts = 0
    if cfg.moe is not None:
        experts, ffn = cfg.moe.n_experts * ffn, d * cfg.moe.n_experts  # the FFN becomes a router + experts
    embedding = cfg.vocab_size * d + (cfg.max_seq_len * d if cfg.position == "learned" else 0)
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    final_norm = d * (1 + bias)
    return {"layer": attention + ffn + norms, "experts": experts, "embedding": embedding, "head": head + final_norm}


def active_matmul_parameters(cfg: TransformerConfig) -> int:
    """The N of 6N for one token: each layer's weight matrices (the router and top_k experts of an MoE),
    and the output head; no biases, norms or embedding lookups (``counting.matmul_parameters``)."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    ffn = (3 if cfg.activation in ("swiglu", "geglu") else 2) * d * cfg.d_ff
    if cfg.moe is not None:
        ffn = cfg.moe.top_k * ffn + d * cfg.moe.n_experts
    return cfg.n_layers * (d * (d + 2 * kv) + d * d + ffn) + cfg.vocab_size * d


def stage_layers(cfg: TransformerConfig, layout: Layout) -> int:
    """Layers of the busiest pipeline stage: ceil(L / pp) (Llama 3's 126 layers run on 16 stages)."""
    if layout.pp > cfg.n_layers:
        raise ValueError(f"pp={layout.pp} stages for {cfg.n_layers} layers: a stage would be empty")
    return -(-cfg.n_layers // layout.pp)


def _held(cfg: TransformerConfig, layout: Layout, stage: int | None = None) -> float:
    """Parameters held by one rank of pipeline ``stage`` (None: the busiest): its stage's ceil(L / pp) layers
    (split by tp, experts by tp*ep), plus the embedding on the first stage and the head on the last."""
    p = parameters(cfg)
    layers = stage_layers(cfg, layout)
    last = p["head"] + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)  # a tied head is a copy there
    if layout.pp == 1:
        ends = p["embedding"] + p["head"]
    elif stage is None:
        ends = max(p["embedding"], last)
    else:
        ends = (p["embedding"] if stage == 0 else 0) + (last if stage == layout.pp - 1 else 0)
    return layers * (p["layer"] / layout.tp + p["experts"] / (layout.tp * layout.ep)) + ends / layout.tp


def _activations_per_layer(cfg: TransformerConfig, layout: Layout, seq_len: int, flash: bool, v: int = BF16) -> float:
    """Bytes one layer keeps for backward, ``v`` bytes per value. In 16-bit we keep the paper's dropout
    masks (its 34 = 8v + 2 + 16 at v = 2); in fp32 (our CPU runs) dropout counts only if the config has it."""
    s, b, h, a, t = seq_len / layout.cp, layout.micro_batch, cfg.d_model, cfg.n_heads, layout.tp
    d = 1 if v == BF16 or cfg.dropout > 0 else 0  # one byte per dropout mask value
    if layout.recompute == "full":
        return v * s * b * h / (t if layout.sequence_parallel else 1)
    mlp_scale = cfg.d_ff / (4 * h) * (1.5 if cfg.activation in ("swiglu", "geglu") else 1.0)
    linear = 8 * v + 2 * d + 8 * v * mlp_scale  # LNs, attention, MLP (its 8v intermediates scaled to this FFN)
    scores = 0.0 if flash or layout.recompute == "selective" else (v + d * (1 + v)) * a * s / h
    if t == 1 or layout.sequence_parallel:
        return s * b * h / t * (linear + scores)
    whole = 4 * v + 2 * d  # the LayerNorms' inputs and outputs and the dropout masks: not split by plain TP
    return s * b * h * (whole + (linear - whole) / t + scores / t)


def memory_per_rank(
    cfg: TransformerConfig, layout: Layout, batch: Batch, *, flash: bool = True, precision: str = "bf16"
) -> dict[str, float]:
    """Bytes on the busiest rank, by category. With a pipeline every stage is costed (its parameters,
    the micro-batches it holds in flight, the logits on the last) and the largest total is returned.
    ``flash``: no s x s scores kept. ``precision``: "bf16" mixed precision (2 + 2 + 12 bytes per
    parameter, 16-bit activations) or "fp32" (4 + 4 + 8: weights, gradients, Adam's two moments;
    4-byte activations)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    stages = [_stage_memory(cfg, layout, batch, i, flash, precision) for i in range(layout.pp)]
    return max(stages, key=lambda m: sum(m.values()))


def in_flight(layout: Layout, micro_batches: int, stage: int) -> float:
    """Micro-batches whose activations pipeline ``stage`` holds at its peak. 1F1B: stage i runs p - i
    forwards before its first backward (at most the m there are); interleaved with v chunks, the first
    stage holds p (1 + (p - 1) / (p v)) micro-batches' worth (Korthikanti et al. 2022 §4.2.3)."""
    pp, v = layout.pp, layout.virtual
    if pp == 1:
        return 1.0
    if v > 1:
        return pp * (1 + (pp - 1) / (pp * v))
    return float(min(micro_batches, pp - stage))


def _stage_memory(
    cfg: TransformerConfig, layout: Layout, batch: Batch, stage: int, flash: bool, precision: str
) -> dict[str, float]:
    w, g, o, v = (BF16, BF16, 12, BF16) if precision == "bf16" else (4, 4, 8, 4)
    held = _held(cfg, layout, stage)
    shards = layout.dp * layout.cp
    weights = w * held / (shards if layout.zero >= 3 else 1)
    grads = g * held / (shards if layout.zero >= 2 else 1)
    optimizer = 0.0 if layout.offload else o * held / (shards if layout.zero >= 1 else 1)
    m = max(1, batch.sequences // (layout.dp * layout.micro_batch))
    per_layer = _activations_per_layer(cfg, layout, batch.seq_len, flash, v)
    activations = per_layer * stage_layers(cfg, layout) * in_flight(layout, m, stage)
    if layout.recompute == "full":  # one layer's activations exist again while it is recomputed
        activations += _activations_per_layer(cfg, replace(layout, recompute="none"), batch.seq_len, flash, v)
    logits = 0.0
    if stage == layout.pp - 1:
        # the logits, and the fp32 copy (bf16) or the log-softmax (fp32) the loss keeps for backward; and
        # the final norm's input and output (2 sbh values, split by tp only under SP), which feed the head
        tokens = layout.micro_batch * batch.seq_len / layout.cp
        final_norm = 2 * v * tokens * cfg.d_model / (layout.tp if layout.sequence_parallel else 1)
        logits = tokens * cfg.vocab_size / layout.tp * (v + 4) + final_norm
    if layout.zero == 1:
        # ZeRO-1 reduce-scatters the full gradient into the shard and frees it at every step (ours and
        # DeepSpeed's), so it is not alive at the end of forward, where activations peak; backward frees
        # activations as it makes gradients, so the gradient counts only where it outgrows them
        grads = max(0.0, grads - activations - logits)
    # working memory, alive only for a moment: backward's gradients of one layer's intermediates for one
    # micro-batch (the shapes of its activations), on stages without the head (on the last, the logits,
    # freed as backward starts, stand for them: its peak is the end of forward); and ZeRO-3's gathered unit, weights and gradient (ZeRO-Infinity §3's
    # "model state working memory"; its units here: a layer, or the embedding and head together)
    working = per_layer if stage < layout.pp - 1 else 0.0
    if layout.zero >= 3:
        p = parameters(cfg)
        unit = max(p["layer"] + p["experts"] / layout.ep, p["embedding"] + p["head"]) / layout.tp
        working += (w + g) * unit
    return {
        "weights": weights,
        "gradients": grads,
        "optimizer": optimizer,
        "activations": activations,
        "logits": logits,
        "working": working,
    }


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
    return max(1, math.ceil(v * _held(cfg, layout) / DDP_BUCKET))


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
    piece = v * _held(cfg, layout) / pieces
    if not layout.zero:
        return {"all-reduce": ("all_reduce", pieces, piece)}
    return {
        "reduce-scatter": ("reduce_scatter", pieces * (m if layout.zero >= 2 else 1), piece),
        "all-gather": ("all_gather", pieces * (2 * m if layout.zero >= 3 else 1), piece),
        "gradient norm": ("all_reduce", 1, 4.0),
    }


def step_time(cfg: TransformerConfig, layout: Layout, batch: Batch, cluster: Cluster) -> dict[str, float]:
    """Seconds of one optimizer step by part; ``total`` is their sum (see the module docstring)."""
    s, b, h = batch.seq_len / layout.cp, layout.micro_batch, cfg.d_model
    v = BF16 if cluster.precision == "bf16" else 4  # bytes per value on the wire
    hide = 1.0 if cluster.overlap else 0.0  # can communication run while the rank computes?
    m = batch.sequences // (layout.dp * b)  # micro-batches per pipeline per step
    layers = stage_layers(cfg, layout)  # the busiest stage sets the pipeline's pace
    per_token = flops_per_token(cfg, active_matmul_parameters(cfg), batch.seq_len)
    recompute = {"none": 1.0, "selective": 1.0, "full": 4 / 3}[layout.recompute]  # 8N instead of 6N
    compute = (
        per_token * recompute * b * batch.seq_len / (layout.tp * layout.cp) * layers / cfg.n_layers / cluster.flops
    )
    compute += recompute * (layers * cluster.layer_overhead + cluster.micro_batch_overhead)  # launching the ops
    attention_share = 12 * cfg.n_layers * batch.seq_len * h / per_token
    activation_bytes = v * b * s * h

    tp_link = cluster.link(layout.tp)
    tp = sum(
        n * all_reduce_time(size, layout.tp, tp_link)[0] for n, size in tp_collectives(cfg, layout, batch, v).values()
    )
    cp_link = cluster.link(layout.cp, stride=layout.tp)
    kv_bytes = 2 * v * b * s * cfg.n_kv_heads * cfg.head_dim / layout.tp
    ring = 3 * (layout.cp - 1) * collective_time("send", kv_bytes, 2, cp_link) if layout.cp > 1 else 0.0
    cp = max(0.0, layers * ring - hide * attention_share * compute)
    ep = 0.0
    if cfg.moe is not None and layout.ep > 1:
        ep_link = cluster.link(layout.ep, stride=layout.tp * layout.cp)
        ep = (
            layers * 4 * collective_time("all_to_all", activation_bytes * cfg.moe.top_k / layout.tp, layout.ep, ep_link)
        )
    stride = layout.tp * layout.cp * (layout.dp if cluster.gpus_per_node > layout.tp * layout.cp else 1)
    pp_link = cluster.intra if layout.pp == 1 else cluster.link(layout.pp, stride=stride)
    p2p = 2 * collective_time("send", activation_bytes / layout.tp, 2, pp_link) if layout.pp > 1 else 0.0
    slot = compute + tp + cp + ep + p2p
    pipeline = (m + (layout.pp - 1) / layout.virtual) * slot

    held, shards = _held(cfg, layout), layout.dp * layout.cp
    dp_link = cluster.link(shards, stride=layout.tp)
    # the gradients move in pieces, each a collective paying its own latency (``dp_collectives``): DDP's
    # all-reduces of 25 MiB buckets (ring or tree, as NCCL picks), ZeRO's ring reduce-scatters and
    # all-gathers of its units and one all-reduce of the gradient norm (for clipping)
    pieces = dp_pieces(cfg, layout, v)
    moves = dp_collectives(cfg, layout, batch, v)

    def one(kind: str) -> float:  # seconds of one collective of ``kind`` (0 if the layout has none)
        if kind not in moves:
            return 0.0
        op, _, size = moves[kind]
        return (
            all_reduce_time(size, shards, dp_link)[0]
            if op == "all_reduce"
            else collective_time(op, size, shards, dp_link)
        )

    scatter = pieces * one("reduce-scatter")  # a unit each: one micro-batch's (ZeRO-2/3) or the step's (ZeRO-1)
    if not layout.zero:
        sync = pieces * one("all-reduce")
    elif layout.zero <= 2:  # the (last) reduce-scatter, the gradient norm, the gather of the updated weights
        sync = scatter + one("gradient norm") + pieces * one("all-gather")
    else:  # ZeRO-3: nothing is gathered after the step; the weights stay sharded
        sync = scatter + one("gradient norm")
    dp = max(0.0, sync - hide * 2 / 3 * compute)  # hidden behind the last micro-batch's backward
    if layout.zero >= 2:  # every earlier micro-batch reduce-scatters too, hidden behind its own backward
        dp += (m - 1) * max(0.0, scatter - hide * 2 / 3 * compute)
    if layout.zero >= 3 and shards > 1:  # gather weights for forward and backward of every micro-batch
        gathers = 2 * pieces * one("all-gather")
        dp += m * max(0.0, gathers - hide * compute)
    shard = held / (shards if layout.zero >= 1 else 1)
    if layout.offload:
        pcie = 2 * collective_time("send", v * shard, 2, cluster.host)
        optimizer = pcie + 28 * shard / (cluster.host_bandwidth / cluster.gpus_per_node)
    else:
        optimizer = 32 * shard / cluster.accelerator.memory_bandwidth
    parts = {"compute": m * compute, "bubble": (layout.pp - 1) / layout.virtual * slot}
    parts.update(tp=m * tp, cp=m * cp, ep=m * ep, pp=m * p2p, dp=dp, optimizer=optimizer)
    if cluster.sharing is not None and layout.world != cluster.world_size:
        raise ValueError(
            f"{layout} has {layout.world} ranks; the cluster's sharing was measured with {cluster.world_size}"
        )
    # each hop of the busiest rank's blocking messages waits for a process to be scheduled (0 on GPUs)
    waits = cluster.message_wait * blocking_hops(cfg, layout, moves, m)
    parts["waits"] = waits
    critical = pipeline + dp + optimizer + waits  # the critical path, every rank at its full speed
    speed = cluster.shared_speed(layout.world)
    shared = 0.0
    if speed < 1:
        # ranks that share the CPU slow each other (take turns on too few cores, or share what a core has).
        # Each rank's CPU work (compute and optimizer step) at its shared speed, plus the waits on messages,
        # may outlast the critical path; a pipeline's idle ranks leave the CPU to the busy ones, so its
        # bubble costs less than on GPUs
        work = (m * compute + optimizer) / speed
        shared = max(0.0, work + m * (tp + cp + ep + p2p) + dp + waits - critical)
    parts["shared cores"] = shared
    parts["total"] = critical + shared
    return parts
