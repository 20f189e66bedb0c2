"""ZeRO stages 1, 2 and 3 from scratch (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", §5).

Data parallelism keeps a full copy of the model states on every one of N ranks: Ψ parameters,
Ψ gradients and the optimizer state, (2 + 2 + K)Ψ bytes in mixed precision. ZeRO keeps each
rank's *shard*, 1/N of every flat buffer, and removes the redundancy one kind of state at a time:

    stage 1  optimizer state sharded: each rank updates its shard, then all-gathers parameters
             per-rank bytes 4Ψ + KΨ/N               (§5.1, P_os)
    stage 2  + gradients reduce-scattered during backward: each rank keeps only its shard
             per-rank bytes 2Ψ + (2 + K)Ψ/N         (§5.2, P_os+g)
    stage 3  + parameters sharded: a unit's full parameters are all-gathered just before its
             forward and again in its backward, and freed right after
             per-rank bytes (2 + 2 + K)Ψ/N          (§5.3, P_os+g+p)

Each stage is one small class below; they share the flat shard of each unit (``zero_shard.py``:
flatten, pad to N·S, rank r owns [r·S, (r+1)·S)) and the bookkeeping of units, frozen and tied
parameters and the clipped step (``zero_common.py``); the guards are in ``zero_checks.py``. Mixed
precision (``compute_dtype=torch.bfloat16``): fp32 master shards, bf16 parameters and gradients in
forward and backward, gradients reduced in fp32. Gradient accumulation: call backward several
times, then ``step()``; stage 1 accumulates the full gradient and reduce-scatters it once, in the step,
while stages 2 and 3 reduce-scatter in every backward (G micro-batches send G reduce-scatters), as
DeepSpeed's stage 2 does. A buffer lives only as long as its stage needs it: stage 1 frees the full
gradient once it is reduce-scattered, before the optimizer runs; the gradient shards of stages 2 and 3
are made by the first backward after a ``zero_grad()`` and dropped by it.

Left out: overlapping the reduce-scatter with backward compute in buckets (DeepSpeed's IPG buckets;
we reduce one unit at a time, synchronously), per-parameter-group hyperparameters, sharding frozen
parameters (stage 3), offloading parameters or to NVMe (``host=`` moves the optimizer to the CPU:
``offload.py``), sharded checkpoints. The production peers are
``torch.distributed.optim.ZeroRedundancyOptimizer`` (stage 1) and FSDP2's ``fully_shard`` (stage 3);
the tests compare with both.
"""

from __future__ import annotations

import torch
from torch import nn

from .zero_checks import ELEMENTWISE_OPTIMIZERS, check_ready_to_step, check_stage, check_untouched, record_versions
from .zero_common import ZeROBase
from .zero_shard import FlatShard

__all__ = ["ZeRO", "ZeRO1", "ZeRO2", "ZeRO3", "ELEMENTWISE_OPTIMIZERS"]


class ZeRO1(ZeROBase):
    """Stage 1: the optimizer state is sharded; every rank keeps the full parameters and the full gradient."""

    stage = 1

    def setup(self, unit: FlatShard, flat32: torch.Tensor) -> None:
        unit.flat = nn.Parameter(flat32.to(self.dtype))  # (N·S,) a leaf: backward leaves the full gradient in .grad
        unit.shard = self.master_shard(unit, flat32)  # (S,) fp32, elements [r·S, (r+1)·S): what AdamW steps

    def unit_forward(self, unit: FlatShard, forward, *args, **kwargs):
        check_untouched(unit)
        unit.hand_out(unit.flat)  # each submodule computes with its view of the full copy
        return forward(*args, **kwargs)

    @torch.no_grad()
    def step(self) -> float:
        """Reduce-scatter the gradients, step this rank's shards, all-gather them; return the gradient norm."""
        check_ready_to_step(self.units, self.stage)
        for unit in self.units:  # a rank needs the average gradient of its own shard only
            unit.shard.grad = unit.reduce_scatter(unit.flat.grad)  # (N·S,) -> (S,)
            unit.flat.grad = None  # the full gradient is done with: free it before AdamW's temporaries exist
        norm = self.clip_and_step()
        for unit in self.units:  # everyone sends its updated shard and receives the others'
            unit.all_gather(unit.shard, out=unit.flat.data)  # (S,) -> (N·S,)
        record_versions(self.units)
        return norm

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.flat.grad = unit.shard.grad = None


class ReduceScatterGrad(torch.autograd.Function):
    """``flat = all_gather(shard)``, as autograd sees it: the full parameters as a function of this rank's shard.

    Forward returns ``unit.flat``, which the stage has already gathered (stage 3) or keeps (stage 2), so
    nothing is sent. Backward is the transpose of an all-gather, a reduce-scatter: the gradient of ``flat``,
    complete once every use of the unit's parameters has run its backward, becomes the average gradient of
    this rank's shard, which autograd adds to ``shard.grad`` (creating it on the first backward after
    ``zero_grad()``). Stages 2 and 3."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, unit: FlatShard) -> torch.Tensor:
        ctx.unit = unit
        return unit.flat.view_as(unit.flat)  # (N·S,)

    @staticmethod
    def backward(ctx, grad_flat: torch.Tensor):  # (N·S,) this rank's gradient of the full parameters
        unit = ctx.unit
        if not isinstance(unit.flat, nn.Parameter):
            unit.flat = None  # stage 3: the parameters gathered again for backward are done with
        return unit.reduce_scatter(grad_flat), None  # (S,): the full gradient lived only for this collective


class ZeRO2(ZeROBase):
    """Stage 2: the gradients are sharded too; each unit's is reduce-scattered as soon as backward completes it."""

    stage = 2

    def setup(self, unit: FlatShard, flat32: torch.Tensor) -> None:
        unit.flat = nn.Parameter(flat32.to(self.dtype), requires_grad=False)  # (N·S,) full parameters, no .grad
        unit.shard = self.master_shard(unit, flat32)  # (S,) fp32 master weights; .grad made by the first backward

    def unit_forward(self, unit: FlatShard, forward, *args, **kwargs):
        check_untouched(unit)
        if torch.is_grad_enabled():
            unit.hand_out(ReduceScatterGrad.apply(unit.shard, unit))
        else:
            unit.hand_out(unit.flat.detach())
        return forward(*args, **kwargs)

    @torch.no_grad()
    def step(self) -> float:
        """Step this rank's shards (their gradients are already averaged), all-gather them; return the norm."""
        check_ready_to_step(self.units, self.stage)
        norm = self.clip_and_step()
        for unit in self.units:
            unit.all_gather(unit.shard, out=unit.flat.data)  # (S,) -> (N·S,), from the host if offloaded
        record_versions(self.units)
        return norm

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.shard.grad = None  # no (S,) buffer between steps: the next backward's reduce-scatter makes it


class ZeRO3(ZeROBase):
    """Stage 3: the parameters are sharded too; a unit's full parameters exist only while it computes.

    Before a unit's forward its shards are all-gathered; after it, the buffer is dropped. Autograd would
    keep it alive for backward (a linear layer saves its weight), so while the unit runs, autograd saves,
    instead of a tensor of the unit's parameters, where that tensor lies in the buffer (a marker of three
    numbers); in backward the first marker read gathers the parameters again, and ``ReduceScatterGrad``
    drops them once the unit's gradient is reduced. (FSDP and labml free by resizing the buffer's storage to
    0 bytes instead, which ``MemoryTracker`` cannot see; dropping the buffer lets it measure the saving.)
    ``prefetch=True`` starts the all-gather of the unit that runs next while this one computes.
    """

    stage = 3

    def __init__(self, module: nn.Module, optimizer_class: type = torch.optim.AdamW, *, prefetch=False, **kwargs):
        super().__init__(module, optimizer_class, **kwargs)
        self.prefetch = prefetch

    def setup(self, unit: FlatShard, flat32: torch.Tensor) -> None:
        unit.shard = self.master_shard(unit, flat32)  # (S,) fp32: all this rank keeps of the unit

    def unit_forward(self, unit: FlatShard, forward, *args, **kwargs):
        check_untouched(unit)
        unit.flat = self.gather(unit)  # (N·S,) every rank's shard, in the compute dtype
        self.start_gather(unit, +1)  # (with prefetch) the next unit's, while this one computes
        if not torch.is_grad_enabled():
            unit.hand_out(unit.flat)
            out = forward(*args, **kwargs)
        else:
            unit.hand_out(ReduceScatterGrad.apply(unit.shard, unit))
            with torch.autograd.graph.saved_tensors_hooks(*self.markers(unit)):
                out = forward(*args, **kwargs)
        unit.hand_out(None)  # the last references to the full parameters go: the buffer is freed
        unit.flat = None
        return out

    def markers(self, unit: FlatShard):
        """Autograd's pack and unpack: a saved tensor in the unit's buffer becomes (shape, stride, offset)."""
        storage = unit.flat.untyped_storage().data_ptr()

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() == storage:
                return (t.shape, t.stride(), t.storage_offset())  # a marker, not the bytes
            return t

        def unpack(saved):
            if isinstance(saved, torch.Tensor):
                return saved
            if unit.flat is None:  # the first marker of this unit's backward: gather the parameters again
                unit.flat = self.gather(unit)
                self.start_gather(unit, -1)  # backward runs the units in reverse
            return unit.flat.as_strided(*saved)

        return pack, unpack

    def gather(self, unit: FlatShard) -> torch.Tensor:
        """(N·S,) the unit's full parameters: from an all-gather started ahead of time, or from one now."""
        if unit.pending is not None:
            (flat, work), unit.pending = unit.pending, None
            work.wait()
            return flat
        flat = torch.empty(unit.world * unit.shard_size, dtype=self.dtype, device=unit.device)
        unit.all_gather(unit.shard, out=flat)
        return flat

    def start_gather(self, unit: FlatShard, step: int) -> None:
        """With ``prefetch``: start the all-gather of the unit ``step`` places away (every rank in the same order).

        The root (the last unit) encloses all the others: it is gathered first and never prefetched.
        """
        i = self.units.index(unit) + step
        if self.prefetch and 0 <= i < len(self.units) - 1:
            nxt = self.units[i]
            if nxt.flat is None and nxt.pending is None:
                flat = torch.empty(nxt.world * nxt.shard_size, dtype=self.dtype, device=nxt.device)
                nxt.pending = (flat, nxt.all_gather(nxt.shard, out=flat, async_op=True))

    @torch.no_grad()
    def step(self) -> float:
        """Step this rank's shards; nothing to gather: the next forward gathers what it needs."""
        check_ready_to_step(self.units, self.stage)
        norm = self.clip_and_step()
        record_versions(self.units)
        return norm

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.shard.grad = None


STAGES = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}


def ZeRO(module: nn.Module, stage: int, optimizer_class: type = torch.optim.AdamW, **kwargs) -> ZeROBase:  # noqa: N802
    """Wrap ``module`` for ZeRO ``stage`` 1, 2 or 3 (``ZeRO1``, ``ZeRO2``, ``ZeRO3``); it owns the parameters and
    the optimizer, ``optimizer_class(**optimizer_kwargs)`` over this rank's fp32 shards, element-wise
    (``ELEMENTWISE_OPTIMIZERS``). Keywords: ``units`` (the submodules gathered and reduced together;
    default every layer of every ``nn.ModuleList``; the root takes the rest), ``compute_dtype``,
    ``max_grad_norm``, ``group``, ``prefetch`` (stage 3), ``host`` (stage 2: ``offload.py``). Use it like a
    model plus an optimizer::

        zero = ZeRO(model, stage=2, lr=1e-3)
        for micro in batches: loss(zero(micro)).div(len(batches)).backward()
        zero.step(); zero.zero_grad()
    """
    check_stage(stage)
    return STAGES[stage](module, optimizer_class, **kwargs)
