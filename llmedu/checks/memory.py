"""Graders for the memory lesson (06): the bytes of model states per rank under ZeRO.

check_zero_bytes(fn)   fn(n_params, world_size, stage) -> bytes of model states on one rank,
                       mixed precision with Adam (K = 12), ZeRO stage 0 (plain data parallel) to 3
"""

from __future__ import annotations

from llmedu.checks.core import CheckResult, Grader
from llmedu.memory.estimate import zero_bytes_per_rank

__all__ = ["check_zero_bytes"]

# (Ψ, N): a round number, ZeRO's Figure 1 (7.5B on 64 GPUs), and a Ψ that N does not divide.
_CASES = [(1_000_000, 8), (7_500_000_000, 64), (124_439_808, 3)]


def check_zero_bytes(fn) -> CheckResult:
    """Grade ``fn(n_params, world_size, stage)`` against (2+2+K)Ψ, 2Ψ+2Ψ+KΨ/N, 2Ψ+(2+K)Ψ/N, (2+2+K)Ψ/N."""
    g = Grader("check_zero_bytes")
    for n_params, world_size in _CASES:
        for stage in (0, 1, 2, 3):
            expected = sum(zero_bytes_per_rank(n_params, world_size, stage).values())
            got = g.call(fn, n_params, world_size, stage)
            g.compare(f"Ψ={n_params:,} parameters on N={world_size} ranks, stage {stage}", got, expected, rtol=1e-9)
    return g.result()
