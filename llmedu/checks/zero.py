"""Graders for the ZeRO lesson (14): sharding a flat buffer, and what each stage sends.

check_shard(fn)          fn(numel, world_size) -> (shard_size, padding): the flat buffer is padded
                         with zeros to world_size * shard_size, the smallest multiple that holds it
check_comm_volume(fn)    fn(n_params, world_size, stage) -> elements each rank sends per step, ring
                         collectives: stages 0-2 send 2Ψ(N-1)/N (ZeRO §7.2.1), stage 3 3Ψ(N-1)/N (§7.2.2)
check_lowest_stage(fn)   fn(n_params, gpus, card_bytes) -> the lowest ZeRO stage (0-3) whose model states
                         (mixed precision, Adam, K = 12) fit on one card, or None when none does
check_offload_traffic(fn)
                         fn(n_params, world_size) -> (bytes to the host, bytes back to the device) per
                         rank per step for ``ZeROOffload`` as written: the fp32 gradient shard goes down,
                         the updated shard comes back in bf16
"""

from __future__ import annotations

from llmedu.checks.core import CheckResult, Grader

__all__ = ["check_shard", "check_comm_volume", "check_lowest_stage", "check_offload_traffic"]

# sizes that divide, that do not, smaller than the world, and 0 (a unit with no parameters)
_SHARD_CASES = [(12, 4), (13, 4), (3, 4), (1, 1), (7_000_003, 8), (0, 2)]
_VOLUME_CASES = [(1_000_000, 8), (7_000_000_000, 64), (124_439_808, 3), (10, 1), (1_000_003, 8)]
# (Ψ, GPUs, card): a small model, 7B and 13B and 70B on 40 and 80 GB cards, where each stage is the answer once
_FIT_CASES = [
    (1_000_000_000, 8, 80e9),
    (7_000_000_000, 8, 80e9),
    (13_000_000_000, 16, 40e9),
    (13_000_000_000, 8, 80e9),
    (70_000_000_000, 64, 80e9),
    (70_000_000_000, 8, 80e9),
    (7_000_000_000, 1, 80e9),
]


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


def _model_states(n: int, world: int, stage: int) -> float:
    """(2 + 2 + 12)Ψ bytes of mixed-precision Adam, the optimizer state, gradients and weights sharded in turn."""
    return (
        2 * n / (world if stage >= 3 else 1)
        + 2 * n / (world if stage >= 2 else 1)
        + 12 * n / (world if stage >= 1 else 1)
    )


def check_lowest_stage(fn) -> CheckResult:
    """Grade ``fn(n_params, gpus, card_bytes)``: the lowest stage whose per-GPU model states fit, else None."""
    g = Grader("check_lowest_stage")
    for n, gpus, card in _FIT_CASES:
        expected = next((stage for stage in range(4) if _model_states(n, gpus, stage) <= card), None)
        g.compare(f"Ψ={n / 1e9:g}B on {gpus} GPUs of {card / 1e9:g} GB", g.call(fn, n, gpus, card), expected)
    return g.result()


def check_offload_traffic(fn) -> CheckResult:
    """Grade ``fn(n_params, world_size) -> (to_host, to_device)`` bytes per rank per step of our ZeROOffload."""
    g = Grader("check_offload_traffic")
    for n, world in _VOLUME_CASES:
        shard = -(-n // world)  # each unit pads to N shards; one unit here
        g.compare(f"Ψ={n:,} on N={world}", g.call(fn, n, world), (4 * shard, 2 * shard))
    return g.result()
