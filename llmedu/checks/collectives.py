"""Graders for lessons 10 (collectives) and 11 (data parallelism).

``check_tree_schedule``, ``check_ring_all_reduce_bytes``, ``check_assign_buckets`` and
``check_hidden_communication`` run in this process. ``check_ring_all_reduce`` (3 processes) and
``check_halving_doubling_all_reduce`` (4 processes) start real processes (a few seconds) and compare your
all-reduce with ``torch.distributed.all_reduce``. They grade the method too: while your function runs, every
torch.distributed collective it calls is recorded (a hand-made all-reduce uses none), and every message each
rank sends point to point is counted with its bytes and its destination (``ProcessGroup.send``, which
``dist.send``, ``dist.isend`` and ``batch_isend_irecv`` all reach). Each rank must send about
``2 (N - 1) / N`` of the tensor, as a bandwidth-optimal all-reduce does (a gather-and-sum sends the whole
tensor, its root ``N - 1`` times it); a ring sends only to one neighbour, and recursive halving-doubling in
``2 log2 N`` messages.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ..parallel.collectives import ring_all_reduce_bytes
from ..parallel.data_parallel import assign_buckets, hidden_communication
from ..parallel.launch import WorkerError, launch
from .core import CheckResult, Grader, call_watching

__all__ = [
    "check_tree_schedule",
    "check_ring_all_reduce_bytes",
    "check_ring_all_reduce",
    "check_halving_doubling_all_reduce",
    "check_assign_buckets",
    "check_hidden_communication",
]


def check_tree_schedule(tree_schedule: Callable[[int, int], list]) -> CheckResult:
    """``tree_schedule(world_size, root)``: rounds of (sender, receiver) pairs of a broadcast.

    Any schedule passes if, in every round, each sender already has the data, each receiver does
    not, nobody sends or receives twice, and everyone has it after ``ceil(log2 N)`` rounds.
    """
    g = Grader("check_tree_schedule")
    for n in range(1, 10):
        for root in (0, n // 2, n - 1):
            rounds = g.call(tree_schedule, n, root)
            case = f"world_size={n}, root={root}"
            if not g.expect(f"{case}: a list of rounds", isinstance(rounds, (list, tuple)), f"got {rounds!r}"):
                break
            have = {root}
            for i, pairs in enumerate(rounds):
                pairs = [tuple(p) for p in pairs]
                senders, receivers = [s for s, _ in pairs], [r for _, r in pairs]
                g.expect(
                    f"{case}, round {i}: senders have the data",
                    all(s in have for s in senders),
                    f"{pairs}, holders {sorted(have)}",
                )
                g.expect(
                    f"{case}, round {i}: receivers do not have it yet",
                    not any(r in have for r in receivers),
                    f"{pairs}",
                )
                g.expect(
                    f"{case}, round {i}: one message per rank",
                    len(set(senders)) == len(senders) and len(set(receivers)) == len(receivers),
                    f"{pairs}",
                )
                have |= set(receivers)
            g.expect(f"{case}: everyone reached", have == set(range(n)), f"only {sorted(have)}")
            g.expect(f"{case}: in ceil(log2 N) rounds", len(rounds) == (n - 1).bit_length(), f"{len(rounds)} rounds")
    return g.result()


def check_ring_all_reduce_bytes(fn: Callable[[int, int, int], list]) -> CheckResult:
    """``fn(numel, world_size, element_size)``: bytes each rank sends in our ring all-reduce."""
    g = Grader("check_ring_all_reduce_bytes")
    cases = [(12, 4, 4), (1000, 2, 4), (1001, 4, 4), (7, 3, 8), (3, 4, 2), (100, 1, 4), (10, 6, 4), (1002, 5, 2)]
    for numel, n, size in cases:
        got, called = call_watching(g, fn, (numel, n, size), _PARALLEL)
        g.expect(
            "your function counts the bytes itself",
            called is None,
            f"it called llmedu.parallel's {called}: work out which chunks each rank sends",
        )
        g.compare(f"numel={numel}, world_size={n}, element_size={size}", got, ring_all_reduce_bytes(numel, n, size))
    return g.result()


# The ProcessGroup methods behind torch.distributed's collectives (send, recv and barrier are left alone).
_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "_allgather_base", "all_gather_single", "all_gather_single_coalesced", "broadcast", "reduce", "gather", "scatter",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "all_to_all_single",
)  # fmt: skip
_PARALLEL = Path(__file__).resolve().parent.parent / "parallel"  # the library's collectives, and what they call
_TRAFFIC_NUMEL = 1001  # the case whose bytes are checked: large enough that a few bytes of metadata do not matter
_TRAFFIC_TOLERANCE = 0.1  # relative, either way: room for another way of cutting the chunks


@contextmanager
def _point_to_point_only() -> Iterator[dict]:
    """Inside the block, record the collectives this rank calls and count the bytes it sends point to point."""
    group_class = dist.ProcessGroup
    seen = {"bytes_sent": 0, "messages": 0, "destinations": set(), "collectives": []}
    originals = {name: getattr(group_class, name) for name in ("send", *_COLLECTIVES) if hasattr(group_class, name)}

    def counting_send(self, tensors, dst, *args, **kwargs):
        seen["bytes_sent"] += sum(t.numel() * t.element_size() for t in tensors)
        seen["messages"] += 1
        seen["destinations"].add(dst)
        return originals["send"](self, tensors, dst, *args, **kwargs)

    def recording(name):
        def call(self, *args, **kwargs):
            seen["collectives"].append(name)
            return originals[name](self, *args, **kwargs)  # run it anyway: raising on some ranks could hang others

        return call

    stored = {name: group_class.__dict__.get(name) for name in originals}  # pybind's wrappers, put back as they were
    for name in originals:
        setattr(group_class, name, counting_send if name == "send" else recording(name))
    try:
        yield seen
    finally:
        for name, entry in stored.items():
            if entry is None:
                delattr(group_class, name)  # it was inherited
            else:
                setattr(group_class, name, entry)


def _run_learner(fn: Callable, shapes: list[tuple]) -> list:
    """In each process: the learner's all-reduce (with what it sent) and torch's on each shape (or the error)."""
    rank = dist.get_rank()
    answers = []
    for shape in shapes:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(rank * 100 + sum(shape)))
        expected = x.clone()
        dist.all_reduce(expected)
        try:
            with _point_to_point_only() as seen:
                got = fn(x.clone())
        except Exception as err:
            where = traceback.extract_tb(err.__traceback__)[-1]
            return [f"rank {rank} raised {type(err).__name__}: {err} (line {where.lineno})"]
        answers.append((tuple(shape), got, expected, x.numel() * x.element_size(), seen))
    return answers


def _grade_all_reduce(g: Grader, fn: Callable, n: int, shapes: list[tuple], method: Callable) -> CheckResult:
    """Run ``fn`` on ``n`` processes; compare each answer, reject collectives, and on the tensor of
    ``_TRAFFIC_NUMEL`` elements check the bytes (within 10%) and ``method(g, case, rank, seen)``."""
    where = f"running on {n} processes"
    try:
        results = launch(_run_learner, n, fn, shapes, timeout=10, echo=False)
    except WorkerError as err:
        hint = " (a hang: did every rank post its receive before waiting on its send?)" if "timeout" in str(err) else ""
        g.expect(where, False, f"rank {err.rank} failed{hint}: {str(err).strip().splitlines()[-1]}")
        return g.result()
    share = 2 * (n - 1) / n
    for rank, answers in enumerate(results):
        if answers and isinstance(answers[0], str):
            g.expect(where, False, answers[0])
            break
        for shape, got, expected, nbytes, seen in answers:
            case = f"rank {rank}, tensor of shape {shape}"
            g.compare(case, got, expected, atol=1e-5)
            called = sorted(set(seen["collectives"]))
            g.expect(
                f"{case}: isend/irecv only",
                not called,
                f"it called torch.distributed's {', '.join(called)} (ProcessGroup method): pass the pieces with"
                " dist.isend and dist.irecv",
            )
            if shape == (_TRAFFIC_NUMEL,):
                sent = seen["bytes_sent"] / nbytes
                g.expect(
                    f"{case}: sends 2(N-1)/N = {share:.3f} of the tensor",
                    abs(sent - share) <= _TRAFFIC_TOLERANCE * share,
                    f"it sent {seen['bytes_sent']} bytes point to point, {sent:.3f} times the tensor's {nbytes}",
                )
                method(g, case, rank, seen)
    return g.result()


def check_ring_all_reduce(ring_all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> CheckResult:
    """Your ring all-reduce (sum) on 3 processes against ``torch.distributed.all_reduce``, and how it got there.

    Float sums in another order differ by a few ulps: atol=1e-5 on values of size ~1. The method: no
    torch.distributed collective; on the tensor of 1001 elements each rank sends ``2 (N - 1) / N`` of the
    tensor's bytes point to point (within 10%), all of it to one neighbour (either way round the ring).
    """

    def one_neighbour(g, case, rank, seen):
        peers = sorted(seen["destinations"])
        g.expect(
            f"{case}: sends to one neighbour only",
            len(peers) == 1,
            f"it sent to ranks {peers}: in a ring each rank passes chunks to one neighbour only (left or right)",
        )

    shapes = [(1,), (5,), (_TRAFFIC_NUMEL,), (4, 3)]
    return _grade_all_reduce(Grader("check_ring_all_reduce"), ring_all_reduce, 3, shapes, one_neighbour)


def check_halving_doubling_all_reduce(all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> CheckResult:
    """Your recursive halving-doubling all-reduce (sum) on 4 processes against ``torch.distributed.all_reduce``.

    The method: no torch.distributed collective; on the tensor of 1001 elements each rank sends
    ``2 (N - 1) / N`` of the tensor's bytes (within 10%) in at most ``2 log2 N`` = 4 messages (a ring needs 6).
    """

    def few_messages(g, case, rank, seen):
        g.expect(
            f"{case}: at most 2 log2 N = 4 messages",
            seen["messages"] <= 4,
            f"it sent {seen['messages']} messages (a ring sends 2(N-1) = 6): halve the exchanged part each step",
        )

    shapes = [(8,), (_TRAFFIC_NUMEL,), (6, 5)]
    return _grade_all_reduce(Grader("check_halving_doubling_all_reduce"), all_reduce, 4, shapes, few_messages)


def check_assign_buckets(fn: Callable[[list, int], list]) -> CheckResult:
    """``fn(sizes, bucket_bytes)``: parameter indices grouped into buckets, last parameter first."""
    g = Grader("check_assign_buckets")
    for sizes, cap in [([4, 4, 4, 4], 8), ([4, 100, 4], 8), ([1, 2, 3], 1000), ([5, 3, 3, 5, 1], 6), ([8], 8)]:
        g.compare(f"sizes={sizes}, bucket_bytes={cap}", g.call(fn, list(sizes), cap), assign_buckets(sizes, cap))
    return g.result()


def check_hidden_communication(fn: Callable[[list], float]) -> CheckResult:
    """``fn(events)``: the fraction of communication time overlapped by compute on the same rank."""
    g = Grader("check_hidden_communication")

    def ev(rank, lane, start, end):
        return dict(rank=rank, lane=lane, label=lane, start=start, end=end)

    cases = {
        "no overlap": [ev(0, "compute", 0, 1), ev(0, "comm", 1, 2)],
        "fully hidden": [ev(0, "compute", 0, 3), ev(0, "comm", 1, 2)],
        "half hidden": [ev(0, "compute", 0, 2), ev(0, "comm", 1, 3)],
        "two compute spans": [ev(0, "compute", 0, 1), ev(0, "compute", 1.5, 2), ev(0, "comm", 0.5, 2.5)],
        "other rank's compute does not count": [ev(1, "compute", 0, 9), ev(0, "comm", 1, 2), ev(0, "compute", 0, 1.5)],
        "two ranks": [ev(0, "comm", 0, 2), ev(0, "compute", 0, 1), ev(1, "comm", 0, 2), ev(1, "compute", 0, 2)],
    }
    for name, events in cases.items():
        g.compare(name, g.call(fn, [dict(e) for e in events]), hidden_communication(events), atol=1e-9)
    return g.result()
