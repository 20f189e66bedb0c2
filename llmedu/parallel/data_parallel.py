"""Data parallelism two ways: gradients gathered on rank 0 and parameters broadcast back, and DDP from scratch.

Each rank holds a full copy of the model and trains on its own slice of the batch. With the
loss a mean over the batch, the full-batch gradient is the mean of the ranks' gradients, so
averaging gradients makes N ranks take exactly the step one process would take on all the data.

``NaiveDataParallel`` does it the obvious way: after backward, every gradient is *gathered* on
rank 0, rank 0 averages them and steps the only optimizer, and the new parameters are
*broadcast* back. Rank 0 receives N copies of the gradients and does all the updating while the
others wait, and nothing moves before the whole backward is over.

``DDP`` is the design of PyTorch's DistributedDataParallel (Li et al., "PyTorch Distributed",
VLDB 2020): parameters are broadcast once at the start; from then on every rank steps its own
optimizer on the same averaged gradients, so they stay equal without ever being sent again.
Gradients are grouped into buckets of about ``bucket_mb`` megabytes, in the reverse order of
the parameters (roughly the order backward produces them). A hook on each parameter notes when
its gradient is ready; when a bucket is full its all-reduce starts asynchronously, while
backward goes on computing the gradients of earlier layers. ``finish_gradient_sync()`` waits
for the last all-reduces before ``optimizer.step()``; ``no_sync()`` skips communication for
gradient accumulation.

Each bucket is one flat buffer, and every ``.grad`` is a view into it (what torch's DDP does with
``gradient_as_bucket_view=True``; its default, False, copies each gradient into the bucket and the average
back out): the all-reduce averages the gradients where they are, with no copy in or out. When ``zero_grad()`` has set a ``.grad`` to None (its default), autograd hands the hook a
fresh tensor; the hook copies it into the bucket once and makes ``.grad`` the view again, as torch's
reducer does. ``zero_grad(set_to_none=False)`` zeroes the views in place, and backward then
accumulates straight into the buckets: no copy at all.

``DDP(..., link=Link(alpha, beta))`` sends the buckets over a link of known latency and bandwidth
(``link.py``): the same all-reduces, timed by the alpha-beta model, so that overlap can be measured on a CPU.

Below the algorithm, out of its way: ``check_same_model`` (every rank must hold the same model, since
the broadcast pairs tensors by position alone), and the timing that fills each wrapper's ``log`` with
spans of compute and communication for the per-rank timelines of ``llmedu.viz.timeline``
(``timed=False`` leaves it out).

Left out: unused-parameter detection (we raise instead), rebuilding the buckets in the observed
order after the first step, gradient compression hooks, mixed-precision all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import zip_longest

import torch
import torch.distributed as dist
from torch import nn

from .events import EventLog, hidden_communication
from .link import Link

__all__ = ["NaiveDataParallel", "DDP", "assign_buckets", "check_same_model", "hidden_communication"]


class _DataParallel(nn.Module):
    """What both wrappers share: the same parameters on every rank at the start."""

    def __init__(self, module: nn.Module, timed: bool):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("data parallelism needs torch.distributed initialised (use llmedu.parallel.launch)")
        self.module = module
        self.world_size = dist.get_world_size()
        check_same_model(module)  # before the broadcast, which would pair up mismatched tensors
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)  # rank 0's initialisation wins everywhere
        self.log = EventLog()  # spans of compute and communication: empty unless timed
        if timed:
            _record_spans(self)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class NaiveDataParallel(_DataParallel):
    """Gradients gathered on rank 0, the step taken there, the new parameters broadcast."""

    def __init__(self, module: nn.Module, *, timed: bool = True):
        super().__init__(module, timed)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Call after ``loss.backward()`` instead of ``optimizer.step()`` (only rank 0's steps)."""
        self._gather_gradients()
        if dist.get_rank() == 0:
            optimizer.step()
        self._broadcast_parameters()

    def _gather_gradients(self) -> None:
        """Rank 0 receives every rank's gradients and keeps their mean in its ``.grad``."""
        rank, n = dist.get_rank(), self.world_size
        for p in self.module.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                raise RuntimeError(f"a parameter of shape {tuple(p.shape)} got no gradient in backward")
            pieces = [torch.empty_like(p.grad) for _ in range(n)] if rank == 0 else None
            dist.gather(p.grad, pieces, dst=0)  # rank 0 holds N copies of every gradient
            if rank == 0:
                p.grad.copy_(torch.stack(pieces).mean(dim=0))

    def _broadcast_parameters(self) -> None:
        """Every rank receives rank 0's new parameters."""
        for p in self.module.parameters():
            if p.requires_grad:
                dist.broadcast(p, src=0)


def assign_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets, last parameter first, each at most ``bucket_bytes``.

    A parameter larger than a bucket gets a bucket of its own.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    buckets: list[list[int]] = []
    filled = bucket_bytes  # forces a new bucket for the first parameter
    for index in reversed(range(len(sizes))):
        if filled + sizes[index] > bucket_bytes and (not buckets or buckets[-1]):
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += sizes[index]
    return buckets


class DDP(_DataParallel):
    """DistributedDataParallel from scratch: bucketed all-reduce, overlapped with backward.

    ``self.flat[b]`` is bucket b's buffer (its gradients end to end, in bucket order) and each
    ``p.grad`` a view into it, so the gradients are averaged in place.
    """

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0, *, timed: bool = True, link: Link | None = None):
        super().__init__(module, timed)
        self.comm = dist if link is None else link  # a Link has torch.distributed's all_reduce, on a modelled network
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._names = {id(p): name for name, p in module.named_parameters()}
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"one flat buffer per bucket needs one gradient dtype, got {sorted(map(str, dtypes))}")
        sizes = [p.numel() * p.element_size() for p in self.params]
        self.buckets = [[self.params[i] for i in b] for b in assign_buckets(sizes, int(bucket_mb * 2**20))]
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.flat: list[torch.Tensor] = []  # (bucket numel,) each
        self._view: dict[int, torch.Tensor] = {}  # id(p) -> p's slice of its bucket, shaped like p
        for bucket in self.buckets:
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                self._view[id(p)] = piece.view_as(p)
                if p.grad is not None:
                    self._view[id(p)].copy_(p.grad)
                p.grad = self._view[id(p)]
            self.flat.append(flat)
        self._sync = True
        self._reset()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)  # gradients ready per bucket
        self._arrived: set[int] = set()  # id(p) of the parameters whose gradient is ready
        self._pending: list[torch.futures.Future] = []  # launched, in order

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside this block only accumulates local gradients (no communication)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def forward(self, *args, **kwargs):
        if self._pending:
            raise RuntimeError("call finish_gradient_sync() after backward and before the next forward")
        return super().forward(*args, **kwargs)

    @torch.no_grad()
    def _into_bucket(self, param: nn.Parameter) -> None:
        """Make ``param.grad`` its bucket's view again if autograd gave it a tensor of its own."""
        view = self._view[id(param)]
        if param.grad.data_ptr() != view.data_ptr():  # after zero_grad(set_to_none=True): a fresh tensor
            view.copy_(param.grad)
            param.grad = view

    def _grad_ready(self, param: nn.Parameter) -> None:
        self._into_bucket(param)  # under no_sync too: accumulation continues in the bucket
        if not self._sync:
            return
        self._ready[self._bucket_of[id(param)]] += 1
        self._arrived.add(id(param))
        # launch full buckets strictly in order: every rank must issue the same all-reduces in
        # the same sequence, or they would pair up the wrong buffers
        while len(self._pending) < len(self.buckets):
            b = len(self._pending)
            if self._ready[b] < len(self.buckets[b]):
                break
            self._launch(b)

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        flat = self.flat[b].div_(self.world_size)  # (bucket numel,): the .grad views, averaged in place
        work = self.comm.all_reduce(flat, async_op=True)  # returns at once; backward goes on meanwhile
        self._pending.append(work.get_future())

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all-reduce: the ``.grad`` views then hold the averaged gradients."""
        if not self._sync:
            return
        if len(self._pending) < len(self.buckets):
            missing = [self._names[id(p)] for p in self.params if id(p) not in self._arrived]
            self._reset()
            raise RuntimeError(
                f"not every gradient arrived (no gradient for {', '.join(missing) or 'no parameter'}; "
                "was backward called?): every trainable parameter must be used in the forward"
            )
        for done in self._pending:
            done.wait()
        self._reset()


# -- the guard: the same model on every rank ------------------------------------------------------------
def check_same_model(module: nn.Module) -> None:
    """Raise on every rank unless all ranks hold tensors of the same names, shapes and dtypes.

    The broadcast and the all-reduces pair tensors up by position alone: a ``Linear(4, 2)`` on
    one rank and a ``Linear(6, 2)`` on another would exchange garbage without a word. Each rank
    sends a small signature of its model to all (as torch's DDP does at construction), so all
    ranks see the same difference and raise together instead of waiting for one another.
    """
    mine = [
        (kind, name, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.requires_grad)
        for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers()))
        for name, t in named
    ]
    everyone: list[list[tuple] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone[1:], start=1):
        for index, (first, other) in enumerate(zip_longest(everyone[0], theirs)):  # None past the end
            if first != other:
                raise RuntimeError(
                    "the ranks hold different models (data parallelism needs the same on every rank): "
                    f"tensor #{index} is {_describe(first)} on rank 0 but {_describe(other)} on rank {rank}"
                )


def _describe(entry: tuple | None) -> str:
    if entry is None:
        return "missing"
    kind, name, shape, dtype, requires_grad = entry
    return f"{kind} {name!r} of shape {shape}, {dtype}{'' if requires_grad or kind == 'buffer' else ', frozen'}"


# -- timing for lesson 11's timelines, installed from outside the methods above ---------------------------
def _record_spans(wrapper: _DataParallel) -> None:
    """Fill ``wrapper.log`` with spans: forward, backward (per bucket for DDP), and each communication.

    Module and autograd hooks mark when the forward runs and when backward reaches the output; the
    methods that communicate are wrapped on this one instance, so that each call is logged as a span.
    A DDP all-reduce's span runs from its launch until the callback on its future: it includes the time
    queued behind earlier buckets and the time waiting for the other ranks to launch the same bucket.
    """
    log = wrapper.log
    marks = {"forward": 0.0, "backward": 0.0, "last gradient": 0.0, "gathered": 0.0}  # times, as log.now()

    def mark(name: str) -> None:
        marks[name] = log.now()

    def after_forward(module, args, out) -> None:
        log.add("compute", "forward", marks["forward"], log.now())
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: mark("backward"))  # runs when backward reaches the output

    wrapper.register_forward_pre_hook(lambda module, args: mark("forward"))
    wrapper.register_forward_hook(after_forward)

    if isinstance(wrapper, DDP):
        launch = wrapper._launch

        def timed_launch(b: int) -> None:
            start = log.now()
            log.add("compute", f"backward: bucket {b}", marks["backward"], start)
            marks["backward"] = start  # the next bucket's gradients are computed from here on
            launch(b)
            # waiting for the chained future (finish_gradient_sync) also waits for the span to be logged
            done = wrapper._pending[-1].then(lambda _: log.add("comm", f"all-reduce: bucket {b}", start, log.now()))
            wrapper._pending[-1] = done

        wrapper._launch = timed_launch
        return

    gather, broadcast, step = wrapper._gather_gradients, wrapper._broadcast_parameters, wrapper.step
    for p in wrapper.module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: mark("last gradient"))

    def timed_step(optimizer: torch.optim.Optimizer) -> None:
        log.add("compute", "backward", marks["backward"], marks["last gradient"])
        step(optimizer)

    def timed_gather() -> None:
        with log.span("comm", "gather gradients"):
            gather()
        mark("gathered")

    def timed_broadcast() -> None:
        if dist.get_rank() == 0:  # between the gather and the broadcast, rank 0 stepped the optimizer
            log.add("compute", "optimizer step", marks["gathered"], log.now())
        with log.span("comm", "broadcast parameters"):
            broadcast()

    wrapper.step, wrapper._gather_gradients, wrapper._broadcast_parameters = timed_step, timed_gather, timed_broadcast
