"""Peak memory and time of attention implementations, forward and backward, in turns (lesson 17).

``measure(impls, lengths)`` gives, for each sequence length, each implementation's peak memory over one
forward and backward (``MemoryTracker``: every tensor an operator allocates, so not a fused kernel's internal
scratch) and its time in rounds: in each round every implementation runs once, so that a busy moment of a
shared machine slows all of them, not one. ``verdict`` reads two implementations' per-round ratios: resolved
only when every round falls on the same side of 1, which five rounds of pure noise do with probability
2 x 2^-5 = 1/16. What it leaves out: warm-up runs (the first round pays them), and any timing finer than
``runtime.Timer``'s (which synchronises a GPU before it reads the clock).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import runtime
from ..memory.tracker import MemoryTracker

MiB = 2**20


@dataclass
class Measured:
    """What ``measure`` found: ``peak_mib[name][i]`` and the rounds ``ms[name][i]`` at ``lengths[i]``."""

    lengths: list[int]
    peak_mib: dict[str, list[float]] = field(default_factory=dict)
    ms: dict[str, list[list[float]]] = field(default_factory=dict)

    def line(self, i: int) -> str:
        """One length's peaks and median times [min-max], as the lesson prints them."""
        memory = "  ".join(f"{name} {peaks[i]:6.1f}" for name, peaks in self.peak_mib.items())
        timing = "  ".join(
            f"{n} {statistics.median(r[i]):5.0f} [{min(r[i]):.0f}-{max(r[i]):.0f}]" for n, r in self.ms.items()
        )
        repeats = len(next(iter(self.ms.values()))[i])
        return f"T={self.lengths[i]:>5}: peak MiB  {memory} | ms, median [min-max] of {repeats}:  {timing}"

    def verdict(self, a: str, b: str, i: int) -> str:
        """``a``'s time over ``b``'s at ``lengths[i]``, round by round: the median ratio, its range, and whether
        every round falls on the same side of 1."""
        ratios = [x / y for x, y in zip(self.ms[a][i], self.ms[b][i])]
        side = "(resolved)" if min(ratios) > 1 or max(ratios) < 1 else "(not resolved)"
        return f"{a}/{b} {statistics.median(ratios):5.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] {side}"


def measure(
    impls: dict[str, Callable],
    lengths: list[int],
    repeats: int = 5,
    heads: int = 4,
    head_dim: int = 64,
    device: str | torch.device = "cpu",
    echo: Callable[[str], None] | None = print,
) -> Measured:
    """Peak memory and ``repeats`` rounds of timing of ``fn(q, k, v).sum().backward()`` for each ``fn`` of
    ``impls``, on one sequence of each length (q, k, v of shape (1, heads, T, head_dim), fp32); ``echo`` gets
    each length's line as soon as it is measured."""
    if repeats < 1 or not impls or not lengths:
        raise ValueError(
            f"need at least one implementation, one length and one repeat, got {impls}, {lengths}, {repeats}"
        )
    found = Measured(list(lengths), {name: [] for name in impls}, {name: [] for name in impls})
    for i, T in enumerate(lengths):
        q, k, v = (torch.randn(1, heads, T, head_dim, device=device, requires_grad=True) for _ in range(3))
        for name, fn in impls.items():
            with MemoryTracker(torch.nn.Module(), device=device) as tracker:
                fn(q, k, v).sum().backward()
            found.peak_mib[name].append(tracker.peak_bytes / MiB)
            found.ms[name].append([])
        for _ in range(repeats):  # rounds: the implementations take turns
            for name, fn in impls.items():
                with runtime.Timer(device) as t:
                    fn(q, k, v).sum().backward()
                found.ms[name][-1].append(1e3 * t.seconds)
        if echo is not None:
            echo(found.line(i))
    return found
