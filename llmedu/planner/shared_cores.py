"""Ranks that share one CPU: how fast each computes when all do, and what a blocking message costs them.

On a GPU cluster every rank has its own accelerator: its speed does not depend on what the other ranks
do, and a collective starts as soon as the last rank calls it. Several processes on one CPU (lesson 14's
"predicted vs measured") break both, and ``bench_planner`` showed by how much: two ranks on this
machine's two cores ran data parallelism no faster than one process, and layouts with many blocking
collectives (ZeRO's per-layer gathers, TP's all-reduces) missed by a few ms per collective. Two terms,
each **measured** with ``world`` processes of one thread each (``measure_sharing``):

* ``speed``: the fraction of its speed alone that one rank keeps while all ``world`` ranks compute.
  Timed on the model's own work (one micro-batch's forward and backward and AdamW's step): rank 0 runs
  ``steps`` of them alone (the others asleep in a collective), then every rank runs ``steps`` at once,
  alternating, so that the machine's drift cancels in the ratio; speed = time alone / the time until the
  *last* rank is done. The last, because the ranks of a training step meet at every collective, so a
  step goes at its slowest rank; and because per-rank times read too fast: a rank that finishes early
  leaves its core to the others (the first version of this probe took each rank's own median and read
  57% for 4 ranks on 2 cores, more than the cores can give). Ideal cores give at most the ideal share
  min(1, cores / ranks); cores that share caches, a memory bus or a host with other tenants give less.
  This machine's two vCPUs gave two such steps at once about half their speed alone in one probe (a
  matmul alone scaled ~1.6x, layer norm + GELU ~1.1x), and more or less in others. The probe is repeated
  (``repeats`` alone/together pairs); its reading is their median, its ``noise`` half their range. A
  reading above the ideal share within the noise is read as the share (no slowdown beyond the cores'
  count), the raw reading and the noise kept (``Sharing.measured``, ``noise``, and said in ``source``).
  Beyond the noise it is not a measurement of sharing (ranks cannot get more than the cores; the machine
  changed speed between the alone and together halves of a pair), so the probe runs again with twice the
  repeats, up to ``attempts`` times, then is refused, as ``probes.local_cluster``'s gloo probe refuses a noisy
  fit. Without ``cores`` the share is 1 (nothing is known of the cores).
* ``wait``: what each hop of a blocking collective costs beyond the link's alpha-beta when the ranks
  compute between collectives, as in a training step (the link is fitted to all-reduces of 4 KiB to
  4 MiB with the ranks idle). Each rank alternates a 512 x 512 matmul and a 4 KiB all-reduce;
  ``wait`` = (time of the pair - time of the matmul alone, all ranks running - the link's model of that
  all-reduce) / its 2 (world - 1) ring steps. Per hop because a hop is the unit that waits: each one
  wakes a process, on a core that another rank may be computing on.

``step_time`` charges ``wait`` for every hop of the busiest rank's blocking messages
(``messages.blocking_hops``, counted from our wrappers' code: 2 (p - 1) for an all-reduce over p ranks, p - 1 for
a reduce-scatter or all-gather, 1 for a pipeline's receive) and divides each rank's CPU work by
``speed``. GPU presets have neither (speed 1, wait 0), so nothing changes for them.

What the probes showed, and what this leaves out. The hypothesis this module started from (a collective
waits longer when its peers are busy computing than when they are idle) was not what the measurements
showed: with 4 ranks on 2 cores a 4 KiB all-reduce took about as long between matmuls as back to back
(~6 ms either way, scattered by +-1.5 ms), and about twice the fitted link's 6 alpha; with 2 ranks the
busy round exceeded the idle one by 0.1-0.8 ms. So ``wait`` is mostly the small-message latency that the
alpha-beta fit (dominated by the large sizes) misses, plus the scheduling, not a busy-peer effect alone.
It is probed with one message size and one amount of work between messages; gloo's reduce-scatter
(about an all-reduce's time in the same probe) and all-gather are charged as rings of p - 1 hops; a
receive is charged one hop though it wakes one process, not a ring; neither term depends on which
ranks share a core (the OS decides, and moves them). The messages counted here are the ones whose
alpha-beta ``step_time`` charges (``messages.tp_collectives`` and ``dp_collectives`` count both).
"""

from __future__ import annotations

import statistics
import time

import torch

from .clusters import all_reduce_time
from .probes import repeat_noisy_probe
from .sharing import Sharing

__all__ = ["measure_sharing", "sharing_from"]


def _model_step(cfg, micro_batch: int):
    """One rank's own work: forward + backward of a (micro_batch, T) micro-batch and AdamW's step."""
    from ..models.gpt import CausalLM, lm_loss

    torch.manual_seed(0)
    model = CausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.zeros(micro_batch, cfg.max_seq_len, dtype=torch.long)  # (b, T)

    def step():
        lm_loss(model(ids), ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


def _probe(cfg, micro_batch: int, steps: int, work_n: int, rounds: int, repeats: int) -> tuple[list, float, float]:
    """In each rank: (the ``repeats`` readings of speed: ``steps`` steps of rank 0 alone over ``steps`` steps of
    every rank at once, until the last is done; the slowest rank's median round of matmul work, and of the same
    work + a 4 KiB all-reduce). Alone and together alternate, so that the machine's drift in speed (other
    tenants, clocks) cancels in the ratio."""
    import torch.distributed as dist

    def total(value: float, op=dist.ReduceOp.SUM) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return t.item()

    rank = dist.get_rank()
    step = _model_step(cfg, micro_batch)
    step()  # warm-up: the optimizer's state, allocations

    def run_steps() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return time.perf_counter() - start

    speeds = []
    for _ in range(repeats):
        dist.barrier()
        alone = total(run_steps() if rank == 0 else 0.0)  # the others wait in the collective
        dist.barrier()
        speeds.append(alone / total(run_steps(), dist.ReduceOp.MAX))  # until the last rank is done
    a, b, x = torch.randn(work_n, work_n), torch.randn(work_n, work_n), torch.ones(1024)  # x: 4 KiB

    def both():
        a @ b
        dist.all_reduce(x)

    def per_round(call) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            call()
        return total((time.perf_counter() - start) / rounds, dist.ReduceOp.MAX)

    both()
    pairs = [(per_round(lambda: a @ b), per_round(both)) for _ in range(repeats)]
    return speeds, statistics.median(w for w, _ in pairs), statistics.median(p for _, p in pairs)


def measure_sharing(
    cfg,
    world: int,
    link,
    *,
    micro_batch: int = 1,
    steps: int = 4,
    work_n: int = 512,
    rounds: int = 40,
    repeats: int = 5,
    attempts: int = 3,
    cores: int | None = None,
) -> Sharing:
    """Measure ``speed`` and ``wait`` for ``world`` ranks of one thread (the module docstring says how).

    ``cfg`` is the model whose step (a micro-batch of ``micro_batch`` sequences) is timed; ``link`` the
    ``clusters.Link`` measured for this world (its alpha-beta of a 4 KiB all-reduce is taken off the round);
    ``cores`` the machine's cores, which bound the speed (``sharing_from``). A speed read above that bound
    beyond its noise, or a round with the all-reduce timed faster than without it, is probed again with
    twice the repeats, ``attempts`` times in all, then refused (RuntimeError).
    """
    from ..parallel.launch import launch  # looked up at each call, so that a test can stand in for it

    if not isinstance(world, int) or world < 2:
        raise ValueError(f"sharing needs at least 2 ranks to measure, got world={world!r}")
    modelled = all_reduce_time(4096, world, link)[0]

    def read(probed) -> Sharing:
        speeds, work, paired = probed
        if paired < work:  # a busy machine: the work alone was timed slower than the same work + a message
            raise RuntimeError(
                f"the sharing probe timed a round of matmul + 4 KiB all-reduce {(work - paired) * 1e3:.2f} ms faster "
                "than the matmul alone, so the machine's speed changed during the probe; run it again on a quieter "
                "machine (or with more repeats)"
            )
        noise = (max(speeds) - min(speeds)) / 2
        return sharing_from(world, statistics.median(speeds), paired - work, modelled, noise=noise, cores=cores)

    return repeat_noisy_probe(
        lambda n: launch(_probe, world, cfg, micro_batch, steps, work_n, rounds, n, echo=False)[0],
        read,
        repeats,
        attempts,
    )


def sharing_from(
    world: int, speed: float, message: float, modelled: float, *, noise: float = 0.0, cores: int | None = None
) -> Sharing:
    """The two terms from the probe: ``speed``, the time of rank 0's steps alone over the same steps on all
    ranks at once (the median of the repeats; ``noise``: half their range), a 4 KiB all-reduce round under load
    (``message``: work + all-reduce - work, s) and the link's model of it (s). The wait is per hop: what the
    round exceeds the model by, over the all-reduce's 2 (world - 1) ring steps.

    ``world`` one-thread ranks on ``cores`` cores can keep at most the ideal share, min(1, cores / world) of
    their speed alone (1 when ``cores`` is not given). A reading above the share within the noise is read as
    the share (the raw reading kept in ``measured``); beyond it, RuntimeError: the machine's speed changed
    during the probe, since ranks cannot get more than the cores."""
    if not speed > 0 or message < 0 or modelled < 0 or not noise >= 0:
        raise ValueError(
            f"need a positive speed, message times >= 0 and noise >= 0, got {speed}, {message}, {modelled}, {noise}"
        )
    if cores is not None and (not isinstance(cores, int) or cores < 1):
        raise ValueError(f"cores must be a positive int, got {cores!r}")
    share = 1.0 if cores is None else min(1.0, cores / world)
    bound = "100%" if share == 1 else f"the ideal share of {cores} cores ({share:.0%})"
    if speed > share + noise:
        faster = "together than alone" if share == 1 else f"than {bound}"
        raise RuntimeError(
            f"the sharing probe read {speed:.0%} +- {noise:.0%} of the speed alone on {world} ranks: faster "
            f"{faster} beyond its noise, so the machine's speed changed during the probe; run it again on a "
            "quieter machine (or with more repeats)"
        )
    wait = max(0.0, message - modelled) / (2 * (world - 1))
    read = f"{speed:.0%} +- {noise:.0%}"
    if speed > share:
        read += f", above {bound} within its noise: read as {share:.0%}"
    source = (
        f"measured on {world} one-thread processes: each keeps {min(speed, share):.0%} of its speed alone in the "
        f"model's step while all compute (read {read}); a 4 KiB all-reduce between matmuls {message * 1e3:.2f} ms "
        f"vs {modelled * 1e3:.2f} ms by the idle link's alpha-beta, over {2 * (world - 1)} hops"
    )
    return Sharing(world, min(share, speed), wait, source, measured=speed, noise=noise)
