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

The exercises of lesson 14 (each enforces its method, not only the value):

check_unit_bytes(fn)     fn(unit_sizes, world_size, stage, compute_bytes) -> {"parameters", "gradients",
                         "optimizer"}: the bytes our ``ZeRO`` keeps on one rank between backward and step,
                         each unit padded to N·S; predicted from the sizes, so building any tensor fails
check_gradient_shards(fn)
                         fn(grads, ranks) -> each rank's (S,) shard of the averaged gradient, the fix of
                         ``buggy_gradient_shards``; ``ranks`` (``SimulatedRanks``) counts what each rank
                         sends, and only one reduce-scatter passes (an all-reduce gets the values too)
check_stage_choice(fn)   fn(n_params, largest_unit, gpus, card_bytes, activation_bytes) -> the stage 0-3
                         that fits with the least bytes sent, or None, transient buffers counted; part of
                         the scenarios are drawn at random on each call, so no table of answers passes
"""

from __future__ import annotations

import random

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmedu.checks.core import FAILED, CheckResult, Grader

__all__ = [
    "check_shard",
    "check_comm_volume",
    "check_lowest_stage",
    "check_offload_traffic",
    "check_unit_bytes",
    "check_gradient_shards",
    "check_stage_choice",
    "SimulatedRanks",
    "buggy_gradient_shards",
]

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


# -- exercise 1: predict what our ZeRO keeps ----------------------------------------------------------


class _TensorOps(TorchDispatchMode):
    """Counts the ATen ops run inside the block (a prediction from sizes needs none)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _unit_bytes(sizes: list[int], world: int, stage: int, compute_bytes: int) -> dict[str, int]:
    """What ``zero.ZeRO1/2/3`` keep: per unit a full copy of N·S elements (stages 1-2, compute dtype), an fp32
    master shard of S (a slice of that copy when it is fp32 itself), the gradient (stage 1: the full copy's, in
    the compute dtype; stages 2-3: the fp32 shard's) and AdamW's two fp32 moments of S."""
    shards = [-(-n // world) for n in sizes]  # S per unit
    s, full = sum(shards), world * sum(shards)
    if stage == 3:
        return {"parameters": 4 * s, "gradients": 4 * s, "optimizer": 8 * s}
    master = 0 if compute_bytes == 4 else 4 * s
    grads = compute_bytes * full if stage == 1 else 4 * s
    return {"parameters": compute_bytes * full + master, "gradients": grads, "optimizer": 8 * s}


# (unit sizes, N): the test's Tiny (35, 35, 49), units smaller than N, and a GPT-2-small-like model
_UNIT_CASES = [([35, 35, 49], 4), ([5, 1, 3], 4), ([7_087_872] * 12 + [38_597_376 + 1_536], 8), ([1000, 24], 3)]


def check_unit_bytes(fn) -> CheckResult:
    """Grade ``fn(unit_sizes, world_size, stage, compute_bytes)``: our ZeRO's bytes per rank, from the sizes alone."""
    g = Grader("check_unit_bytes")
    for sizes, world in _UNIT_CASES:
        for stage in (1, 2, 3):
            for compute_bytes in (4, 2):
                with _TensorOps() as recorder:
                    got = g.call(fn, list(sizes), world, stage, compute_bytes)
                where = f"units {sizes[:3]}{'...' if len(sizes) > 3 else ''} on N={world}, stage {stage}, "
                where += f"{compute_bytes}-byte compute"
                g.expect(
                    where,
                    got is FAILED or not recorder.ops,
                    f"your function ran tensor ops ({', '.join(sorted(set(recorder.ops))[:4])}): predict the bytes "
                    "from the sizes with integers, do not build the buffers",
                )
                g.compare(where, got, _unit_bytes(sizes, world, stage, compute_bytes))
    return g.result()


# -- exercise 2: find the bug in a gradient sharding ---------------------------------------------------


class SimulatedRanks:
    """N ranks in one process: each collective takes one tensor per rank and returns one per rank.

    It counts the elements each rank sends with ring collectives (``sent``) and the collectives called
    (``calls``); a rank's own tensors are all it may read, so everything else must come through these.
    """

    def __init__(self, world: int):
        self.world, self.sent, self.calls = world, 0, []

    def _check(self, tensors: list[torch.Tensor], name: str) -> None:
        if len(tensors) != self.world or len({t.shape for t in tensors}) != 1:
            raise ValueError(f"{name} takes one tensor per rank, all of one shape ({self.world} ranks)")

    def reduce_scatter(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """N (N·S,) -> N (S,): rank r receives the sum over the ranks of elements [r·S, (r+1)·S)."""
        self._check(flats, "reduce_scatter")
        if flats[0].numel() % self.world:
            raise ValueError(f"reduce_scatter needs a length divisible by {self.world}, got {flats[0].numel()}")
        size = flats[0].numel() // self.world
        total = torch.stack(flats).sum(0)
        self.sent, self.calls = self.sent + (self.world - 1) * size, [*self.calls, "reduce_scatter"]
        return [total[r * size : (r + 1) * size].clone() for r in range(self.world)]

    def all_reduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """N (M,) -> N (M,): every rank receives the sum."""
        self._check(tensors, "all_reduce")
        total = torch.stack(tensors).sum(0)
        self.sent += 2 * (self.world - 1) * total.numel() // self.world
        self.calls = [*self.calls, "all_reduce"]
        return [total.clone() for _ in range(self.world)]

    def all_gather(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """N (S,) -> N (N·S,): every rank receives the shards in rank order."""
        self._check(shards, "all_gather")
        self.sent += (self.world - 1) * shards[0].numel()
        self.calls = [*self.calls, "all_gather"]
        return [torch.cat(shards) for _ in range(self.world)]


def buggy_gradient_shards(grads: list[torch.Tensor], ranks: SimulatedRanks) -> list[torch.Tensor]:
    """ZeRO-2's gradient reduction for one unit: each rank's (Ψ,) gradient -> its (S,) shard of the average."""
    shard = len(grads[0]) // ranks.world  # S
    flats = [g[: ranks.world * shard] for g in grads]  # (N·S,) each rank's gradient, cut into N equal shards
    return ranks.reduce_scatter(flats)  # rank r: its shard


_GRAD_CASES = [(12, 4), (13, 4), (5, 4), (7, 3), (1, 2)]


def check_gradient_shards(fn) -> CheckResult:
    """Grade ``fn(grads, ranks)``: the averaged, zero-padded shards, with one reduce-scatter and nothing else."""
    g = Grader("check_gradient_shards")
    gen = torch.Generator().manual_seed(0)
    for numel, world in _GRAD_CASES:
        grads = [torch.randn(numel, generator=gen, dtype=torch.float64) for _ in range(world)]
        size = -(-numel // world)
        mean = torch.nn.functional.pad(torch.stack(grads).mean(0), (0, size * world - numel))
        want = [mean[r * size : (r + 1) * size] for r in range(world)]
        ranks = SimulatedRanks(world)
        got = g.call(fn, [t.clone() for t in grads], ranks)
        where = f"Ψ={numel} on N={world}"
        g.compare(where, None if got is FAILED else [t.tolist() for t in got], [t.tolist() for t in want], rtol=1e-12)
        g.expect(
            where,
            ranks.calls == ["reduce_scatter"] and ranks.sent == (world - 1) * size,
            f"collectives {ranks.calls}, {ranks.sent} elements sent per rank: ZeRO-2 sends each rank's gradient "
            f"once, through one reduce-scatter ({(world - 1) * size} elements), and no rank ever holds the full sum",
        )
    return g.result()


# -- exercise 3: choose a stage for a cluster -----------------------------------------------------------


def _stage_choice(n: float, unit: float, gpus: int, card: float, activations: float) -> int | None:
    """The stage with the least bytes sent that fits: 0, 1 and 2 send 2Ψ (the lowest wins), 3 sends 3Ψ."""
    transient = {0: 0.0, 1: 0.0, 2: 2 * unit, 3: 4 * unit}  # a unit's 16-bit gradient; stage 3 its weights too
    for stage in range(4):
        if _model_states(n, gpus, stage) + activations + transient[stage] <= card:
            return stage
    return None


# (Ψ, largest unit, GPUs, card, activations): each wrong reasoning fails at least one of these
_CHOICE_CASES = [
    (1e9, 5e7, 8, 80e9, 10e9),
    (7e9, 2e8, 8, 80e9, 20e9),
    (7e9, 2e8, 8, 80e9, 45e9),  # activations decide: stage 1's states fit, the step does not
    (13e9, 5e8, 8, 80e9, 30.9e9),  # stage 2's states and activations fit, its gradient bucket does not
    (70e9, 9e8, 16, 80e9, 8e9),  # stage 3's states fit, the gathered layer does not
]


def check_stage_choice(fn) -> CheckResult:
    """Grade ``fn(n_params, largest_unit, gpus, card_bytes, activation_bytes)`` on fixed and random clusters."""
    g = Grader("check_stage_choice")
    rng = random.Random()  # unseeded: new clusters on each call
    drawn = []
    for _ in range(40):
        n = rng.choice([1, 3, 7, 13, 34, 70, 175]) * 1e9
        drawn.append(
            (
                n,
                n / rng.choice([24, 32, 48, 80]),
                rng.choice([4, 8, 16, 64]),
                rng.choice([40e9, 80e9]),
                rng.uniform(2e9, 40e9),
            )
        )
    for n, unit, gpus, card, act in _CHOICE_CASES + drawn:
        where = f"Ψ={n / 1e9:g}B (largest unit {unit / 1e9:.3g}B) on {gpus} GPUs of {card / 1e9:g} GB, "
        where += f"activations {act / 1e9:.3g} GB"
        g.compare(where, g.call(fn, n, unit, gpus, card, act), _stage_choice(n, unit, gpus, card, act))
    return g.result()
