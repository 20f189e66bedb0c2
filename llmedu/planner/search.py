"""Which parallelism when, computed: enumerate the layouts of a cluster, keep those that fit, rank the rest.

Hugging Face Transformers' guide "Efficient Training on Multiple GPUs" ends with "Which Strategy To Use
When" (one GPU: train normally, offload if it does not fit; one node: DDP, or ZeRO/TP/PP when the model does
not fit; many nodes: ZeRO or 3D with fast links...); the combinations grow combinatorially, so ``plan``
computes the choice, at course scale:

1. enumerate every ``Layout``: dp x tp x pp x cp = the cluster's ranks (tp dividing the heads, pp at
   most the layers, cp the sequence in 2 cp zig-zag chunks, ep the experts), ZeRO stage 0-3, recomputation
   none/selective/full, micro-batch 1-8 dividing the batch, optimizer offload on or off;
2. reject those whose busiest rank needs more than ``(1 - margin)`` of the accelerator's memory, in GiB
   (``memory.memory_per_rank``; the margin stands for what the formulas leave out: what the driver
   reserves, the CUDA context, the allocator's fragmentation, communication buffers);
3. rank the rest by predicted step time (``step_time.step_time``; a tie to 3 significant figures goes
   to the layout with fewer techniques switched on, then to the smaller footprint) and report model FLOPs
   utilisation, MFU = model FLOPs per step / (step time x ranks x peak) (PaLM, app. B).

Each ``Plan`` carries its breakdowns and ``sources`` says where every figure comes from. The model is
a ``TransformerConfig`` or the name of a preset (``MODELS``), the cluster a ``clusters.Cluster``.

Left out: balancing stages by cost (the busiest holds ceil(L / pp) layers and the embeddings), pipeline schedules other than
(interleaved) 1F1B, searching over the global batch (it is given), the checkpoint and data-loading cost.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from ..models.config import MoEConfig, TransformerConfig
from ..models.counting import flops_per_token
from .clusters import Cluster
from .memory import RECOMPUTE, ZERO_STAGES, Batch, Layout, memory_per_rank, uneven_splits
from .step_time import active_matmul_parameters, step_time

__all__ = ["MODELS", "Plan", "plan", "layouts", "evaluate", "NothingFits"]

GiB = 2**30


def _gpt(d, layers, heads, vocab=51200, seq=2048, **kw):
    return TransformerConfig.gpt2(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, max_seq_len=seq, **kw)


def _llama(d, layers, heads, d_ff, vocab=128256, seq=8192, **kw):
    return TransformerConfig.llama(
        vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=8, d_ff=d_ff, max_seq_len=seq, **kw
    )


MODELS: dict[str, TransformerConfig] = {
    # Brown et al. 2020, Table 2.1 (vocabulary as Megatron-LM pads it, Narayanan et al. 2021; dropout 0.1,
    # Megatron-LM's --hidden-dropout and --attention-dropout defaults, whose masks Korthikanti et al. count)
    "gpt3-175b": _gpt(12288, 96, 96, dropout=0.1),
    # Narayanan et al. 2021, Table 1 (the 1T row)
    "gpt-1t": _gpt(25600, 128, 160, dropout=0.1),
    # BigScience, "BLOOM", 2022: 70 layers, width 14336, 112 heads, 250,880 tokens, ALiBi; no dropout
    # (bigscience/bloom's config.json: hidden_dropout and attention_dropout 0.0)
    "bloom-176b": _gpt(14336, 70, 112, vocab=250880, position="alibi"),
    # Llama Team, "The Llama 3 Herd of Models", 2024, Table 3 (grouped-query attention, 8 K/V heads; no dropout)
    "llama3-8b": _llama(4096, 32, 32, 14336),
    "llama3-70b": _llama(8192, 80, 64, 28672),
    "llama3-405b": _llama(16384, 126, 128, 53248),
    # Jiang et al. 2024, "Mixtral of Experts", Table 1: 8 experts, 2 per token
    "mixtral-8x7b": _llama(4096, 32, 32, 14336, vocab=32000, seq=4096, moe=MoEConfig(8, 2, capacity_factor=None)),
}


class NothingFits(ValueError):
    """No layout of this model fits this cluster: raised with the closest miss."""


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: dict[str, float]  # bytes per rank, by category
    time: dict[str, float]  # seconds per step, by part; "total"
    mfu: float
    tokens_per_second: float
    fits: bool
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    def row(self) -> str:
        t = self.time
        comm = ", ".join(f"{k} {t[k]:.2f}" for k in ("tp", "cp", "ep", "pp", "dp") if t[k] > 5e-4)
        return (
            f"{str(self.layout):<44} {self.memory_total / GiB:7.1f} GiB  {t['total']:8.2f} s  MFU {self.mfu:5.1%}  "
            f"(compute {t['compute']:.2f}, bubble {t['bubble']:.2f}{', ' + comm if comm else ''})"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(
    cfg: TransformerConfig, cluster: Cluster, batch: Batch, *, micro_batches=(1, 2, 4, 8), flash: bool = True
) -> list[Layout]:
    """Every layout the planner considers for this model, cluster and batch (see the module docstring).

    With ``flash`` attention keeps no s x s scores, so selective recomputation would change nothing: skipped.
    """
    bad = [mb for mb in micro_batches if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1]
    if bad or not micro_batches:
        raise ValueError(f"micro_batches must be positive ints, got {tuple(micro_batches)!r}")
    recomputes = ("none", "full") if flash else RECOMPUTE
    world = cluster.world_size
    found = []
    for tp, pp, cp in itertools.product(_divisors(world), repeat=3):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        if uneven_splits(cfg, Layout(dp, tp, pp, cp), batch):  # then no ep or micro-batch can mend it
            continue
        experts = [1] if cfg.moe is None else _divisors(dp)
        stages = (0,) if dp * cp == 1 else ZERO_STAGES
        for ep, mb, zero, recompute, offload in itertools.product(
            experts, micro_batches, stages, recomputes, (False, True)
        ):
            layout = Layout(dp, tp, pp, cp, ep, zero, recompute, mb, offload)
            if not uneven_splits(cfg, layout, batch):
                found.append(layout)
    return found


def evaluate(
    cfg: TransformerConfig, layout: Layout, cluster: Cluster, batch: Batch, *, margin: float = 0.1, flash: bool = True
) -> Plan:
    """The predicted memory, step time and MFU of one layout (refused if a degree does not divide what it splits:
    ``memory.uneven_splits``)."""
    if layout.world != cluster.world_size:
        raise ValueError(f"layout {layout} uses {layout.world} ranks; the cluster has {cluster.world_size}")
    wrong = uneven_splits(cfg, layout, batch)
    if wrong:
        raise ValueError(f"layout {layout} does not split this model and batch evenly: {'; '.join(wrong)}")
    memory = memory_per_rank(cfg, layout, batch, flash=flash, precision=cluster.precision)
    time = step_time(cfg, layout, batch, cluster)
    model_flops = flops_per_token(cfg, active_matmul_parameters(cfg), batch.seq_len) * batch.sequences * batch.seq_len
    mfu = model_flops / (time["total"] * cluster.world_size * cluster.accelerator.peak_flops_16bit)
    fits = sum(memory.values()) <= (1 - margin) * cluster.accelerator.memory_bytes
    return Plan(layout, memory, time, mfu, batch.sequences * batch.seq_len / time["total"], fits, _sources(cluster))


def plan(
    model: TransformerConfig | str,
    cluster: Cluster,
    batch: Batch,
    *,
    top: int = 5,
    margin: float = 0.1,
    flash: bool = True,
    where: Callable[[Layout], bool] | None = None,
) -> list[Plan]:
    """The ``top`` fastest layouts that fit, fastest first (at equal time the simpler, then the smaller);
    ``NothingFits`` names the closest miss. ``flash``: attention keeps no s x s scores (FlashAttention).
    ``where`` keeps only the layouts it accepts, e.g. ``where=lambda lay: lay.cp == 1``."""
    cfg = _model(model)
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a positive int (how many plans to return), got top={top!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    candidates = [lay for lay in layouts(cfg, cluster, batch, flash=flash) if where is None or where(lay)]
    if not candidates:
        raise NothingFits(
            f"no layout divides {cluster.world_size} ranks over {cfg.n_heads} heads, {cfg.n_layers} layers and a "
            f"batch of {batch.sequences} sequences: change the batch or the number of GPUs"
        )
    plans = [evaluate(cfg, layout, cluster, batch, margin=margin, flash=flash) for layout in candidates]
    fitting = sorted((p for p in plans if p.fits), key=_rank)
    if not fitting:
        closest = min(plans, key=lambda p: (p.memory_total, p.layout))
        usable = (1 - margin) * cluster.accelerator.memory_bytes
        raise NothingFits(
            f"nothing fits on {cluster.name}: the smallest per-rank footprint is {closest.memory_total / GiB:.1f} GiB "
            f"({closest.layout}) against {usable / GiB:.1f} GiB usable per {cluster.accelerator.name} "
            f"({1 - margin:.0%} of its memory); add GPUs, shorten the sequence or shrink the batch"
        )
    return fitting[:top]


def _rank(p: Plan) -> tuple:
    """Faster first; times equal to 3 significant figures tie, and the tie goes to the simpler layout
    (fewer techniques switched on, each ZeRO stage counting as one more: a technique has to pay for
    itself), then to the smaller footprint."""
    lay = p.layout
    techniques = lay.zero + sum((lay.tp > 1, lay.pp > 1, lay.cp > 1, lay.ep > 1, lay.recompute != "none", lay.offload))
    return float(f"{p.time['total']:.3g}"), techniques, p.memory_total, lay


def _model(model: TransformerConfig | str) -> TransformerConfig:
    if isinstance(model, TransformerConfig):
        if not model.causal:
            raise ValueError("the planner models causal language models (the cost model's 6N and its activations)")
        return model
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; presets: {', '.join(MODELS)}")
    return MODELS[model]


def _sources(cluster: Cluster) -> dict[str, str]:
    acc = cluster.accelerator
    return {
        "compute": f"(6N + 12LTd) FLOPs per token at {cluster.efficiency:.0%} of {acc.name}'s peak "
        f"({acc.peak_flops_16bit / 1e12:.0f} TFLOP/s, {acc.source}); efficiency: {cluster.efficiency_source}",
        "memory": "ZeRO §3.1 model states; Korthikanti et al. 2022 Table 2 activations; "
        + ("bf16 + fp32 logits" if cluster.precision == "bf16" else "fp32 throughout")
        + f"; capacity {acc.memory_bytes / GiB:.0f} GiB per GPU (HBM in binary units: clusters' docstring)",
        "intra": f"{cluster.intra.name}: {cluster.intra.bandwidth / 1e9:.0f} GB/s per direction ({cluster.intra.source})",
        "inter": f"{cluster.inter.name}: {cluster.inter.bandwidth / 1e9:.1f} GB/s per direction ({cluster.inter.source})",
        "latency": cluster.notes,
        "bubble": "(pp - 1) / v micro-batch slots of 1F1B (Narayanan et al. 2021 §2.2)",
        "tp": "all-reduces of the busiest stage's TP group in every micro-batch, as our tensor_parallel sends them: "
        "4 a layer (Megatron-LM; 6 with full recomputation) and the vocabulary-parallel ends, the embedding's "
        "and the head's of b s h values and the loss's 3 of b s fp32 numbers (messages.tp_collectives)",
        "dp": "DDP: bucket all-reduces in the last micro-batch's backward; ZeRO: ring reduce-scatters of each unit, in "
        "the last micro-batch's backward (ZeRO-1) or in every micro-batch's (ZeRO-2/3, as DeepSpeed's stage 2), "
        "hidden behind that backward as far as it lasts; ZeRO-3's gathers, twice a micro-batch, behind its forward "
        "and (with the reduce-scatter) its backward; exposed: the all-gather of the updated weights after the step "
        "(ZeRO-1/2) and the gradient norm (messages.dp_collectives, step_time.dp_time)",
    }
