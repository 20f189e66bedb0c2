"""Train a ``Layout`` for real on CPU processes and measure it; set the planner's prediction beside it.

What ``layout_memory`` and ``layout_cost`` predict on paper, this module runs: a small GPT
(``TransformerConfig``, fp32, AdamW) trained with our wrappers on ``launch``'s processes:

    pure data parallelism     ``DDP`` (one bucket, ``no_sync`` while micro-batches accumulate)
    ZeRO stages 1-3           ``ZeRO`` over the dp ranks
    TP and/or PP (and DP)     ``make_mesh`` + ``tensor_parallel`` + ``PipelineStage``/``Pipeline`` (1F1B),
                              the DP group's gradients all-reduced as one flat buffer
    full recomputation        ``train.recompute.apply_policy(model, "blocks")``

For each layout: one warm-up step, one step under ``MemoryTracker`` (the busiest rank's peak), then
timed steps (a step's time is its slowest rank's). ``predict`` costs the same layouts with
``planner.evaluate`` on ``local_cluster`` (this machine, measured: how the ranks share it too), its compute
efficiency calibrated on a one-process layout. ``benchmarks/bench_planner.py`` and lesson 13 use both.

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
from .launch import launch
from .layout_cost import active_matmul_parameters
from .layout_memory import Batch, Layout
from .local_cluster import (
    calibrate_efficiency,
    local_cluster,
    measure_adam_rate,
    measure_gloo_link,
    measure_overheads,
    measure_thread_flops,
)
from .planner import evaluate
from .shared_cores import measure_sharing

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
    from ..train.recompute import apply_policy
    from .data_parallel import DDP
    from .mesh import make_mesh
    from .pipeline_parallel import Pipeline, PipelineStage
    from .tensor_parallel import tensor_parallel, vocab_parallel_lm_loss
    from .zero import ZeRO

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


def measure_layouts(cfg: TransformerConfig, sequences: int, layouts, steps: int) -> list[dict]:
    """Run every layout (one launch per world size); rows in the order of ``layouts``."""
    out = {}
    for world in sorted({lay.world for lay in layouts}):
        mine = [lay for lay in layouts if lay.world == world]
        rows = launch(_worker, world, cfg, sequences, mine, steps, echo=False, timeout=300)[0]
        out.update(zip(mine, rows))
    return [out[lay] for lay in layouts]


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
        "sharing": {w: measure_sharing(cfg, w, link) for w, link in links.items()},
    }


def predict_layouts(cfg, sequences, layouts, measured, probes) -> tuple[list[dict], float]:
    """The planner's numbers on the local cluster, its efficiency calibrated on the first (one-process) layout."""
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
    efficiency = calibrate_efficiency(
        step_flops, measured[0]["median_s"], one.flops, other_seconds=at_peak["total"] - flop_seconds
    )
    source = f"calibrated: the one-process {ref} step's FLOPs ran at {efficiency:.0%} of the matmul probe"
    rows = []
    for lay, m in zip(layouts, measured):
        plan = evaluate(cfg, lay, machine(lay.world, efficiency, source), batch, flash=True)  # sdpa: no s x s kept
        t, mem = plan.time["total"], plan.memory_total
        rows.append(
            {
                "layout": str(lay),
                "world": lay.world,
                "measured_s": m["median_s"],
                "min_s": m["min_s"],
                "predicted_s": t,
                "time_error": t / m["median_s"] - 1,
                "measured_peak": m["peak_bytes"],
                "predicted_peak": mem,
                "memory_error": mem / m["peak_bytes"] - 1,
                "parts": {k: v for k, v in plan.time.items() if v > 0 and k != "total"},
            }
        )
    return rows, efficiency
