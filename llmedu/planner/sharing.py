"""What ranks that share one CPU cost each other: the two numbers the cost model charges for it.

``Sharing`` is a record, nothing more: ``speed``, the fraction of its speed alone that a rank keeps
while all ``world`` ranks compute, and ``wait``, the seconds each hop of a blocking message costs beyond
the link's alpha-beta. ``shared_cores`` says how both are measured (and why the last rank, not the
median one, sets the speed); ``clusters.Cluster`` carries one; ``step_time`` divides each rank's CPU
work by ``speed`` and charges ``wait`` for every hop (``messages.blocking_hops``). GPU presets have none.

It sits at the bottom of the planner and imports nothing of it, so the cluster that carries it and the
probe that measures it both stand on it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Sharing"]


@dataclass(frozen=True)
class Sharing:
    """How ``world`` single-thread ranks on one CPU slow each other down (``shared_cores`` measures it)."""

    world: int
    speed: float  # fraction of its alone speed a rank keeps when all compute at once, in (0, 1]
    wait: float  # seconds a blocking message costs beyond the link's alpha-beta, >= 0
    source: str
    measured: float | None = None  # the probe's reading of speed before clipping at 1 (None: not probed)
    noise: float = 0.0  # half the range of the probe's repeated readings of speed

    def __post_init__(self):
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"world must be a positive int, got {self.world!r}")
        if not 0 < self.speed <= 1:
            raise ValueError(f"speed must be in (0, 1] (a fraction of the speed alone), got {self.speed!r}")
        if not self.wait >= 0:
            raise ValueError(f"wait must be >= 0 seconds, got {self.wait!r}")
        if not self.noise >= 0 or (self.measured is not None and not self.measured > 0):
            raise ValueError(f"need noise >= 0 and a positive measured speed, got {self.noise!r}, {self.measured!r}")
