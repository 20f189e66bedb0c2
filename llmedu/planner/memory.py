"""One parallel layout on paper: what each rank holds, and how many bytes that is (the planner's memory model).

A ``Layout`` splits ``world = dp * tp * pp * cp`` ranks (``ep`` experts groups inside dp) and picks a ZeRO
stage, activation recomputation, a micro-batch size and optimizer offload. For a causal transformer
(``TransformerConfig``) and a global ``Batch`` of ``B`` sequences of ``s`` tokens, the busiest rank holds

**Memory** = model states + activations + logits + working memory, each from an earlier lesson:

    states       (2 + 2 + 12) bytes per parameter held, sharded by ZeRO over dp*cp    (lesson 15; ZeRO §3.1)
                 held: the layers of one stage, split by tp (experts also by ep), and the embedding
    activations  per layer and micro-batch, 16-bit, Korthikanti et al. 2022 (Table 2):
                   tp = 1          sbh (34 + 5as/h)
                   tp, no SP       sbh (10 + 24/t + 5as/(ht))
                   tp with SP      sbh/t (34 + 5as/h)
                   full recompute  2sbh (only each layer's input is kept)
                 the 5as/h term (the s x s scores) is gone with FlashAttention or selective recomputation;
                 the 34 holds 2 bytes of dropout masks (counted only for a model with dropout) and 4 of K
                 and V (with FlashAttention, grouped-query attention keeps them at n_kv_heads / n_heads);
                 s is the local sequence s/cp; 1F1B stage i holds min(m, pp - i) micro-batches in flight
                 (interleaved: min(m, pp + (pp - 1 - 2i)/v), pp (1 + (pp-1)/(pp v)) on the first stage as in
                 Korthikanti et al. 2022 §4.2.3; never more than the m there are)   (lessons 06, 09, 13)
    logits       b (s/cp) V / t values, bf16 and an fp32 copy for the loss, on the last stage, and the
                 final norm's input and output, 2 b (s/cp) h values (fp32 training: 4-byte values, 4 + 4 + 8
                 bytes of states per parameter, no dropout masks unless the model has dropout); the fp32
                 copy and the final norm's values are kept for backward by every micro-batch the last
                 chunk holds in flight (all m when an interleaved schedule runs every forward first)
    working      backward's gradients of one layer's intermediates (one micro-batch) on a stage without
                 the logits; ZeRO-3's gathered unit (weights and gradient of a layer)
    ZeRO-1       holds the full gradient until the step: in full while micro-batches accumulate (m > 1);
                 with one micro-batch only where it outgrows the activations it replaces in backward

What a rank holds (``parameters``, ``held_parameters``, ``stage_layers``) is also what its collectives move:
``messages`` counts and ``step_time`` prices the data-parallel sync on the same counts.

Left out: memory fragmentation and the CUDA context (the planner keeps a margin instead), communication
buffers, gated FFNs' extra activations beyond the width ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.config import TransformerConfig
from .clusters import PRECISIONS

__all__ = [
    "Layout",
    "Batch",
    "RECOMPUTE",
    "ZERO_STAGES",
    "uneven_splits",
    "parameters",
    "held_parameters",
    "stage_layers",
    "in_flight",
    "memory_per_rank",
]

RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
BF16 = 2


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

    def __post_init__(self):  # the planner builds thousands of these: plain checks, the messages only on a miss
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "virtual"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"Layout: {name} must be a positive int, got {name}={value!r}")
        if type(self.zero) is not int or self.zero not in ZERO_STAGES:
            raise ValueError(f"Layout: zero must be one of the ZeRO stages {ZERO_STAGES}, got zero={self.zero!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Layout: recompute must be one of {RECOMPUTE}, got recompute={self.recompute!r}")

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


def uneven_splits(cfg: TransformerConfig, layout: Layout, batch: Batch) -> list[str]:
    """What the degrees of ``layout`` split that they do not divide, one sentence each (empty: all divide).

    tp splits the attention heads and the FFN's width (K/V heads too, or, with fewer K/V heads than tp,
    each is copied to tp / n_kv_heads ranks, as Megatron-LM does; the vocabulary is padded to a multiple
    of tp, as Megatron-LM does, so it need not divide); pp x virtual chunks share the layers (the busiest
    holds ceil(L / pp), so they need not divide, but none may be empty, except, interleaved, a first chunk
    holding only the embedding and a last holding only the head, as Llama 3's 126 layers on 16 x 8 chunks,
    Llama Team 2024 §3.3.2); cp cuts the sequence into 2 cp
    zig-zag chunks; ep splits the experts and sits inside dp; dp x micro_batch splits the batch."""
    tp, kv = layout.tp, cfg.n_kv_heads
    wrong = []
    if cfg.n_heads % tp:
        wrong.append(f"tp={tp} must divide the {cfg.n_heads} attention heads")
    if kv % tp and tp % kv:
        wrong.append(f"tp={tp} must divide the {kv} K/V heads, or be a multiple of them")
    if cfg.d_ff % tp:
        wrong.append(f"tp={tp} must divide the FFN width d_ff={cfg.d_ff}")
    ends = 2 if layout.virtual > 1 else 0  # interleaved: the first chunk may hold only the embedding, the last the head
    if layout.pp * layout.virtual > cfg.n_layers + ends:
        wrong.append(
            f"pp={layout.pp} x virtual={layout.virtual} chunks must be at most the {cfg.n_layers} layers"
            + (" + 2 (a first chunk with only the embedding, a last with only the head)" if ends else "")
            + " (a stage would be empty)"
        )
    if layout.cp > 1 and batch.seq_len % (2 * layout.cp):
        wrong.append(f"2 x cp={layout.cp} zig-zag chunks must divide the sequence length {batch.seq_len}")
    if layout.ep > 1 and cfg.moe is None:
        wrong.append(f"ep={layout.ep} needs a mixture of experts; this model has none (use ep=1)")
    elif layout.ep > 1 and (cfg.moe.n_experts % layout.ep or layout.dp % layout.ep):
        wrong.append(f"ep={layout.ep} must divide the {cfg.moe.n_experts} experts and dp={layout.dp}")
    if batch.sequences % (layout.dp * layout.micro_batch):
        wrong.append(
            f"dp={layout.dp} x micro_batch={layout.micro_batch} must divide the batch of {batch.sequences} sequences"
        )
    return wrong


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


def stage_layers(cfg: TransformerConfig, layout: Layout) -> int:
    """Layers of the busiest pipeline stage: ceil(L / pp) (Llama 3's 126 layers run on 16 stages)."""
    if layout.pp > cfg.n_layers:
        raise ValueError(f"pp={layout.pp} stages for {cfg.n_layers} layers: a stage would be empty")
    return -(-cfg.n_layers // layout.pp)


def held_parameters(cfg: TransformerConfig, layout: Layout, stage: int | None = None) -> float:
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


def _activations_per_layer(
    cfg: TransformerConfig, layout: Layout, seq_len: int, flash: bool, v: int = BF16, recompute: str | None = None
) -> float:
    """Bytes one layer keeps for backward, ``v`` bytes per value (``recompute`` overrides the layout's). The
    paper's 34 = 8v + 2 + 16 at v = 2: its 2 bytes of dropout masks count only if the model has dropout
    (Llama has none); its K and V (v each) shrink to the K/V heads a rank holds under grouped-query
    attention when FlashAttention keeps them as they are (unfused attention keeps them repeated to every head)."""
    s, b, h, a, t = seq_len / layout.cp, layout.micro_batch, cfg.d_model, cfg.n_heads, layout.tp
    d = 1 if cfg.dropout > 0 else 0  # one byte per dropout mask value
    if (recompute or layout.recompute) == "full":
        return v * s * b * h / (t if layout.sequence_parallel else 1)
    mlp_scale = cfg.d_ff / (4 * h) * (1.5 if cfg.activation in ("swiglu", "geglu") else 1.0)
    kv_share = max(cfg.n_kv_heads, t) / a if flash else 1.0  # K/V heads per rank over query heads per rank
    # LNs, attention (K and V at the K/V heads' width), MLP (its 8v intermediates scaled to this FFN)
    linear = 6 * v + 2 * v * kv_share + 2 * d + 8 * v * mlp_scale
    scores = 0.0 if flash or (recompute or layout.recompute) == "selective" else (v + d * (1 + v)) * a * s / h
    if t == 1 or layout.sequence_parallel:
        return s * b * h / t * (linear + scores)
    whole = 4 * v + 2 * d  # the LayerNorms' inputs and outputs and the dropout masks: not split by plain TP
    return s * b * h * (whole + (linear - whole) / t + scores / t)


def memory_per_rank(
    cfg: TransformerConfig,
    layout: Layout,
    batch: Batch,
    *,
    flash: bool = True,
    precision: str = "bf16",
    stage: int | None = None,
) -> dict[str, float]:
    """Bytes on the busiest rank, by category (``stage``: 0 or pp - 1, that end stage's rank instead). With a pipeline the first and the last stage are costed (their
    parameters, the micro-batches they hold in flight, the logits on the last) and the larger total is returned:
    a middle stage holds the same ceil(L / pp) layers as the first, without the embedding, and no more
    micro-batches in flight, so it never needs more than the first (``tests/test_planner.py`` checks it).
    ``flash``: no s x s scores kept. ``precision``: "bf16" mixed precision (2 + 2 + 12 bytes per
    parameter, 16-bit activations) or "fp32" (4 + 4 + 8: weights, gradients, Adam's two moments;
    4-byte activations)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if stage not in (None, 0, layout.pp - 1):
        raise ValueError(f"stage must be None, 0 or pp - 1 = {layout.pp - 1} (an end stage), got stage={stage!r}")
    stages = [_stage_memory(cfg, layout, batch, i, flash, precision) for i in sorted({0, layout.pp - 1})]
    return max(stages, key=lambda m: sum(m.values())) if stage is None else stages[-1 if stage else 0]


def in_flight(layout: Layout, micro_batches: int, stage: int) -> float:
    """Micro-batches' worth of the stage's activations that pipeline ``stage`` holds at its peak.

    1F1B: stage i runs p - i forwards before its first backward. Interleaved with v chunks a rank (each
    1/v of its layers), Megatron-LM's warm-up runs 2(p - i - 1) + (v - 1) p chunk-forwards, then one more
    before the first backward: p + (p - 1 - 2i)/v micro-batches' worth, p (1 + (p - 1)/(p v)) on the first
    stage (Korthikanti et al. 2022 §4.2.3). No schedule holds more than all m micro-batches: with m = p
    Megatron-LM runs every forward first on every stage (``schedules.py``: ``num_warmup_microbatches =
    total_num_microbatches``), and then each holds all m."""
    pp, v, m = layout.pp, layout.virtual, micro_batches
    if pp == 1:
        return 1.0
    if v > 1:
        return float(m) if m == pp else min(float(m), pp + (pp - 1 - 2 * stage) / v)
    return float(min(m, pp - stage))


def _stage_memory(
    cfg: TransformerConfig, layout: Layout, batch: Batch, stage: int, flash: bool, precision: str
) -> dict[str, float]:
    w, g, o, v = (BF16, BF16, 12, BF16) if precision == "bf16" else (4, 4, 8, 4)
    held = held_parameters(cfg, layout, stage)
    shards = layout.dp * layout.cp
    weights = w * held / (shards if layout.zero >= 3 else 1)
    grads = g * held / (shards if layout.zero >= 2 else 1)
    optimizer = 0.0 if layout.offload else o * held / (shards if layout.zero >= 1 else 1)
    m = max(1, batch.sequences // (layout.dp * layout.micro_batch))
    per_layer = _activations_per_layer(cfg, layout, batch.seq_len, flash, v)
    activations = per_layer * stage_layers(cfg, layout) * in_flight(layout, m, stage)
    if layout.recompute == "full":  # one layer's activations exist again while it is recomputed
        activations += _activations_per_layer(cfg, layout, batch.seq_len, flash, v, recompute="none")
    logits = 0.0
    if stage == layout.pp - 1:
        # the logits, and the fp32 copy (bf16) or the log-softmax (fp32) the loss keeps for backward; and
        # the final norm's input and output (2 sbh values, split by tp only under SP), which feed the head
        tokens = layout.micro_batch * batch.seq_len / layout.cp
        final_norm = 2 * v * tokens * cfg.d_model / (layout.tp if layout.sequence_parallel else 1)
        # the logits themselves live for one micro-batch; the rest, for each the last chunk holds in flight:
        # one in 1F1B, all m when an interleaved schedule runs every forward first (m = pp, ``in_flight``)
        kept = m if layout.virtual > 1 and m == layout.pp else 1
        logits = tokens * cfg.vocab_size / layout.tp * (v + 4 * kept) + final_norm * kept
    if layout.zero == 1 and m == 1:
        # ZeRO-1 keeps the full gradient until the step reduce-scatters it into the shard, then frees it (ours
        # and DeepSpeed's). With one micro-batch it does not exist yet at the end of forward, where the
        # activations peak, and backward frees activations as it makes gradients: it counts only where it
        # outgrows them. With m > 1 micro-batches it accumulates from the first backward on and is alive
        # through every later micro-batch's forward (and, in 1F1B, beside the micro-batches in flight), so
        # it counts in full, as in DDP (Megatron-LM's distributed optimizer keeps its gradient buffer always)
        grads = max(0.0, grads - activations - logits)
    # working memory, alive only for a moment: backward's gradients of one layer's intermediates for one
    # micro-batch (the shapes of its activations), on stages without the head (on the last, the logits,
    # freed as backward starts, stand for them: its peak is the end of forward); and ZeRO-3's gathered
    # unit, weights and gradient (ZeRO-Infinity §3's "model state working memory"; its units here: a
    # layer, or the embedding and head together)
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
