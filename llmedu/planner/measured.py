"""Train a ``Layout`` for real on CPU processes and measure it; set the planner's prediction beside it.

What ``memory`` and ``step_time`` predict on paper, this module runs: a small GPT
(``TransformerConfig``, fp32, AdamW) trained with our wrappers on ``launch``'s processes:

    pure data parallelism     ``DDP`` (one bucket, ``no_sync`` while micro-batches accumulate)
    ZeRO stages 1-3           ``ZeRO`` over the dp ranks
    TP and/or PP (and DP)     ``make_mesh`` + ``tensor_parallel`` + ``PipelineStage``/``Pipeline`` (1F1B),
                              the DP group's gradients all-reduced as one flat buffer
    full recomputation        ``train.recompute.apply_policy(model, "blocks")``

For each layout: one warm-up step, one step under ``MemoryTracker`` (the busiest rank's peak), then
timed steps (a step's time is its slowest rank's). ``predict`` costs the same layouts with
``search.evaluate`` on ``probes.local_cluster`` (this machine, measured: how the ranks share it too), its compute
efficiency calibrated on a one-process layout. ``benchmarks/bench_planner.py`` and lesson 14 use both.

Left out: sequence, context and expert parallelism (the model has them; ``mesh`` does not build them),
ZeRO with TP or PP, interleaved schedules, offload.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..models.config import TransformerConfig
from ..models.counting import flops_per_token
from ..parallel.launch import launch
from .memory import Batch, Layout
from .probes import (
    calibrate_efficiency,
    local_cluster,
    measure_adam_rate,
    measure_gloo_link,
    measure_overheads,
    measure_thread_flops,
)
from .search import evaluate
from .shared_cores import measure_sharing
from .step_time import active_matmul_parameters

__all__ = ["small_gpt", "build", "measure_layouts", "probe_machine", "predict_layouts"]


def small_gpt(d_model: int, layers: int, seq_len: int) -> TransformerConfig:
    """A GPT-2-shaped model on bytes (vocabulary 256), untied so that TP and PP split it plainly; torch's fused
    norms and GELU, which keep for backward what the cost model counts (the written-out ones keep more)."""
    return TransformerConfig.gpt2(
        vocab_size=256,
        d_model=d_model,
        n_layers=layers,
        n_heads=4,
        max_seq_len=seq_len,
        tie_embeddings=False,
        fused=True,
    )


def build(cfg: TransformerConfig, lay: Layout, tokens: torch.Tensor):
    """Build ``lay`` on this rank; return (step function, module and optimizer for the tracker).

    ``tokens`` (B, T) is the global batch, the same on every rank; each replica takes its 1/dp.
    """
    from ..models.gpt import CausalLM, lm_loss
    from ..parallel.data_parallel import DDP
    from ..parallel.mesh import make_mesh
    from ..parallel.pipeline_parallel import Pipeline, PipelineStage
    from ..parallel.tensor_parallel import tensor_parallel, vocab_parallel_lm_loss
    from ..parallel.zero import ZeRO
    from ..train.recompute import apply_policy

    torch.manual_seed(0)
    model = CausalLM(cfg)
    if lay.recompute == "full" and lay.tp == 1:  # (with TP, below: on the sharded copy)
        apply_policy(model, "blocks")
    mine = tokens.chunk(lay.dp)[dist.get_rank() // lay.tp % lay.dp]  # (B/dp, T), this replica's share
    micro = mine.split(lay.micro_batch)  # m micro-batches of (b, T)

    def loss_of(module, x):
        return lm_loss(module(x), x) / len(micro)  # lm_loss shifts: position t predicts t + 1

    if lay.tp == lay.pp == 1 and lay.zero == 0:  # data parallelism: our DDP
        ddp = DDP(model)  # 25 MiB buckets, as the cost model counts them
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            for i, x in enumerate(micro):
                if i < len(micro) - 1:
                    with ddp.no_sync():
                        loss_of(ddp, x).backward()
                else:
                    loss_of(ddp, x).backward()
            ddp.finish_gradient_sync()
            opt.step()
            opt.zero_grad(set_to_none=False)

        return step, model, opt
    if lay.zero:  # ZeRO stages 1-3 over the dp ranks
        zero = ZeRO(model, lay.zero, lr=1e-3)

        def step():
            for x in micro:
                loss_of(zero, x).backward()
            zero.step()
            zero.zero_grad()

        return step, zero, zero.optimizer
    mesh = make_mesh(lay.dp, lay.tp, lay.pp)  # 3D: TP inside, then DP, then PP
    if lay.tp > 1:
        model = tensor_parallel(model, mesh.tp_group)
        if lay.recompute == "full":  # after the copy: the policy binds each block's own forward, and a deep
            apply_policy(model, "blocks")  # copy would keep calling the unsharded original's
        loss_fn = lambda logits, ids: vocab_parallel_lm_loss(logits, ids, mesh.tp_group)  # noqa: E731
    else:
        loss_fn = lm_loss
    stage = PipelineStage(model, mesh.pp_rank, lay.pp)
    pipe = Pipeline(stage, mesh.pp_ranks, loss_fn, act_shape=lambda ids: (*ids.shape, cfg.d_model))
    params = list(stage.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step():
        pipe.step(mine, mine, len(micro), "1f1b")
        if lay.dp > 1:  # the DP group's gradients as one flat buffer: one all-reduce, as DDP's one bucket
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=mesh.dp_group)
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p)).div_(lay.dp)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step, stage, opt


def _worker(cfg: TransformerConfig, sequences: int, layouts: list[Layout], steps: int) -> list[dict]:
    """On every rank: for each layout of this world size, the tracked peak and the step times."""
    from ..memory import MemoryTracker

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (sequences, cfg.max_seq_len), generator=g)  # (B, T)
    rows = []
    for lay in layouts:
        step, module, opt = build(cfg, lay, tokens)
        step()  # warm-up: creates gradients and the optimizer state
        with MemoryTracker(module, opt) as tracker:
            step()
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is over when its slowest rank is
            times.append(elapsed.item())
        peak = torch.tensor([tracker.peak_bytes], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the busiest rank, as the model predicts
        rows.append({"median_s": statistics.median(times), "min_s": min(times), "peak_bytes": peak.item()})
        del step, module, opt
    return rows


def measure_layouts(
    cfg: TransformerConfig, sequences: int, layouts, steps: int, reference: Layout | None = None, rounds: int = 1
) -> list[dict]:
    """Run every layout (one launch per world size, ``rounds`` times); rows in the order of ``layouts``.

    A row holds the median over rounds of each round's median step time (``median_s``), the fastest step
    (``min_s``) and the busiest rank's tracked peak (``peak_bytes``). With a one-process ``reference``
    layout, that layout also runs right before the first launch and after every launch, and each row gets
    ``reference_s``: over rounds, the median of the mean of the reference's times before and after its own
    launch. A shared machine's speed drifts (this 2-core host ran the same one-process step in 77, 83 and
    153 ms in three runs minutes apart, 26 Nov 2026): a prediction calibrated on the reference measured
    next to a layout compares the two at the same moment (``predict_layouts``).
    """
    if reference is not None and reference.world != 1:
        raise ValueError(f"the reference layout must be one process, got {reference}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    worlds = sorted({lay.world for lay in layouts})
    runs: dict[Layout, list[dict]] = {lay: [] for lay in layouts}

    def timed_reference() -> float:
        return launch(_worker, 1, cfg, sequences, [reference], steps, echo=False, timeout=300)[0][0]["median_s"]

    for _ in range(rounds):
        before = timed_reference() if reference is not None else None
        for world in worlds:
            mine = [lay for lay in layouts if lay.world == world]
            rows = launch(_worker, world, cfg, sequences, mine, steps, echo=False, timeout=300)[0]
            after = timed_reference() if reference is not None else None
            for lay, row in zip(mine, rows):
                runs[lay].append({**row, "reference_s": None if before is None else (before + after) / 2})
            before = after
    out = []
    for lay in layouts:
        r = runs[lay]
        row = {
            "median_s": statistics.median(x["median_s"] for x in r),
            "min_s": min(x["min_s"] for x in r),
            "peak_bytes": max(x["peak_bytes"] for x in r),
            "rounds": len(r),
        }
        if reference is not None:
            row["reference_s"] = statistics.median(x["reference_s"] for x in r)
        out.append(row)
    return out


def probe_machine(cfg, worlds, cores) -> dict:
    """Everything the local cluster measures, once: matmul FLOP/s, AdamW's rate, overheads, and per world
    gloo's alpha-beta and what the ranks cost each other (``shared_cores.measure_sharing``)."""
    links = {w: measure_gloo_link(w) for w in worlds if w > 1}
    return {
        "cores": cores,
        "thread_flops": measure_thread_flops(),
        "adam_rate": measure_adam_rate(),
        "overheads": measure_overheads(cfg),
        "links": links,
        "sharing": {w: measure_sharing(cfg, w, link, cores=cores) for w, link in links.items()},
    }


def predict_layouts(cfg, sequences, layouts, measured, probes) -> tuple[list[dict], float]:
    """The planner's numbers on the local cluster, its efficiency calibrated on the first (one-process) layout:
    per row on the reference timed next to it (``reference_s``) where there is one, else on the first row.
    Returns the rows and the first row's efficiency."""
    batch = Batch(sequences, cfg.max_seq_len)
    step_flops = flops_per_token(cfg, active_matmul_parameters(cfg), batch.seq_len) * sequences * batch.seq_len

    def machine(world, efficiency=1.0, source="uncalibrated"):
        return local_cluster(
            world,
            cores=probes["cores"],
            thread_flops=probes["thread_flops"],
            link=probes["links"].get(world),
            efficiency=efficiency,
            efficiency_source=source,
            threads=1,
            adam_rate=probes["adam_rate"],
            overheads=probes["overheads"],
            sharing=probes.get("sharing", {}).get(world),
        )

    ref = layouts[0]
    if ref.world != 1:
        raise ValueError(f"the first layout calibrates the efficiency and must be one process, got {ref}")
    one = machine(1)
    at_peak = evaluate(cfg, ref, one, batch, flash=True).time
    flop_seconds = step_flops / one.flops

    def calibrated(reference_seconds: float) -> float:
        return calibrate_efficiency(
            step_flops, reference_seconds, one.flops, other_seconds=at_peak["total"] - flop_seconds
        )

    efficiency = calibrated(measured[0]["median_s"])
    rows = []
    for lay, m in zip(layouts, measured):
        # the reference measured next to this layout, where measure_layouts timed one (the host's drift cancels)
        here = calibrated(m["reference_s"]) if m.get("reference_s") else efficiency
        source = f"calibrated: the one-process {ref} step's FLOPs ran at {here:.0%} of the matmul probe"
        plan = evaluate(cfg, lay, machine(lay.world, here, source), batch, flash=True)  # sdpa: no s x s kept
        t, mem = plan.time["total"], plan.memory_total
        rows.append(
            {
                "layout": str(lay),
                "world": lay.world,
                "measured_s": m["median_s"],
                "min_s": m["min_s"],
                "reference_s": m.get("reference_s"),
                "efficiency": here,
                "predicted_s": t,
                "time_error": t / m["median_s"] - 1,
                "measured_peak": m["peak_bytes"],
                "predicted_peak": mem,
                "memory_error": mem / m["peak_bytes"] - 1,
                "parts": {k: v for k, v in plan.time.items() if v > 0 and k != "total"},
            }
        )
    return rows, efficiency
