"""Spans of work on one rank, for the per-rank timelines of lessons 11 and 13.

Each wrapper that computes and communicates (``DDP``, ``NaiveDataParallel``, ``Pipeline``) keeps an
``EventLog``: a list of spans, each a dict with the rank, the lane ("compute" or "comm"), a label,
and start and end in seconds since the log was (re)started. ``launch`` gathers them from every rank
and ``llmedu.viz.timeline`` draws them; nothing here knows how they will be drawn. The wrappers' own
methods do no timing: ``data_parallel`` records its spans with hooks installed beside the algorithm.
``hidden_communication`` measures, from the spans, how much of the communication overlapped compute.

Left out: clock synchronisation between machines (ranks line up only through the barrier in
``restart``, which is exact enough on one host), and nested spans.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["EventLog", "hidden_communication"]


class EventLog:
    """Spans of work on this rank: dicts with rank, lane ("compute"/"comm"), label, start, end."""

    def __init__(self):
        self.events: list[dict] = []
        self.rank = dist.get_rank()
        self.t0 = time.perf_counter()

    def restart(self) -> None:
        """Forget the events; time 0 is now, taken just after a barrier so that ranks line up."""
        dist.barrier()
        self.events.clear()
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, lane: str, label: str, start: float, end: float) -> None:
        self.events.append(dict(rank=self.rank, lane=lane, label=label, start=start, end=end))

    @contextmanager
    def span(self, lane: str, label: str) -> Iterator[None]:
        start = self.now()
        yield
        self.add(lane, label, start, self.now())


def hidden_communication(events: list[dict]) -> float:
    """The fraction of communication time during which the same rank was also computing.

    0 means every all-reduce waited for backward to finish; 1 means all of it was hidden.
    """
    hidden = total = 0.0
    for c in (e for e in events if e["lane"] == "comm"):
        total += c["end"] - c["start"]
        for w in (e for e in events if e["lane"] == "compute" and e["rank"] == c["rank"]):
            hidden += max(0.0, min(c["end"], w["end"]) - max(c["start"], w["start"]))
    if total == 0:
        raise ValueError("no communication events to measure")
    return hidden / total
