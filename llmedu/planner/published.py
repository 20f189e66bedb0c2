"""Published training runs with known hardware and layout: the planner's cost model against the real thing.

Each ``Run`` is a model, the cluster it ran on, the layout its authors chose and what they reported.
``compare`` evaluates that layout with the planner's cost model (does it fit? what MFU does the model
predict?) and asks the planner for its own choice on the same cluster and batch. Where the prediction
and the report differ, the difference is the lesson: what the cost model leaves out.

Sources and conventions:

* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1: GPT models, V = 51,200, s = 2048, on Selene (DGX A100 80 GB, 8 HDR InfiniBand
  ports per node), with activation recomputation. Their teraFLOP/s count the recomputed forward pass
  (their eq. 3, 96 B s l h^2 (...)), so the MFU without it is 3/4 of their "% of peak" to first order.
  The micro-batch size is not in the table: 1 is assumed.
* BigScience 2022, "BLOOM" (§3.4; the model's public training page; its launch script
  bigscience-workshop/bigscience train/tr11-176B-ml/tr11-176B-ml.slurm): 384 A100 80 GB in 48 nodes, one
  model copy on 48 GPUs (TP4 x PP12, so DP8), micro-batch 2, full activation checkpointing, bf16 with a
  ZeRO-1 equivalent, s = 2048, a global batch of 2048 sequences, "about 150 TFLOPs" per GPU and about 60 GB
  of memory used per GPU; no FlashAttention, no sequence parallelism (2022). Between nodes: 4 x 100 Gb/s
  Omni-Path per node of 8 GPUs, 6.25 GB/s per GPU.
* Llama Team 2024, "The Llama 3 Herd of Models", §3.3.2: the 405B model on 16,384 H100s (8 per server,
  400 Gb/s per GPU), TP8 CP1 PP16 DP128 at s = 8192, 16M tokens per batch: BF16 MFU 41% in their Table 4
  (43% on 8,192 GPUs, 38% with CP16 at 131K tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..models.config import TransformerConfig
from .clusters import GB, Link, cluster
from .memory import Batch, Layout
from .search import MODELS, Plan, evaluate, plan

__all__ = ["Run", "RUNS", "Comparison", "compare"]


@dataclass(frozen=True)
class Run:
    name: str
    model: TransformerConfig
    nodes: int
    preset: str  # a cluster preset (clusters.CLUSTERS)
    layout: Layout
    batch: Batch
    reported_mfu: tuple[float, float]  # low, high (equal when one figure was reported)
    reported_memory_gb: float | None  # per GPU, in GB (1e9 bytes), as reported
    source: str
    inter: Link | None = None
    flash: bool = True  # FlashAttention (2022 on): no s x s scores kept

    def cluster(self):
        return cluster(self.preset, nodes=self.nodes, inter=self.inter)


def _megatron(billions, d, layers, heads, tp, pp, gpus, batch, percent):
    model = replace(MODELS["gpt3-175b"], d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=heads, d_ff=4 * d)
    return Run(
        f"Megatron-LM {billions}B",
        model,
        gpus // 8,
        "dgx-a100",
        Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, recompute="full", micro_batch=1),
        Batch(batch, 2048),
        (0.75 * percent, 0.75 * percent),
        None,
        "Narayanan et al. 2021, Table 1 (MFU: 3/4 of the reported % of peak, which counts recomputation)",
    )


OMNI_PATH = Link("Omni-Path 4 x 100 Gb/s per node", 6.25 * GB, 10e-6, "BLOOM paper: 4 links per 8-GPU node")

RUNS: tuple[Run, ...] = (
    _megatron("1.7", 2304, 24, 24, 1, 1, 32, 512, 0.44),
    _megatron("18.4", 6144, 40, 48, 8, 1, 256, 1024, 0.43),
    _megatron("145.6", 12288, 80, 96, 8, 8, 1536, 2304, 0.47),
    _megatron("529.6", 20480, 105, 128, 8, 35, 2520, 2520, 0.52),
    _megatron("1008", 25600, 128, 160, 8, 64, 3072, 3072, 0.52),
    Run(
        "BLOOM-176B",
        MODELS["bloom-176b"],
        48,
        "dgx-a100",
        Layout(dp=8, tp=4, pp=12, zero=1, recompute="full", micro_batch=2, sequence_parallel=False),
        Batch(2048, 2048),
        (0.75 * 150 / 312, 0.75 * 150 / 312),
        60.0,
        "BigScience 2022: ~150 TFLOP/s per GPU of 312 peak (counted as Megatron's formula does, recomputation "
        "included: 3/4 of it is MFU), ~60 GB per GPU; layout from train/tr11-176B-ml/"
        "tr11-176B-ml.slurm (TP 4, PP 12, micro-batch 2, --checkpoint-activations, bf16 with ZeRO-1)",
        OMNI_PATH,
        flash=False,
    ),
    Run(
        "Llama 3 405B",
        MODELS["llama3-405b"],
        2048,
        "dgx-h100",
        Layout(dp=128, tp=8, pp=16, zero=2, micro_batch=1),
        Batch(2048, 8192),
        (0.41, 0.41),
        None,
        "Llama Team 2024, §3.3.2 and Table 4: TP8 CP1 PP16 DP128 on 16,384 GPUs (FSDP: optimizer states and "
        "gradients sharded; ZeRO-2 assumed), 16M tokens per batch, BF16 MFU 41%; their uneven stages and "
        "schedule tuning are not modelled",
    ),
)


@dataclass(frozen=True)
class Comparison:
    run: Run
    published: Plan  # the authors' layout, through our cost model
    chosen: Plan  # the planner's own first choice

    def row(self) -> str:
        low, high = self.run.reported_mfu
        reported = f"{low:.0%}" if low == high else f"{low:.0%}-{high:.0%}"
        gib = self.published.memory_total / 2**30
        said = self.run.reported_memory_gb  # GB, as reported: printed in GiB like ours
        memory = f"{gib:5.1f} GiB" + (f" (reported ~{said * 1e9 / 2**30:.0f} GiB)" if said else "")
        return (
            f"{self.run.name:<18} {str(self.run.layout):<34} fits {'yes' if self.published.fits else 'NO ':<3}  {memory:<30} "
            f"MFU predicted {self.published.mfu:5.1%} vs reported {reported:<7} | planner: {self.chosen.layout} "
            f"MFU {self.chosen.mfu:5.1%}"
        )


def compare(
    runs: tuple[Run, ...] = RUNS, *, margin: float = 0.1, where: Callable[[Layout], bool] | None = None
) -> list[Comparison]:
    """Each run's layout through the cost model, beside the planner's own choice on its cluster (among the
    layouts ``where`` accepts, as in ``plan``; e.g. ``where=lambda lay: lay.cp == 1``)."""
    out = []
    for run in runs:
        c, cfg = run.cluster(), run.model
        published = evaluate(cfg, run.layout, c, run.batch, margin=margin, flash=run.flash)
        chosen = plan(cfg, c, run.batch, top=1, margin=margin, flash=run.flash, where=where)[0]
        out.append(Comparison(run, published, chosen))
    return out
