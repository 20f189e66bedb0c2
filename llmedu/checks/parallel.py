"""Graders for lessons 12 (tensor parallel), 13 (pipeline parallel) and 14 (3D parallelism).

All run in this process, in a fraction of a second: the "ranks" of the tensor-parallel exercises are
the pieces of a split matrix, multiplied one after the other. Lesson 14's graders fail a function that asks
``llmedu.checks`` for the answer (its reference functions, such as ``nodes_spanned`` or ``cross_node_traffic``):
they record every call into the graders' files while the learner's function runs.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import torch

from ..parallel.mesh import rank_of
from ..parallel.pipeline_parallel import partition
from ..parallel.pipeline_schedules import Action, bubble_fraction, schedule, simulate, theoretical_bubble
from .core import CheckResult, Grader, call_watching

__all__ = [
    "check_row_parallel_matmul",
    "check_tp_all_reduce_bytes",
    "check_bubble",
    "check_interleaved_bubble",
    "check_fixed_schedule",
    "check_peak_in_flight",
    "check_partition",
    "check_rank_of",
    "check_nodes_spanned",
    "check_equivalent_lr",
    "check_rank_order",
    "order_cases",
]


def check_row_parallel_matmul(fn: Callable[[torch.Tensor, torch.Tensor, int], list]) -> CheckResult:
    """``fn(x, w, n)`` -> the n partial products of X W with X split by columns and W by rows.

    Their sum must equal ``x @ w``, and each one must use only its own slices (rank i's piece is
    ``x_i @ w_i``, with the slices of ``torch.chunk``).
    """
    g = Grader("check_row_parallel_matmul")
    gen = torch.Generator().manual_seed(0)
    for shape_x, cols, n in [((4, 8), 6, 2), ((2, 3, 12), 5, 4), ((1, 16), 16, 8), ((5, 6), 3, 1)]:
        x, w = torch.randn(shape_x, generator=gen), torch.randn(shape_x[-1], cols, generator=gen)
        pieces = g.call(fn, x, w, n)
        case = f"x {tuple(x.shape)}, w {tuple(w.shape)}, n={n}"
        if not g.expect(
            f"{case}: a list of {n} pieces",
            isinstance(pieces, (list, tuple)) and len(pieces) == n,
            f"got {type(pieces).__name__} of length {len(pieces) if hasattr(pieces, '__len__') else '?'}",
        ):
            continue
        for i, (xi, wi) in enumerate(zip(x.chunk(n, -1), w.chunk(n, 0))):
            g.compare(f"{case}: rank {i}'s partial product", pieces[i], xi @ wi, atol=1e-5)
        g.compare(f"{case}: the all-reduce (sum) of the pieces", sum(pieces), x @ w, atol=1e-4)
    return g.result()


def check_tp_all_reduce_bytes(fn: Callable[[int, int, int, int, int], int]) -> CheckResult:
    """``fn(batch, seq, d_model, n_layers, bytes_per_value)``: bytes all-reduced per training step by
    the tensor-parallel transformer blocks (attention and MLP), forward and backward together.

    Each block all-reduces its (batch, seq, d_model) output twice in forward (g after attention and
    after the MLP) and its input gradient twice in backward (f before each): 4 per block.
    """
    g = Grader("check_tp_all_reduce_bytes")
    for args in [(1, 1, 1, 1, 4), (8, 128, 768, 12, 2), (4, 1024, 4096, 32, 2), (2, 16, 64, 3, 4)]:
        b, t, d, n_layers, size = args
        g.compare(
            f"batch={b}, seq={t}, d_model={d}, n_layers={n_layers}, bytes={size}",
            g.call(fn, *args),
            4 * n_layers * b * t * d * size,
        )
    return g.result()


def check_bubble(fn: Callable[[int, int], float]) -> CheckResult:
    """``fn(n_stages, n_micro)`` -> the idle fraction of a GPipe / 1F1B step with equal stages."""
    g = Grader("check_bubble")
    for p, m in [(1, 1), (2, 1), (4, 4), (4, 8), (8, 32), (16, 3)]:
        g.compare(f"p={p}, m={m}", g.call(fn, p, m), theoretical_bubble(p, m), atol=1e-9)
    return g.result()


def check_interleaved_bubble(fn: Callable[[int, int, int], float]) -> CheckResult:
    """``fn(n_stages, n_micro, n_chunks)`` -> the idle share of an interleaved 1F1B step (idle time over
    p x step time, as ``bubble_fraction`` measures it), equal chunks, free communication."""
    g = Grader("check_interleaved_bubble")
    for p, m, v in [(2, 2, 1), (4, 8, 2), (4, 4, 4), (8, 16, 2), (2, 8, 3), (8, 64, 4)]:
        g.compare(f"p={p}, m={m}, v={v}", g.call(fn, p, m, v), theoretical_bubble(p, m, "interleaved", v), atol=1e-9)
    return g.result()


def _in_flight(actions: list) -> int:
    """The most micro-batches whose activations a stage holds at once (from F until their last backward)."""
    held, peak = set(), 0
    for a in actions:
        a = Action(*a)
        if a.kind == "F":
            held.add(a.micro)
        elif a.kind in ("B", "W"):
            held.discard(a.micro)
        peak = max(peak, len(held))
    return peak


def check_fixed_schedule(fn: Callable[[int, int, int], list]) -> CheckResult:
    """``fn(n_micro, n_stages, stage)`` -> a repaired 1F1B: lists of ("F", i) / ("B", i) that every rank
    can run (no rank waits for work that comes after it), with 1F1B's bubble (p-1)/(m+p-1) and at most
    min(m, p - stage) micro-batches held by a stage."""
    g = Grader("check_fixed_schedule")
    for p in (1, 2, 3, 4):
        for m in (1, 3, 4, 8):
            lists = [g.call(fn, m, p, s) for s in range(p)]
            case = f"m={m}, p={p}"
            try:
                lists = [[Action(*a) for a in actions] for actions in lists]
                bubble = bubble_fraction(simulate(lists))
            except Exception as err:  # a wrong answer, said as a failed case
                g.expect(f"{case}: a schedule the ranks can run", False, str(err))
                break
            g.compare(f"{case}: the bubble", bubble, theoretical_bubble(p, m), atol=1e-9)
            for s, actions in enumerate(lists):
                peak = _in_flight(actions)
                g.expect(f"{case}, stage {s}: at most {min(m, p - s)} held", peak <= min(m, p - s), f"holds {peak}")
    return g.result()


def check_peak_in_flight(fn: Callable[[str, int, int, int], int]) -> CheckResult:
    """``fn(schedule_name, n_micro, n_stages, stage)`` -> the most micro-batches whose activations the
    stage holds at once, from their F until their backward is done (for zb-h1: until their W)."""
    g = Grader("check_peak_in_flight")
    for name in ("gpipe", "1f1b", "zb-h1"):
        for p, m in [(4, 8), (4, 2), (8, 16), (2, 5)]:
            for s in range(p):
                expected = _in_flight(schedule(name, m, p, s))
                g.compare(f"{name}, m={m}, p={p}, stage {s}", g.call(fn, name, m, p, s), expected)
    return g.result()


def check_partition(fn: Callable[[list, int], list]) -> CheckResult:
    """``fn(costs, n_stages)`` -> contiguous ranges of layer indices whose largest total cost is minimal."""
    g = Grader("check_partition")
    for costs, n in [
        ([1, 1, 1, 1], 2),
        ([5, 1, 1, 1, 1, 1], 2),
        ([3, 1, 4, 1, 5, 9, 2, 6], 3),
        ([2, 2, 2], 3),
        ([1, 7, 1, 1, 1, 1, 7, 1], 4),
    ]:
        got = g.call(fn, costs, n)
        case = f"costs={costs}, n_stages={n}"
        flat = [i for r in got for i in r] if isinstance(got, (list, tuple)) else None
        if not g.expect(
            f"{case}: {n} contiguous stages covering every layer once",
            flat == list(range(len(costs))) and len(got) == n and all(len(r) for r in got),
            f"got {got}",
        ):
            continue
        best = max(sum(costs[i] for i in r) for r in partition(costs, n))
        g.compare(f"{case}: the most expensive stage", max(sum(costs[i] for i in r) for r in got), best)
    return g.result()


def check_rank_of(fn: Callable[[int, int, int, tuple], int]) -> CheckResult:
    """``fn(dp, tp, pp, (DP, TP, PP))`` -> the global rank, tensor parallel fastest, pipeline slowest."""
    g = Grader("check_rank_of")
    for sizes in [(1, 1, 1), (2, 2, 2), (4, 2, 1), (2, 8, 4), (3, 1, 2)]:
        for d in range(sizes[0]):
            for t in range(sizes[1]):
                for p in range(sizes[2]):
                    g.compare(
                        f"(dp, tp, pp)=({d}, {t}, {p}) of sizes {sizes}",
                        g.call(fn, d, t, p, sizes),
                        rank_of(d, t, p, sizes),
                    )
    return g.result()


# -- lesson 14: where a mesh's groups sit on nodes, and what a missing mean does --------------------------------
KINDS = ("dp", "tp", "pp")
CHECKS = Path(__file__).resolve().parent
GRADING = CHECKS / "core.py"  # the Grader itself, which runs the learner's function


def _without_reference(g: Grader, fn, *args):
    """``fn(*args)`` through ``g.call``, failing the case if it called a function of ``llmedu.checks``."""
    got, called = call_watching(g, fn, args, CHECKS, exempt=lambda code: code.co_filename == str(GRADING))
    g.expect(
        "your function works it out without the graders' reference",
        called is None,
        f"it called llmedu.checks' {called}: write the rule yourself",
    )
    return got


def _rank(coords: dict, sizes: dict, order: tuple) -> int:
    """The global rank of ``coords`` when ``order`` lists the dimensions fastest first (mixed radix)."""
    rank, stride = 0, 1
    for kind in order:
        rank, stride = rank + coords[kind] * stride, stride * sizes[kind]
    return rank


def groups(kind: str, sizes: dict, order: tuple) -> list[list[int]]:
    """Every group of ``kind``: the ranks that differ only in that coordinate."""
    others = [k for k in KINDS if k != kind]
    found = []
    for fixed in itertools.product(*(range(sizes[k]) for k in others)):
        coords = dict(zip(others, fixed))
        found.append([_rank({**coords, kind: i}, sizes, order) for i in range(sizes[kind])])
    return found


def nodes_spanned(kind: str, sizes: dict, order: tuple, gpus_per_node: int) -> int:
    """The most nodes any one group of ``kind`` touches, rank r sitting on node r // gpus_per_node."""
    return max(len({r // gpus_per_node for r in group}) for group in groups(kind, sizes, order))


def cross_node_traffic(traffic: dict, sizes: dict, order: tuple, gpus_per_node: int) -> float:
    """Bytes per step that leave a node, in the exercise's model: a group spanning two or more nodes sends all
    of its ``traffic[kind]`` bytes between nodes, a group inside one node none."""
    return sum(
        traffic[kind] * sum(len({r // gpus_per_node for r in g}) > 1 for g in groups(kind, sizes, order))
        for kind in KINDS
    )


_SPAN_CASES = [  # (sizes, order fastest first, GPUs per node)
    ({"dp": 2, "tp": 8, "pp": 4}, ("tp", "dp", "pp"), 8),
    ({"dp": 2, "tp": 8, "pp": 4}, ("pp", "dp", "tp"), 8),
    ({"dp": 4, "tp": 2, "pp": 2}, ("tp", "dp", "pp"), 8),
    ({"dp": 4, "tp": 4, "pp": 2}, ("dp", "pp", "tp"), 4),
    ({"dp": 2, "tp": 16, "pp": 2}, ("tp", "dp", "pp"), 8),
    ({"dp": 8, "tp": 2, "pp": 3}, ("pp", "tp", "dp"), 8),
    ({"dp": 3, "tp": 4, "pp": 2}, ("dp", "tp", "pp"), 4),
]


def check_nodes_spanned(fn: Callable[[str, dict, tuple, int], int]) -> CheckResult:
    """``fn(kind, sizes, order, gpus_per_node)`` -> the most nodes one group of ``kind`` spans."""
    g = Grader("check_nodes_spanned")
    for sizes, order, gpn in _SPAN_CASES:
        for kind in KINDS:
            g.compare(
                f"{kind} groups of {sizes}, order {order} (fastest first), {gpn} GPUs a node",
                _without_reference(g, fn, kind, dict(sizes), order, gpn),
                nodes_spanned(kind, sizes, order, gpn),
            )
    return g.result()


BUGS = {
    "none": "the code as train_3d has it",
    "sum": "the DP all-reduce sums the replicas' gradients and never divides by dp",
    "twice": "the gradients are divided by dp twice",
    "micro-sum": "the pipeline adds up its micro-batch losses instead of averaging them (no / n_micro)",
}


def equivalent_lr(bug: str, optimizer: str, lr: float, dp: int, n_micro: int) -> float:
    """The learning rate at which the correct code takes the buggy code's steps (plain SGD, or AdamW, whose
    update m / sqrt(v) does not change when every gradient is scaled by one constant, up to its eps)."""
    if optimizer == "adamw":
        return lr
    return lr * {"none": 1, "sum": dp, "twice": 1 / dp, "micro-sum": n_micro}[bug]


def check_equivalent_lr(fn: Callable[[str, str, float, int, int], float]) -> CheckResult:
    """``fn(bug, optimizer, lr, dp, n_micro)`` -> the learning rate of the correct code that repeats the bug."""
    g = Grader("check_equivalent_lr")
    for bug, optimizer, (dp, n_micro) in itertools.product(BUGS, ("sgd", "adamw"), [(2, 2), (4, 2), (2, 8), (8, 1)]):
        g.compare(
            f"bug {bug!r} ({BUGS[bug]}), {optimizer}, lr 0.1, dp={dp}, n_micro={n_micro}",
            _without_reference(g, fn, bug, optimizer, 0.1, dp, n_micro),
            equivalent_lr(bug, optimizer, 0.1, dp, n_micro),
            rtol=1e-9,
        )
    return g.result()


_ORDER_CASES = [  # (bytes per group per step by kind, sizes, GPUs per node)
    ({"tp": 40e9, "dp": 3e9, "pp": 0.5e9}, {"dp": 4, "tp": 8, "pp": 2}, 8),
    ({"tp": 40e9, "dp": 3e9, "pp": 0.5e9}, {"dp": 2, "tp": 16, "pp": 2}, 8),  # TP too large for a node
    ({"tp": 1e9, "dp": 6e9, "pp": 0.2e9}, {"dp": 2, "tp": 4, "pp": 4}, 8),
    ({"tp": 8e9, "dp": 2e9, "pp": 9e9}, {"dp": 2, "tp": 2, "pp": 2}, 4),
    # PP's groups are the heaviest and fit in a node, but PP with DP does not fit while PP with TP does
    ({"tp": 6e9, "dp": 9e9, "pp": 40e9}, {"dp": 8, "tp": 4, "pp": 2}, 8),
    # TP's 8 groups send the most of any one kind, DP's 16 and PP's 32 together more, and those two fit together
    ({"tp": 12.5e9, "dp": 4e9, "pp": 1.5e9}, {"dp": 4, "tp": 8, "pp": 2}, 8),
]


def order_cases(n_drawn: int = 100, seed: int = 0) -> list[tuple[dict, dict, int]]:
    """``check_rank_order``'s cases: the ones above, then ``n_drawn`` clusters drawn at random (degrees and GPUs
    per node powers of two, as on real clusters; 1 to 60 GB per group of each kind)."""
    rng = random.Random(seed)
    drawn = [
        (
            {k: rng.randint(1, 60) * 1e9 for k in KINDS},
            {k: 2 ** rng.randint(0, 3) for k in KINDS},
            rng.choice((2, 4, 8, 16)),
        )
        for _ in range(n_drawn)
    ]
    return _ORDER_CASES + drawn


def check_rank_order(fn: Callable[[dict, dict, int], tuple]) -> CheckResult:
    """``fn(traffic, sizes, gpus_per_node)`` -> an order (fastest first) that sends the fewest bytes between
    nodes (``cross_node_traffic``), on the cases of ``order_cases``, each held to the best of the six orders; any
    order that ties with the best passes."""
    g = Grader("check_rank_order")
    for traffic, sizes, gpn in order_cases():
        order = _without_reference(g, fn, dict(traffic), dict(sizes), gpn)
        what = f"traffic {traffic}, sizes {sizes}, {gpn} GPUs a node"
        if not g.expect(
            f"{what}: an order of 'tp', 'dp', 'pp'",
            isinstance(order, (tuple, list)) and sorted(order) == sorted(KINDS),
            f"got {order!r}",
        ):
            continue
        best = min(itertools.permutations(KINDS), key=lambda o: cross_node_traffic(traffic, sizes, o, gpn))
        mine, least = (
            cross_node_traffic(traffic, sizes, tuple(order), gpn),
            cross_node_traffic(traffic, sizes, best, gpn),
        )
        g.expect(
            f"{what}: the fewest bytes between nodes",
            mine <= least * (1 + 1e-9),
            f"{tuple(order)} sends {mine / 1e9:.1f} GB between nodes a step; {best} sends {least / 1e9:.1f} GB",
        )
    return g.result()
