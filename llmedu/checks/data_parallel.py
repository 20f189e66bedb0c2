"""Graders for the data-parallel lesson (11): what buckets cost, when they launch, what stays exposed.

check_bucket_comm_time(fn)      fn(sizes, bucket_bytes, world_size, alpha, bandwidth) -> seconds of
                                all-reduce per step: one ring all-reduce per bucket (``assign_buckets``),
                                each 2(N-1) alpha + 2(N-1)/N bytes / bandwidth (lesson 10's alpha-beta model)
check_launch_order(fn)          fn(ready, buckets) -> for each bucket, how many gradients were ready when
                                DDP launched it: a bucket goes when it is full AND every earlier bucket
                                has gone (the rule that keeps the ranks' all-reduces paired)
check_exposed_communication(fn) fn(compute, comm) -> seconds the step waits after backward: bucket i's
                                all-reduce can start once its gradients are computed (compute[0..i]) and
                                the link is free (one all-reduce at a time)
check_bucket_prediction(answer) a prediction: buckets and all-reduce seconds per step for 100 parameters of
                                1 MiB on 8 ranks (alpha 10 us, 25e9 bytes/s) in 25 MiB and in 0.1 MiB buckets
check_accumulation(fn)          fn(model, optimizer, micro_batches) -> one optimizer step of a ``DDP`` model
                                over the micro-batches (x, y) with MSE, equal to one step on their concatenation,
                                by the method: one forward per micro-batch and none larger (a forward pre-hook
                                records the rows), one backward per micro-batch, each finished before the next
                                forward (a hook on the first parameter's accumulated gradient marks the end of a
                                backward), and one all-reduce per bucket, all launched after the last
                                micro-batch's forward (``no_sync`` around every backward but the last). Run in a
                                group of one rank (the number of all-reduces does not depend on N), over a
                                ``Link`` whose records count them and say when each was launched.

Every check of a function fails one that calls the reference answer kept here instead of computing its own;
``check_bucket_comm_time`` also fails one that borrows ``Link.op_time``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from types import CodeType

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.data_parallel import DDP, assign_buckets
from ..parallel.link import Link
from .core import CheckResult, Grader

__all__ = [
    "check_bucket_comm_time",
    "check_bucket_prediction",
    "check_launch_order",
    "check_exposed_communication",
    "check_accumulation",
]


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


def _refuse_reference(g: Grader, fn: Callable, reference: Callable, borrowed: tuple[str, ...] = ()) -> bool:
    """Fail (and return False) if ``fn`` calls the reference answer of this module, or a library function
    that answers the exercise (``borrowed``), by its name."""
    code = getattr(fn, "__code__", None)
    if code is not None and reference.__name__ in _names(code):
        return g.expect(
            "the method",
            False,
            f"your function calls {reference.__name__}, the grader's own answer: compute it yourself",
        )
    for name in borrowed if code is not None else ():
        if name in _names(code):
            return g.expect("the method", False, f"your function calls {name}, which answers the exercise: write it")
    return True


def check_bucket_comm_time(fn: Callable) -> CheckResult:
    g = Grader("check_bucket_comm_time")
    if not _refuse_reference(g, fn, bucket_comm_time, borrowed=("op_time",)):
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


PREDICTION_CASE = dict(sizes=[2**20] * 100, world_size=8, alpha=1e-5, bandwidth=25e9)  # 100 MiB in 1 MiB pieces


def check_bucket_prediction(answer: dict) -> CheckResult:
    """``answer`` maps "buckets at 25 MiB", "seconds at 25 MiB", "buckets at 0.1 MiB" and "seconds at 0.1 MiB"
    to numbers (seconds within 2%). A failure gives a hint, not the answer."""
    g = Grader("check_bucket_prediction")
    c = PREDICTION_CASE
    hints = {
        "buckets": "assign_buckets never splits a parameter: what does it do with one larger than a bucket?",
        "seconds": "every bucket pays 2(N-1) latencies, and 2(N-1)/N of its bytes cross each rank's link",
    }
    for mib in (25, 0.1):
        cap = int(mib * 2**20)
        want = {
            "buckets": len(assign_buckets(c["sizes"], cap)),
            "seconds": bucket_comm_time(c["sizes"], cap, c["world_size"], c["alpha"], c["bandwidth"]),
        }
        for what in ("buckets", "seconds"):
            key = f"{what} at {mib:g} MiB"
            got = answer.get(key) if isinstance(answer, dict) else None
            if not isinstance(got, (int, float)) or isinstance(got, bool):
                g.expect(key, False, f"fill in a number for {key!r} (got {got!r})")
                break
            close = got == want[what] if what == "buckets" else abs(got - want[what]) <= 0.02 * want[what]
            g.expect(key, close, f"{got!r} is not it; {hints[what]}")
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


def _passes(module: nn.Module) -> tuple[list[tuple[int, float]], list[float]]:
    """Record (rows of the input, time) for every forward of ``module``, however it is called, and the time
    every backward ends: the first parameter's gradient is the last one backward accumulates."""
    forwards: list[tuple[int, float]] = []
    backwards: list[float] = []

    def note(module, args, kwargs) -> None:
        x = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        forwards.append((x.shape[0], time.perf_counter()))

    module.register_forward_pre_hook(note, with_kwargs=True)
    first = next(p for p in module.parameters() if p.requires_grad)
    first.register_post_accumulate_grad_hook(lambda p: backwards.append(time.perf_counter()))
    return forwards, backwards


def _check_method(
    g: Grader, case: str, forwards: list, backwards: list, records: list[dict], micro: int, rows: int
) -> None:
    """One forward per micro-batch, none larger, one backward per micro-batch finished before the next forward,
    and every all-reduce launched after the last forward."""
    g.compare(f"{case}: forward passes (one per micro-batch)", len(forwards), micro)
    g.expect(
        f"{case}: backward passes (one per micro-batch)",
        len(backwards) == micro,
        f"{len(backwards)} backward pass(es) for {micro} micro-batches: call backward() on each micro-batch's "
        "loss; one backward of the summed losses keeps every micro-batch's activations alive at once",
    )
    starts = [t for _, t in forwards[1:]] + [float("inf")]
    g.expect(
        f"{case}: each backward before the next forward",
        len(backwards) == len(forwards) and all(f < b < s for (_, f), b, s in zip(forwards, backwards, starts)),
        "a micro-batch's forward ran before the previous micro-batch's backward had finished: run forward "
        "then backward for one micro-batch before the next, so only one micro-batch's activations are alive",
    )
    largest = max((r for r, _ in forwards), default=0)
    g.expect(
        f"{case}: the largest forward",
        largest <= rows,
        f"a forward of {largest} rows, but a micro-batch has {rows}: run each micro-batch through the model alone "
        "(that is what bounds the activations' memory)",
    )
    sent = [r for r in records if r["op"] == "all_reduce"]
    g.expect(
        f"{case}: when the all-reduces were launched",
        not forwards or all(r["launched"] > forwards[-1][1] for r in sent),
        "an all-reduce was launched before the last micro-batch's forward: every backward but the last "
        "belongs inside model.no_sync()",
    )


def check_accumulation(fn: Callable) -> CheckResult:
    g = Grader("check_accumulation")
    if not _refuse_reference(g, fn, accumulation_step):
        return g.result()
    _one_rank_group()
    try:
        for micro, width, bucket_bytes in [(1, 8, 400), (2, 8, 400), (4, 16, 600), (3, 16, 10**6)]:
            link = Link(0.0, float("inf"))  # no time: its records only count the all-reduces
            model = DDP(_accumulation_model(1, width), bucket_mb=bucket_bytes / 2**20, timed=False, link=link)
            forwards, backwards = _passes(model.module)
            single = _accumulation_model(1, width)
            optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, single)]
            data = torch.Generator().manual_seed(micro)
            for step in range(2):
                case = f"{micro} micro-batches, {len(model.buckets)} bucket(s), step {step}"
                x, y = torch.randn(4 * micro, 6, generator=data), torch.randn(4 * micro, 2, generator=data)
                pieces = list(zip(x.chunk(micro), y.chunk(micro)))  # (4, 6) and (4, 2) each
                link.records.clear()
                forwards.clear()
                backwards.clear()
                g.call(fn, model, optims[0], pieces)
                if g.failure is not None:
                    return g.result()
                optims[1].zero_grad()
                nn.functional.mse_loss(single(x), y).backward()
                optims[1].step()
                g.expect(
                    f"{case}: pending all-reduces",
                    not model._pending,
                    "an all-reduce was still in flight after your step: call finish_gradient_sync() before the step",
                )
                sent = sum(r["op"] == "all_reduce" for r in link.records)
                g.compare(f"{case}: all-reduces sent", sent, len(model.buckets))
                _check_method(g, case, forwards, backwards, link.records, micro, rows=4)
                got = torch.cat([p.detach().flatten() for p in model.parameters()])
                want = torch.cat([p.detach().flatten() for p in single.parameters()])
                g.compare(f"{case}: parameters after the step (one step on all micro-batches)", got, want, atol=1e-6)
    finally:
        dist.destroy_process_group()
    return g.result()
