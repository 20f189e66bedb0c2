"""Graders for the data-parallel lesson (10): what buckets cost, when they launch, what stays exposed.

check_bucket_comm_time(fn)      fn(sizes, bucket_bytes, world_size, alpha, bandwidth) -> seconds of
                                all-reduce per step: one ring all-reduce per bucket (``assign_buckets``),
                                each 2(N-1) alpha + 2(N-1)/N bytes / bandwidth (lesson 09's alpha-beta model)
check_launch_order(fn)          fn(ready, buckets) -> for each bucket, how many gradients were ready when
                                DDP launched it: a bucket goes when it is full AND every earlier bucket
                                has gone (the rule that keeps the ranks' all-reduces paired)
check_exposed_communication(fn) fn(compute, comm) -> seconds the step waits after backward: bucket i's
                                all-reduce can start once its gradients are computed (compute[0..i]) and
                                the link is free (one all-reduce at a time)
"""

from __future__ import annotations

from collections.abc import Callable

from ..parallel.data_parallel import assign_buckets
from .core import CheckResult, Grader

__all__ = ["check_bucket_comm_time", "check_launch_order", "check_exposed_communication"]


def bucket_comm_time(sizes: list[int], bucket_bytes: int, world_size: int, alpha: float, bandwidth: float) -> float:
    """The reference: sum over buckets of a ring all-reduce's alpha-beta time."""
    n = world_size
    total = 0.0
    for bucket in assign_buckets(sizes, bucket_bytes):
        nbytes = sum(sizes[i] for i in bucket)
        total += 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bandwidth
    return total


def launch_order(ready: list[int], buckets: list[list[int]]) -> list[int]:
    """The reference: DDP's in-order rule, replayed on one rank's order of ready gradients."""
    bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket}
    filled, launched = [0] * len(buckets), []
    for count, index in enumerate(ready, start=1):
        filled[bucket_of[index]] += 1
        while len(launched) < len(buckets) and filled[len(launched)] == len(buckets[len(launched)]):
            launched.append(count)
    return launched


def exposed_communication(compute: list[float], comm: list[float]) -> float:
    """The reference: one link, all-reduces in bucket order, each after its bucket's backward."""
    t = link_free = 0.0
    for work, send in zip(compute, comm):
        t += work  # bucket i's gradients are ready
        link_free = max(t, link_free) + send
    return max(0.0, link_free - t)


def check_bucket_comm_time(fn: Callable) -> CheckResult:
    g = Grader("check_bucket_comm_time")
    mb = 2**20
    cases = [
        ([4 * mb] * 4, 25 * mb, 2, 1e-5, 10e9),  # one bucket
        ([4 * mb] * 4, 8 * mb, 2, 1e-5, 10e9),  # two buckets
        ([4 * mb] * 4, 1 * mb, 8, 1e-5, 10e9),  # a parameter larger than a bucket: one bucket each
        ([1000] * 300, 25 * mb, 4, 5e-6, 25e9),
        ([1000] * 300, 10_000, 4, 5e-6, 25e9),  # many tiny buckets: the latencies add up
        ([mb, 3 * mb], 2 * mb, 1, 1e-5, 10e9),  # one rank: nothing to send
    ]
    for sizes, cap, n, alpha, bw in cases:
        case = f"{len(sizes)} parameters, bucket {cap:,} bytes, N={n}, alpha={alpha:g} s, {bw / 1e9:g} GB/s"
        g.compare(
            case, g.call(fn, list(sizes), cap, n, alpha, bw), bucket_comm_time(sizes, cap, n, alpha, bw), rtol=1e-6
        )
    return g.result()


def check_launch_order(fn: Callable) -> CheckResult:
    g = Grader("check_launch_order")
    cases = [
        ([3, 2, 1, 0], [[3, 2], [1, 0]]),  # backward's usual order
        ([3, 1, 2, 0], [[3, 2], [1, 0]]),  # 1 before 2: bucket 0 fills late
        ([1, 0, 3, 2], [[3, 2], [1, 0]]),  # bucket 1 full first, but waits for bucket 0
        ([5, 4, 0, 3, 2, 1], [[5, 4], [3, 2], [1, 0]]),  # a parameter used early (tied weights) is ready late
        ([0, 1, 2], [[2, 1, 0]]),
    ]
    for ready, buckets in cases:
        got = g.call(fn, list(ready), [list(b) for b in buckets])
        g.compare(f"ready={ready}, buckets={buckets}", got, launch_order(ready, buckets))
    return g.result()


def check_exposed_communication(fn: Callable) -> CheckResult:
    g = Grader("check_exposed_communication")
    cases = [
        ([3.0], [1.0]),  # one bucket: all of it exposed
        ([1.0, 1.0, 1.0], [0.5, 0.5, 0.5]),  # each hides behind the next backward
        ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]),  # the link is the bottleneck: all-reduces queue
        ([2.0, 0.1, 0.1], [0.5, 0.5, 0.5]),  # the last buckets come quickly
        ([0.1, 0.1, 3.0], [1.0, 1.0, 0.2]),
    ]
    for compute, comm in cases:
        g.compare(
            f"compute={compute}, comm={comm}",
            g.call(fn, list(compute), list(comm)),
            exposed_communication(compute, comm),
            atol=1e-9,
        )
    return g.result()
