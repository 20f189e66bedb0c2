"""Measuring pipeline schedules on a shared CPU: stages of known time, a link of known latency, repeats.

This is the rig of lesson 13, not the technique (``pipeline_parallel.py``). Two questions a 2-core
machine cannot answer by timing real layers get controlled parts instead:

* **the bubble**: every stage is a ``SleepStage`` (forward ``t_f``; backward ``2 t_f``, half input and
  half weight gradient), so a step's idle share can be set beside (p-1)/(m+p-1) and its kin;
* **hidden communication**: the messages between stages go over a ``Link`` (link.py): each arrives
  ``alpha + bytes / beta`` after it is sent, the wait a sleep in a background thread, like a network
  card. With ``overlap=False`` each send holds its rank until it has left.

``time_steps`` runs in every rank of a ``launch``; ``gather`` puts the ranks' results together (a step
lasts until its slowest rank ends); ``predicted_step`` is the model: ``simulate`` with the same
durations and latency; ``posted_late`` reads from the link's records how long after its send each
receive was posted (a message cannot arrive before its receive is posted). ``loss_gaps`` trains the pipeline and one process side by side and returns the
per-step gap between their losses, in any dtype.

Left out: real layers (see ``benchmarks/bench_pipeline.py`` for the schedules on a GPT), and
contention between the messages of one link, which the model ignores (each rank's link carries one
message per direction at a time; with ``alpha`` below ``t_f`` they rarely meet).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from ..models import CausalLM, TransformerConfig
from ..models.gpt import lm_loss
from .link import Link
from .pipeline_parallel import Pipeline, stage_chunks
from .pipeline_schedules import schedule, simulate
from .pipeline_stages import SleepStage

__all__ = ["time_steps", "gather", "posted_late", "message_seconds", "predicted_step", "quartiles", "verdict"]
__all__ += ["loss_gaps"]

ROWS, WIDTH = 4, 64  # one micro-batch: (ROWS, WIDTH) float32, 1 KiB per message


def _mse(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (y - target).pow(2).mean()


def time_steps(name: str, n_micro: int, t_f: float, repeats: int, n_chunks: int = 1, link=None, overlap=True):
    """On each rank: one warm-up step, then ``repeats`` timed steps of schedule ``name`` with stages of
    forward ``t_f`` seconds (a rank's ``n_chunks`` chunks share it), over ``Link(*link)`` if given.
    Returns this rank's step ends, events of every step (seconds from the step's start), peak, and with
    a link, every step's posts: (direction, Message, launch time from the link's records)."""
    torch.manual_seed(0)
    chunks = [SleepStage(WIDTH, t_f / n_chunks) for _ in range(n_chunks)]  # one stage's work, cut in n_chunks
    wire = Link(*link) if link is not None else None
    pipe = Pipeline(chunks, list(range(dist.get_world_size())), _mse, lambda x: x.shape, link=wire, overlap=overlap)
    x = torch.randn(ROWS * n_micro, WIDTH)
    pipe.step(x, x, n_micro, name)  # warm-up
    ends, events, posts = [], [], []
    for _ in range(repeats):
        pipe.log.restart()  # a barrier, then time zero
        n = len(wire.records) if wire else 0
        pipe.step(x, x, n_micro, name)
        ends.append(pipe.log.now())
        events.append(list(pipe.log.events))
        if wire:  # the step's link records, one per operation the mailbox posted, in the same order
            records = wire.records[n:]
            assert [r["op"] for r in records] == [d for d, _, _ in pipe.posts], "link records and posts differ"
            posts.append([(d, key, r["launched"]) for (d, _, key), r in zip(pipe.posts, records)])
    return dict(ends=ends, events=events, peak=pipe.peak_in_flight, posts=posts)


def gather(per_rank: list[dict]) -> tuple[list[float], list[list[dict]]]:
    """The step times (the slowest rank's end, per repeat) and each repeat's events of all ranks."""
    steps = [max(ends) for ends in zip(*(r["ends"] for r in per_rank))]
    events = [[e for r in per_rank for e in r["events"][i]] for i in range(len(steps))]
    return steps, events


def posted_late(per_rank: list[dict], repeat: int) -> dict:
    """How long after its message was sent each receive was posted, in timed step ``repeat``: {Message:
    seconds}, negative where the receive was posted first (``time.perf_counter``: one clock on a host)."""
    sent, posted = {}, {}
    for r in per_rank:
        for direction, key, launched in r["posts"][repeat]:
            (sent if direction == "send" else posted)[key] = launched
    return {key: posted[key] - sent[key] for key in sent}


def message_seconds(alpha: float, beta: float) -> float:
    """The time of one message between stages on ``Link(alpha, beta)``: one micro-batch's activation."""
    return Link(alpha, beta).message_time(ROWS * WIDTH * 4)


def predicted_step(name, n_stages, n_micro, t_f, n_chunks=1, latency=0.0, blocking=False) -> float:
    """The model: ``simulate`` with F t_f/v, B 2t_f/v (zb-h1: F, I, W t_f each) and ``latency`` per message."""
    v = n_chunks
    times = {"F": t_f / v, "B": 2 * t_f / v, "I": t_f / v, "W": t_f / v}
    per_rank = [schedule(name, n_micro, n_stages, r, v) for r in range(n_stages)]
    return max(e["end"] for e in simulate(per_rank, times, latency, blocking))


def quartiles(values: list[float]) -> tuple[float, float]:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def verdict(a: list[float], b: list[float]) -> str:
    """Is the difference between two samples' medians beyond their spread?"""
    (a1, a3), (b1, b3) = quartiles(a), quartiles(b)
    return "resolved (the quartile ranges do not overlap)" if a3 < b1 or b3 < a1 else "not resolved beyond the spread"


def loss_gaps(name: str, n_micro: int, steps: int, dtype: torch.dtype, config: dict, batch: int = 12) -> dict:
    """Train a ``CausalLM`` with SGD for ``steps`` steps as a pipeline over this launch's ranks and, on
    the last rank, as one process; returns {"gaps": |pipeline loss - one process's loss|, "losses": one
    process's loss} per step on the last rank (empty lists elsewhere). Both start from the same weights
    and see the same four batches in turn, so that the loss falls. (Adam would divide tiny gradients by
    their own tiny size: on a loss that does not fall it amplifies a rounding difference step by step.)"""
    rank, p = dist.get_rank(), dist.get_world_size()
    cfg = TransformerConfig(**config)
    torch.manual_seed(0)
    chunks = stage_chunks(CausalLM(cfg).to(dtype), rank, p)
    pipe = Pipeline(chunks, list(range(p)), lm_loss, lambda x: (*x.shape, cfg.d_model), dtype=dtype)
    torch.manual_seed(0)
    oracle = CausalLM(cfg).to(dtype)  # the same initial weights: the same seed, the same order of draws
    opt, opt_one = torch.optim.SGD(chunks.parameters(), lr=0.5), torch.optim.SGD(oracle.parameters(), lr=0.5)
    data, gaps, losses = torch.Generator().manual_seed(1), [], []
    corpus = torch.randint(0, cfg.vocab_size, (4 * batch, cfg.max_seq_len), generator=data)  # 4 batches, in turn
    for step in range(steps):
        ids = corpus[step % 4 * batch :][:batch]  # (B, T)
        opt.zero_grad()
        loss = pipe.step(ids, ids, n_micro, name)
        opt.step()
        if pipe.is_last:
            opt_one.zero_grad()
            one = lm_loss(oracle(ids), ids)
            one.backward()
            opt_one.step()
            gaps.append((loss - one.detach()).abs().item())
            losses.append(one.item())
    return dict(gaps=gaps, losses=losses)
