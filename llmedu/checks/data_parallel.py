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
check_accumulation(fn)          fn(model, optimizer, micro_batches) -> one optimizer step of a ``DDP`` model
                                over the micro-batches (x, y) with MSE, equal to one step on their concatenation,
                                with one all-reduce per bucket: ``no_sync`` for all but the last. Run in a group
                                of one rank (the number of all-reduces does not depend on N), over a ``Link``
                                whose records count them.

Every check fails a function that calls the reference answer kept here instead of computing its own.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from types import CodeType

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.data_parallel import DDP, assign_buckets
from ..parallel.link import Link
from .core import CheckResult, Grader

__all__ = ["check_bucket_comm_time", "check_launch_order", "check_exposed_communication", "check_accumulation"]


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


def _names(code: CodeType) -> set[str]:
    """Every global or attribute name a function's code (and the code nested in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def _refuse_reference(g: Grader, fn: Callable, reference: Callable) -> bool:
    """Fail (and return False) if ``fn`` calls the reference answer of this module by its name."""
    code = getattr(fn, "__code__", None)
    if code is not None and reference.__name__ in _names(code):
        return g.expect(
            "the method",
            False,
            f"your function calls {reference.__name__}, the grader's own answer: compute it yourself",
        )
    return True


def check_bucket_comm_time(fn: Callable) -> CheckResult:
    g = Grader("check_bucket_comm_time")
    if not _refuse_reference(g, fn, bucket_comm_time):
        return g.result()
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
    if not _refuse_reference(g, fn, launch_order):
        return g.result()
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
    if not _refuse_reference(g, fn, exposed_communication):
        return g.result()
    cases = [
        ([3.0], [1.0]),  # one bucket: all of it exposed
        ([1.0, 1.0, 1.0], [0.5, 0.5, 0.5]),  # each hides behind the next backward
        ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]),  # the link is the bottleneck: all-reduces queue
        ([2.0, 0.1, 0.1], [0.5, 0.5, 0.5]),  # the last buckets come quickly
        ([0.1, 0.1, 3.0], [1.0, 1.0, 0.2]),
        ([0.1, 3.0, 0.1, 0.1], [0.1, 0.1, 2.0, 2.0]),  # the queue that decides starts in the middle
    ]
    for compute, comm in cases:
        g.compare(
            f"compute={compute}, comm={comm}",
            g.call(fn, list(compute), list(comm)),
            exposed_communication(compute, comm),
            atol=1e-9,
        )
    return g.result()


def accumulation_step(model: DDP, optimizer: torch.optim.Optimizer, micro_batches: list) -> None:
    """The reference: every micro-batch but the last under no_sync, each loss divided by their number."""
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with model.no_sync() if not last else nullcontext():
            (nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()
    model.finish_gradient_sync()
    optimizer.step()


def _accumulation_model(seed: int, width: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))


def _one_rank_group() -> None:
    if dist.is_initialized():
        raise RuntimeError("check_accumulation starts a process group of its own: call it outside launch()")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def check_accumulation(fn: Callable) -> CheckResult:
    g = Grader("check_accumulation")
    if not _refuse_reference(g, fn, accumulation_step):
        return g.result()
    _one_rank_group()
    try:
        for micro, width, bucket_bytes in [(1, 8, 400), (2, 8, 400), (4, 16, 600), (3, 16, 10**6)]:
            link = Link(0.0, float("inf"))  # no time: its records only count the all-reduces
            model = DDP(_accumulation_model(1, width), bucket_mb=bucket_bytes / 2**20, timed=False, link=link)
            single = _accumulation_model(1, width)
            optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, single)]
            data = torch.Generator().manual_seed(micro)
            case = f"{micro} micro-batches, {len(model.buckets)} bucket(s)"
            for step in range(2):
                x, y = torch.randn(4 * micro, 6, generator=data), torch.randn(4 * micro, 2, generator=data)
                pieces = list(zip(x.chunk(micro), y.chunk(micro)))  # (4, 6) and (4, 2) each
                link.records.clear()
                g.call(fn, model, optims[0], pieces)
                if g.failure is not None:
                    return g.result()
                optims[1].zero_grad()
                nn.functional.mse_loss(single(x), y).backward()
                optims[1].step()
                g.expect(
                    f"{case}, step {step}: pending all-reduces",
                    not model._pending,
                    "an all-reduce was still in flight after your step: call finish_gradient_sync() before the step",
                )
                sent = sum(r["op"] == "all_reduce" for r in link.records)
                g.compare(f"{case}, step {step}: all-reduces sent", sent, len(model.buckets))
                got = torch.cat([p.detach().flatten() for p in model.parameters()])
                want = torch.cat([p.detach().flatten() for p in single.parameters()])
                g.compare(
                    f"{case}, step {step}: parameters after the step (one step on all micro-batches)",
                    got,
                    want,
                    atol=1e-6,
                )
    finally:
        dist.destroy_process_group()
    return g.result()
