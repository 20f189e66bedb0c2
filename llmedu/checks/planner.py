"""Graders for lesson 13's second half: the cost model and the planner.

check_ring_all_reduce_time(fn)
    fn(nbytes, ranks, bandwidth, latency) -> seconds of a ring all-reduce in the alpha-beta model:
    2 (p - 1) steps, each a latency and a 1/p chunk over the link (Thakur et al. 2005)
check_micro_batches_for_bubble(fn)
    fn(stages, virtual, target) -> the fewest micro-batches m with an (interleaved) 1F1B bubble
    (p - 1) / (v m) of at most ``target`` (relative to the ideal time, Narayanan et al. 2021)
check_pick(fn)
    fn(scenario) -> a ``Layout`` for each of three stated clusters; it passes when the layout fits and
    its predicted step time is within 10% of the planner's best layout without context parallelism
    (whose cost the model underestimates at these sequence lengths: lesson 13 says why), by the model
"""

from __future__ import annotations

from ..planner.clusters import Link, cluster, collective_time
from ..planner.memory import Batch, Layout, uneven_splits
from ..planner.search import MODELS, evaluate, plan
from .core import CheckResult, Grader

__all__ = ["check_ring_all_reduce_time", "check_micro_batches_for_bubble", "check_pick", "SCENARIOS"]

_RING_CASES = [(1e9, 8, 300e9, 5e-6), (2.5e7, 64, 25e9, 1e-5), (4, 2, 1e9, 1e-6), (1e6, 1, 1e9, 1e-6)]
_BUBBLE_CASES = [(4, 1, 0.10), (8, 1, 0.05), (8, 2, 0.05), (16, 4, 0.02), (2, 1, 1.0), (12, 3, 0.2)]

# The three clusters of the exercise: (model preset, cluster preset, nodes, batch sequences, sequence length)
SCENARIOS = {
    "8B on one DGX A100": ("llama3-8b", "dgx-a100", 1, 256, 2048),
    "70B on 8 DGX A100": ("llama3-70b", "dgx-a100", 8, 512, 2048),
    "GPT-3 175B on 48 DGX A100": ("gpt3-175b", "dgx-a100", 48, 1536, 2048),
}


def check_ring_all_reduce_time(fn) -> CheckResult:
    """Grade ``fn(nbytes, ranks, bandwidth, latency)`` against 2 (p - 1) (alpha + n / (p beta)); 0 for one rank."""
    g = Grader("check_ring_all_reduce_time")
    for n, p, beta, alpha in _RING_CASES:
        expected = collective_time("all_reduce", n, p, Link("exercise", beta, alpha, "the exercise"))
        g.compare(
            f"{n:g} bytes on {p} ranks at {beta:g} B/s, {alpha:g} s", g.call(fn, n, p, beta, alpha), expected, rtol=1e-9
        )
    return g.result()


def check_micro_batches_for_bubble(fn) -> CheckResult:
    """Grade ``fn(stages, virtual, target)``: the smallest m with (p - 1) / (v m) <= target."""
    g = Grader("check_micro_batches_for_bubble")
    for p, v, target in _BUBBLE_CASES:
        m = 1
        while (p - 1) / (v * m) > target + 1e-12:
            m += 1
        g.compare(f"p={p}, v={v}, bubble <= {target:g}", g.call(fn, p, v, target), m)
    return g.result()


def check_pick(fn) -> CheckResult:
    """Grade ``fn(scenario) -> Layout``: it must fit and be within 10% of the planner's best predicted step time."""
    g = Grader("check_pick")
    for name, (model, preset, nodes, sequences, seq_len) in SCENARIOS.items():
        c, batch, cfg = cluster(preset, nodes=nodes), Batch(sequences, seq_len), MODELS[model]
        layout = g.call(fn, name)
        if not g.expect(f"{name}: a Layout", isinstance(layout, Layout), f"got {type(layout).__name__}"):
            continue
        if not g.expect(
            f"{name}: uses the cluster's {c.world_size} GPUs",
            layout.world == c.world_size,
            f"{layout} uses {layout.world}",
        ):
            continue
        wrong = uneven_splits(cfg, layout, batch)
        if not g.expect(f"{name}: each degree divides what it splits", not wrong, f"{layout}: {'; '.join(wrong)}"):
            continue
        mine = evaluate(cfg, layout, c, batch)
        best = plan(cfg, c, batch, top=1, where=lambda lay: lay.cp == 1)[0]
        g.expect(f"{name}: fits", mine.fits, f"{layout} needs {mine.memory_total / 2**30:.1f} GiB per GPU")
        g.expect(
            f"{name}: within 10% of the best predicted step",
            mine.time["total"] <= 1.1 * best.time["total"],
            f"{layout}: {mine.time['total']:.2f} s; the planner's best without CP, {best.layout}: "
            f"{best.time['total']:.2f} s",
        )
    return g.result()
