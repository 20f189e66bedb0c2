"""This machine as a ``Cluster``: its CPU's FLOP/s and its gloo link, measured, not looked up.

The planner's presets (``clusters.CLUSTERS``) describe GPU nodes from datasheets. To check the cost
model against measurement we need the one machine we can measure: several processes on one CPU,
talking through gloo over the loopback device. What is **measured** when ``local_cluster`` runs:

* ``flops``: the fp32 FLOP/s of one thread on an (n, n) @ (n, n) matmul (``hardware.probe``, lesson 00),
  the best of a few repeats, with torch limited to one thread while it runs;
* the optimizer: how fast torch's AdamW steps on one thread, as the bytes/s that the cost model's
  32 bytes per parameter stream at (it stands in the accelerator's memory bandwidth);
* ``overheads``: the seconds per layer and per micro-batch that forward + backward cost beyond their
  FLOPs (Python launching each op), timed on a micro-batch of two tokens (``measure_overheads``);
* ``link``: gloo's all-reduce between ``world`` processes at a few message sizes, least-squares
  fitted to the ring model t = 2 (p - 1) alpha + 2 (p - 1) / p * n / beta (lesson 10 fits the same).
  The probe runs its ranks while nothing else of ours runs, so the fit includes the cost of
  processes that share cores (a step of the ring waits for a rank to be scheduled).

What is **assumed**, and said in the cluster's fields:

* ``sharing`` (``shared_cores``), when passed as measured: the fraction of its speed alone a rank keeps
  while all ``world`` ranks compute, timed on the model's own step, and the wait each blocking message
  costs beyond gloo's alpha-beta when the ranks compute between messages. Not passed, it is assumed:
  the machine's ``cores`` run one thread each at the probed speed; a rank runs ``threads`` of them
  (``launch`` gives each $OMP_NUM_THREADS, by default ``cores // world``, at least one). With more rank
  threads than cores, the ranks take turns: when all compute at once each runs at
  ``flops * min(threads, cores / world)`` (4 ranks on 2 cores: half a core each), and a message waits
  for nothing beyond its alpha-beta. Either way a rank that waits leaves its core to the others
  (``step_time.step_time``). On this machine the assumption can be far off: in one hour its two vCPUs
  gave two copies of the model's step 52% of their speed alone in one probe and 94-96% in later ones
  (``bench_planner``'s two-rank data parallelism was once no faster than one process);
* ``efficiency``: the fraction of that matmul speed a training step of the model sustains (its small
  matmuls, attention's softmax, layer norms, Python between the ops). It is not a GPU's assumed 60%:
  pass the ratio measured on a one-process run of the same model (``calibrate_efficiency``), stated
  as a calibration in ``efficiency_source``;
* compute and communication never overlap: with every core busy computing there is no spare core
  to progress a collective, so the cluster says ``overlap=False`` and the cost model adds them;
* the whole machine is one "node": intra- and inter-node links are the same measured link; host
  memory is the device memory (no PCIe), so offload moves no bytes over a link.

Left out: the cache hierarchy (a rank's working set may fit in cache or not), frequency scaling,
other users of the machine (the probes and the run they predict should see the same load), NUMA.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

import numpy as np
import torch

from ..hardware.probe import measure_matmul_flops
from ..hardware.specs import Accelerator
from .clusters import Cluster, Link
from .sharing import Sharing

__all__ = [
    "measure_thread_flops",
    "measure_adam_rate",
    "measure_overheads",
    "measure_gloo_link",
    "repeat_noisy_probe",
    "fit_alpha_beta",
    "calibrate_efficiency",
    "local_cluster",
    "rank_flops",
]

PROBE_SIZES = (4 * 2**10, 64 * 2**10, 1 * 2**20, 4 * 2**20)  # bytes: latency-bound to bandwidth-bound


def measure_thread_flops(n: int = 512, repeats: int = 3) -> float:
    """fp32 matmul FLOP/s of ONE thread (torch limited to one thread while it runs), the best repeat."""
    return _one_thread(lambda: measure_matmul_flops("fp32", n, device="cpu", repeats=repeats, min_seconds=0.02).best)


def _one_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _best_seconds(call, repeats: int) -> float:
    call()  # warm-up: allocations, lazy state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_adam_rate(n_params: int = 2**20, repeats: int = 5) -> float:
    """Bytes/s at which torch's AdamW steps on one thread, counting the cost model's 32 bytes per parameter
    (read weight, gradient and two moments, write three back: 28 in fp32; the model keeps its 32)."""

    def run():
        w = torch.nn.Parameter(torch.zeros(n_params))
        w.grad = torch.ones(n_params)
        opt = torch.optim.AdamW([w], lr=1e-3)
        return _best_seconds(opt.step, repeats)

    return 32 * n_params / _one_thread(run)


def measure_overheads(cfg, repeats: int = 5) -> tuple[float, float]:
    """Seconds per layer and per micro-batch that the model's forward + backward costs beyond its FLOPs.

    Timed on one thread with a micro-batch of one sequence of two tokens, where the FLOPs are nothing:
    a 1-layer and a ``cfg.n_layers``-layer copy of ``cfg`` (at least 2); the difference per layer is the
    layer's overhead, the rest (embedding, head, loss, autograd's start) the micro-batch's.
    """
    from dataclasses import replace

    from ..models.gpt import CausalLM, lm_loss

    layers = max(2, cfg.n_layers)
    ids = torch.zeros(1, 2, dtype=torch.long)  # (1, 2): one tiny micro-batch

    def seconds(n_layers: int) -> float:
        torch.manual_seed(0)
        model = CausalLM(replace(cfg, n_layers=n_layers))
        return _best_seconds(lambda: lm_loss(model(ids), ids).backward(), repeats)

    one, many = _one_thread(lambda: (seconds(1), seconds(layers)))
    per_layer = max(0.0, (many - one) / (layers - 1))
    return per_layer, max(0.0, one - per_layer)


def _time_all_reduce(sizes: tuple[int, ...], repeats: int) -> list[float]:
    """In each rank: the median over ``repeats`` of the slowest rank's gloo all-reduce time, per size."""
    import torch.distributed as dist

    medians = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)  # (n/4,) fp32
        dist.all_reduce(x)  # warm-up: connections, allocations
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a collective is over when its slowest rank is
            times.append(elapsed.item())
        medians.append(statistics.median(times))
    return medians


def fit_alpha_beta(sizes, seconds, world: int) -> tuple[float, float]:
    """Least squares of t = 2 (p - 1) alpha + 2 (p - 1) / p * n / beta; returns (alpha s, beta B/s)."""
    p = world
    design = np.array([[2 * (p - 1), 2 * (p - 1) / p * n] for n in sizes], dtype=float)  # (sizes, 2)
    (alpha, inv_beta), *_ = np.linalg.lstsq(design, np.asarray(seconds, dtype=float), rcond=None)
    if not inv_beta > 0:
        raise RuntimeError(f"the all-reduce times {seconds} do not grow with the size: no bandwidth to fit")
    return max(float(alpha), 0.0), 1.0 / float(inv_beta)


def repeat_noisy_probe(measure, read, repeats: int, attempts: int):
    """``read(measure(n))`` with n = ``repeats``, then twice that, ``attempts`` times in all, until ``read``
    accepts the measurement: ``read`` raises RuntimeError for a reading too noisy to use (a busy machine),
    and the last attempt's error is raised. Errors of ``measure`` itself (a rank that crashed) are not retried."""
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be a positive int, got {attempts!r}")
    for attempt in range(attempts):
        raw = measure(repeats * 2**attempt)
        try:
            return read(raw)
        except RuntimeError:
            if attempt == attempts - 1:
                raise


def measure_gloo_link(
    world: int = 2, sizes: tuple[int, ...] = PROBE_SIZES, repeats: int = 5, attempts: int = 3
) -> Link:
    """Start ``world`` processes, time gloo's all-reduce at ``sizes`` bytes, fit alpha and beta (see above).

    A busy machine can make a small all-reduce as slow as a large one, and then no bandwidth fits: the
    probe is run again with twice the repeats, ``attempts`` times in all, then the fit's error is raised.
    """
    from ..parallel.launch import launch

    if not isinstance(world, int) or world < 2:
        raise ValueError(f"a link needs at least 2 ranks to measure, got world={world!r}")
    alpha, beta = repeat_noisy_probe(
        lambda n: launch(_time_all_reduce, world, tuple(sizes), n, echo=False)[0],
        lambda seconds: fit_alpha_beta(sizes, seconds, world),
        repeats,
        attempts,
    )
    return Link(
        f"gloo loopback, {world} ranks",
        beta,
        alpha,
        f"measured: gloo all-reduce of {', '.join(f'{s // 1024} KiB' for s in sizes)} on {world} processes, "
        "fitted to the ring model",
    )


def rank_flops(thread_flops: float, cores: int, world: int, threads: int) -> float:
    """FLOP/s one of ``world`` ranks gets when all compute at once: its ``threads`` threads, at most its share
    of the cores. (The cluster keeps the unshared speed and the cores; ``step_time`` does the sharing.)"""
    return thread_flops * min(threads, cores / world)


def calibrate_efficiency(step_flops: float, step_seconds: float, flops: float, other_seconds: float = 0.0) -> float:
    """The efficiency a measured one-process step implies: its model FLOPs / (the time left for them x the
    probed FLOP/s), where ``other_seconds`` (the modelled overheads and optimizer step) are taken off first.

    A step faster than the probe allows (above 1) means the probe read low: the host was slower while it ran.
    The efficiency is then 1, with a warning that says by how much the step outran the probe."""
    if step_flops <= 0 or step_seconds <= 0 or flops <= 0:
        raise ValueError(f"need positive FLOPs, seconds and FLOP/s, got {step_flops}, {step_seconds}, {flops}")
    if not 0 <= other_seconds < step_seconds:
        raise ValueError(
            f"the modelled rest ({other_seconds:.3g} s) must leave time for the FLOPs ({step_seconds:.3g} s)"
        )
    implied = step_flops / ((step_seconds - other_seconds) * flops)
    if implied > 1:
        warnings.warn(
            f"the step ran at {implied:.0%} of the matmul probe's {flops / 1e9:.1f} GFLOP/s: the probe read low (the "
            "host was slower while it ran); the efficiency is taken as 100%, so predictions will run slow",
            stacklevel=2,
        )
    return min(1.0, implied)


def local_cluster(
    world: int,
    *,
    cores: int | None = None,
    thread_flops: float | None = None,
    link: Link | None = None,
    efficiency: float = 1.0,
    efficiency_source: str = "none given: the model's step would run at the matmul probe's speed",
    memory_bytes: float | None = None,
    threads: int | None = None,
    adam_rate: float | None = None,
    overheads: tuple[float, float] = (0.0, 0.0),
    sharing: Sharing | None = None,
) -> Cluster:
    """``world`` ranks on this CPU as a one-node ``Cluster`` in fp32 (see the module docstring).

    Anything not passed is measured now: ``thread_flops`` (one thread's matmul FLOP/s), ``link`` (gloo
    between ``world`` processes; a world of 1 gets a link that is never used), ``cores`` (os.cpu_count),
    ``threads`` per rank (what ``launch`` gives: $OMP_NUM_THREADS if set, else max(1, cores // world)).
    The accelerator's "16-bit peak" field holds what a rank's fp32 matmuls reach: the cost model
    reads it as the peak it applies ``efficiency`` to. ``sharing`` is not measured here (it times the
    model: ``shared_cores.measure_sharing``); without it, ideal turns on the cores are assumed.
    """
    cores = os.cpu_count() if cores is None else cores
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be a positive int, got {cores!r}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int (the number of ranks), got {world!r}")
    if threads is None:
        threads = int(os.environ.get("OMP_NUM_THREADS", max(1, cores // world)))
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    if thread_flops is None:
        thread_flops = measure_thread_flops()
    if not thread_flops > 0:
        raise ValueError(f"thread_flops must be positive FLOP/s, got {thread_flops!r}")
    if link is None:
        link = measure_gloo_link(world) if world > 1 else Link("none (one rank)", 1e12, 0.0, "one rank: unused")
    if memory_bytes is None:
        memory_bytes = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if adam_rate is None:
        adam_rate = measure_adam_rate()
    if not adam_rate > 0 or min(overheads) < 0:
        raise ValueError(f"adam_rate must be positive and overheads >= 0, got {adam_rate!r}, {overheads!r}")
    per_rank = thread_flops * threads  # unshared: step_time lets the ranks take turns on the cores
    bandwidth = adam_rate * threads
    cpu = Accelerator(
        f"this CPU, {world} rank(s) on {cores} core(s)",
        "CPU",
        per_rank,
        "fp32",
        per_rank,
        memory_bytes,
        bandwidth,
        source=f"measured: one thread's fp32 matmul at {thread_flops / 1e9:.1f} GFLOP/s x {threads} thread(s) per rank, "
        f"{world} rank(s) sharing {cores} cores; 'bandwidth': AdamW's step on one thread, 32 bytes per parameter",
    )
    host = Link("host memory (same RAM)", bandwidth, 0.0, "on a CPU the host is the device")
    return Cluster(
        f"this machine ({world} ranks)",
        cpu,
        world,
        1,
        link,
        link,
        efficiency,
        efficiency_source,
        host,
        bandwidth,
        notes=f"{link.name}: alpha {link.latency * 1e6:.0f} us, beta {link.bandwidth / 1e9:.2f} GB/s ({link.source}); "
        + (
            f"sharing: speed {sharing.speed:.2f}, wait {sharing.wait * 1e3:.2f} ms ({sharing.source})"
            if sharing
            else "sharing: assumed, ideal turns on the cores and no wait"
        ),
        precision="fp32",
        overlap=False,
        layer_overhead=overheads[0],
        micro_batch_overhead=overheads[1],
        cores=cores,
        threads=threads,
        sharing=sharing,
    )
