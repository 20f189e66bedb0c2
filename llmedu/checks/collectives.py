"""Graders for lessons 10 (collectives) and 10 (data parallelism).

``check_tree_schedule``, ``check_ring_all_reduce_bytes``, ``check_assign_buckets`` and
``check_hidden_communication`` run in this process; ``check_ring_all_reduce`` starts three real processes (a few seconds) and compares
your all-reduce with ``torch.distributed.all_reduce`` on sizes that do not divide by three. It grades the method too: while
your function runs, every torch.distributed collective it calls is recorded (a ring uses none) and the bytes each rank
sends point to point are counted (``ProcessGroup.send``, which ``dist.send``, ``dist.isend`` and ``batch_isend_irecv`` all
reach); each rank must send about ``2 (N - 1) / N`` of the tensor, as a ring does.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..parallel.collectives import ring_all_reduce_bytes
from ..parallel.data_parallel import assign_buckets, hidden_communication
from ..parallel.launch import WorkerError, launch
from .core import CheckResult, Grader

__all__ = [
    "check_tree_schedule",
    "check_ring_all_reduce_bytes",
    "check_ring_all_reduce",
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
    for numel, n, size in [(12, 4, 4), (1000, 2, 4), (1001, 4, 4), (7, 3, 8), (3, 4, 2), (100, 1, 4)]:
        g.compare(
            f"numel={numel}, world_size={n}, element_size={size}",
            g.call(fn, numel, n, size),
            ring_all_reduce_bytes(numel, n, size),
        )
    return g.result()


# The ProcessGroup methods behind torch.distributed's collectives (send, recv and barrier are left alone).
_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "_allgather_base", "all_gather_single", "all_gather_single_coalesced", "broadcast", "reduce", "gather", "scatter",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "all_to_all_single",
)  # fmt: skip
_TRAFFIC_NUMEL = 1001  # the case whose bytes are checked: large enough that a few bytes of metadata do not matter
_TRAFFIC_TOLERANCE = 0.1  # relative, either way: room for another way of cutting the chunks


@contextmanager
def _point_to_point_only() -> Iterator[dict]:
    """Inside the block, record the collectives this rank calls and count the bytes it sends point to point."""
    group_class = dist.ProcessGroup
    seen = {"bytes_sent": 0, "collectives": []}
    originals = {name: getattr(group_class, name) for name in ("send", *_COLLECTIVES) if hasattr(group_class, name)}

    def counting_send(self, tensors, *args, **kwargs):
        seen["bytes_sent"] += sum(t.numel() * t.element_size() for t in tensors)
        return originals["send"](self, tensors, *args, **kwargs)

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


def _run_learner(fn: Callable) -> list:
    """In each process: the learner's all-reduce (with what it sent) and torch's on a few sizes (or the error)."""
    rank = dist.get_rank()
    answers = []
    for shape in [(1,), (5,), (_TRAFFIC_NUMEL,), (4, 3)]:
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


def check_ring_all_reduce(ring_all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> CheckResult:
    """Your all-reduce (sum) on 3 processes against ``torch.distributed.all_reduce``, and how it got there.

    Float sums in another order differ by a few ulps: atol=1e-5 on values of size ~1. The method: no
    torch.distributed collective may be called, and on the tensor of 1001 elements each rank must send
    ``2 (N - 1) / N`` of the tensor's bytes point to point, within 10% (a gather-and-sum sends ``N - 1`` times it).
    """
    g = Grader("check_ring_all_reduce")
    n = 3
    try:
        results = launch(_run_learner, n, ring_all_reduce, timeout=10, echo=False)
    except WorkerError as err:
        hint = " (a hang: did every rank post its receive before waiting on its send?)" if "timeout" in str(err) else ""
        g.expect("running on 3 processes", False, f"rank {err.rank} failed{hint}: {str(err).strip().splitlines()[-1]}")
        return g.result()
    ring_share = 2 * (n - 1) / n
    for rank, answers in enumerate(results):
        if answers and isinstance(answers[0], str):
            g.expect("running on 3 processes", False, answers[0])
            break
        for shape, got, expected, nbytes, seen in answers:
            g.compare(f"rank {rank}, tensor of shape {shape}", got, expected, atol=1e-5)
            called = sorted(set(seen["collectives"]))
            g.expect(
                f"rank {rank}, tensor of shape {shape}: isend/irecv only",
                not called,
                f"it called torch.distributed's {', '.join(called)} (ProcessGroup method): a ring passes chunks to its"
                " neighbour with dist.isend and dist.irecv",
            )
            if shape == (_TRAFFIC_NUMEL,):
                share = seen["bytes_sent"] / nbytes
                g.expect(
                    f"rank {rank}, tensor of shape {shape}: sends 2(N-1)/N = {ring_share:.3f} of the tensor",
                    abs(share - ring_share) <= _TRAFFIC_TOLERANCE * ring_share,
                    f"it sent {seen['bytes_sent']} bytes point to point, {share:.3f} times the tensor's {nbytes}",
                )
    return g.result()


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
