"""Graders for the ZeRO lesson (14): sharding a flat buffer, and what each stage sends.

check_shard(fn)          fn(numel, world_size) -> (shard_size, padding): the flat buffer is padded
                         with zeros to world_size * shard_size, the smallest multiple that holds it
check_comm_volume(fn)    fn(n_params, world_size, stage) -> elements each rank sends per step, ring
                         collectives: stages 0-2 send 2Ψ(N-1)/N (ZeRO §7.2.1), stage 3 3Ψ(N-1)/N (§7.2.2)
"""

from __future__ import annotations

from llmedu.checks.core import CheckResult, Grader

__all__ = ["check_shard", "check_comm_volume"]

# sizes that divide, that do not, smaller than the world, and 0 (a unit with no parameters)
_SHARD_CASES = [(12, 4), (13, 4), (3, 4), (1, 1), (7_000_003, 8), (0, 2)]
_VOLUME_CASES = [(1_000_000, 8), (7_000_000_000, 64), (124_439_808, 3), (10, 1)]


def check_shard(fn) -> CheckResult:
    """Grade ``fn(numel, world_size) -> (shard_size, padding)`` against ceil(numel / N) and the remainder."""
    g = Grader("check_shard")
    for numel, world in _SHARD_CASES:
        shard = -(-numel // world)
        g.compare(f"numel={numel:,} on N={world}", g.call(fn, numel, world), (shard, shard * world - numel))
    return g.result()


def check_comm_volume(fn) -> CheckResult:
    """Grade ``fn(n_params, world_size, stage)``: per-rank elements sent in one step, stages 0-3."""
    g = Grader("check_comm_volume")
    for n, world in _VOLUME_CASES:
        for stage in (0, 1, 2, 3):
            # a reduce-scatter and an all-gather of Ψ each send Ψ(N-1)/N; stage 3 gathers twice
            collectives = 3 if stage == 3 else 2
            expected = collectives * n * (world - 1) / world
            got = g.call(fn, n, world, stage)
            g.compare(f"Ψ={n:,} on N={world}, stage {stage}", got, expected, rtol=1e-9)
    return g.result()
