"""Spans of work on one rank, for the per-rank timelines of lessons 10 and 12.

Each wrapper that computes and communicates (``DDP``, ``NaiveDataParallel``, ``Pipeline``) keeps an
``EventLog``: a list of spans, each a dict with the rank, the lane ("compute" or "comm"), a label,
and start and end in seconds since the log was (re)started. ``launch`` gathers them from every rank
and ``llmedu.viz.timeline`` draws them; nothing here knows how they will be drawn.

Left out: clock synchronisation between machines (ranks line up only through the barrier in
``restart``, which is exact enough on one host), and nested spans.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["EventLog"]


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
