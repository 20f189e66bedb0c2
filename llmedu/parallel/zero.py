"""ZeRO stages 1, 2 and 3 from scratch (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", §5).

Data parallelism keeps a full copy of the model states on every one of N ranks: Ψ parameters,
Ψ gradients and the optimizer state, (2 + 2 + K)Ψ bytes in mixed precision. ZeRO keeps each
rank's *shard*, 1/N of every flat buffer, and removes the redundancy one kind of state at a time:

    stage 1  optimizer state sharded: each rank updates its shard, then all-gathers parameters
             per-rank bytes 4Ψ + KΨ/N               (§5.2, P_os)
    stage 2  + gradients reduce-scattered during backward: each rank keeps only its shard
             per-rank bytes 2Ψ + (2 + K)Ψ/N         (P_os+g)
    stage 3  + parameters sharded: a unit's full parameters are all-gathered just before its
             forward and again before its backward, and freed right after
             per-rank bytes (2 + 2 + K)Ψ/N          (P_os+g+p)

How the code is laid out. The model is cut into *units* (the modules you name, say each
transformer block, plus the root for the parameters left over). The parameters of a unit are
flattened into one buffer, padded with zeros to a multiple of N, so that any sizes work; rank r
owns elements [r·S, (r+1)·S) of it, S = padded size / N (``ZeROUnit``, in ``zero_unit.py``). Each
unit's shard is an fp32 ``nn.Parameter``: the *master* weights, what the inner optimizer (AdamW,
say) steps. The module
itself no longer has parameters: before each forward, a hook hands each of its submodules plain
tensor views of the unit's full flat buffer, which is

    stages 1, 2   a persistent buffer in the compute dtype, refreshed by an all-gather after each step
    stage 3       all-gathered from the shards by ``_ShardedUnit`` and dropped after the forward;
                  autograd's saved tensors that point into it are replaced by a marker, and
                  regathered when backward asks for them (with ``prefetch``, one unit ahead)

and gradients go, for stages 2 and 3, through ``_ShardedUnit``'s backward, which reduce-scatters
the unit's gradient straight into the shard's ``.grad``: the full gradient of a unit lives only
for the moment of that collective. Stage 1 keeps the full gradient and reduce-scatters it at step.

Mixed precision (``compute_dtype=torch.bfloat16``): fp32 master shards, bf16 parameters and
gradients in forward and backward; gradients are reduced in fp32. Gradient accumulation: call
backward several times, then ``step()``. Clipping: the global norm is the square root of the sum,
over ranks, of each shard's squared norm.

Frozen parameters (``requires_grad=False``, say the base weights under LoRA) have no gradient and
no optimizer state, so there is nothing of theirs to shard in stages 1 and 2: they stay in their
modules, whole on every rank (broadcast from rank 0 once, cast to the compute dtype), outside
every unit, and cost no communication per step. Stage 3 keeps them whole too, which is simple but
gives up stage 3's saving on them: per rank 2Ψ_f + (2 + 2 + K)Ψ_t/N bytes in mixed precision (Ψ_f
frozen, Ψ_t trainable), and under LoRA Ψ_f is nearly all of Ψ (FSDP shards frozen parameters as
well: gathered for forward and backward, never reduced). A tied parameter (one tensor held by two
submodules, GPT-2's embedding and output head) belongs to one unit (``assign_parameters``, in
``zero_unit.py``): stored, reduced and stepped once; both holders get views of the same gathered
elements, and autograd adds the gradients of the two uses.

Left out: overlapping the reduce-scatter with backward compute in buckets (DeepSpeed's IPG
buckets; we reduce one unit at a time, synchronously), per-parameter-group hyperparameters
(one group of shards), sharding frozen parameters (stage 3), offloading parameters or to NVMe
(``host=`` moves the optimizer to the CPU: ``offload.py``), sharded checkpoints. The production
peers are ``torch.distributed.optim.ZeroRedundancyOptimizer`` (stage 1) and FSDP2's ``fully_shard``
(stage 3); the tests compare with both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..optim import adamw
from .compat import all_gather_single
from .zero_unit import Holders, ZeROUnit, assign_parameters

__all__ = ["ZeRO", "ELEMENTWISE_OPTIMIZERS"]


class ZeRO(nn.Module):
    """Wrap ``module`` for ZeRO ``stage`` 1, 2 or 3; own its parameters and its optimizer.

    ``optimizer_class(**optimizer_kwargs)`` is built over this rank's fp32 shards; it must be
    element-wise (``ELEMENTWISE_OPTIMIZERS``). ``units`` are the submodules whose parameters are
    gathered and reduced together (default: every child of every ``nn.ModuleList``, i.e. the
    layers); the root takes the rest, and any weight tied across units. Frozen parameters stay whole
    in their modules. ``module`` is taken over: use it only through the wrapper. Use it like a model
    plus an optimizer::

        zero = ZeRO(model, stage=2, lr=1e-3)
        for micro in batches: zero(micro).loss.div(len(batches)).backward()
        zero.step(); zero.zero_grad()
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        optimizer_class: type = torch.optim.AdamW,
        *,
        units: list[nn.Module] | None = None,
        compute_dtype: torch.dtype = torch.float32,
        max_grad_norm: float | None = None,
        prefetch: bool = False,
        group: dist.ProcessGroup | None = None,
        host: torch.device | str | None = None,
        **optimizer_kwargs,
    ):
        super().__init__()
        _check_arguments(stage, optimizer_class, max_grad_norm, host)  # (at the end of the file)
        self.module, self.stage, self.max_grad_norm, self.prefetch = module, stage, max_grad_norm, prefetch
        self.group, self.dtype = group, compute_dtype
        self.host = None if host is None else torch.device(host)  # master shards + optimizer live here
        if units is None:
            units = [c for m in module.modules() if isinstance(m, nn.ModuleList) for c in m]
        modules = [*units, module]  # the root last
        self.units = [self._make_unit(m, params) for m, params in zip(modules, assign_parameters(modules)) if params]
        _check_something_to_train(self.units)
        self.frozen = [p for p in module.parameters() if not p.requires_grad]  # left in their modules, whole
        for p in self.frozen:  # one copy per rank, the same on all, in the dtype the computation runs in
            if p.is_floating_point():
                p.data = p.data.to(compute_dtype)
            dist.broadcast(p.data, group=group, group_src=0)
        self.shards = nn.ParameterList(u.shard for u in self.units)  # (S,) fp32 master weights of this rank
        # (N·S,) full copies in the compute dtype, stages 1 and 2 only
        self.fulls = nn.ParameterList(u.flat for u in self.units) if stage < 3 else None
        self.optimizer = optimizer_class(list(self.shards), **optimizer_kwargs)
        self._hooks = []
        for unit in self.units:
            self._hooks.append(unit.module.register_forward_pre_hook(lambda m, a, u=unit: self._before_forward(u)))
            if stage == 3:
                self._hooks.append(unit.module.register_forward_hook(lambda m, a, o, u=unit: self._after_forward(u)))

    def _make_unit(self, module: nn.Module, params: list[tuple[nn.Parameter, Holders]]) -> ZeROUnit:
        """Take ``params``, assigned to ``module``, out of every submodule that holds them: one unit's flat buffer."""
        for _, holders in params:
            for owner, name in holders:  # two of them for a tied weight
                del owner._parameters[name]  # the wrapper owns it now; the hook sets a view before forward
                setattr(owner, name, None)
        return ZeROUnit(module, params, stage=self.stage, compute_dtype=self.dtype, group=self.group, host=self.host)

    # -- forward: hand each submodule views of its unit's full buffer ---------------------------
    def _before_forward(self, unit: ZeROUnit) -> None:
        _check_untouched(unit)  # nobody changed the parameters behind the wrapper's back
        if self.stage == 1:
            flat = unit.flat  # (N·S,) a leaf: its .grad is the full gradient
        elif torch.is_grad_enabled():
            flat = _ShardedUnit.apply(unit.shard, unit)
        else:
            flat = unit.full() if self.stage == 3 else unit.flat.detach()
        if self.stage == 3 and self.prefetch:
            nxt = self.units.index(unit) + 1
            if nxt < len(self.units) and self.units[nxt].module is not self.module:  # (the root is gathered first)
                self.units[nxt].start_gather()
        for owner, name, view in unit.views(flat):
            setattr(owner, name, view)
        if self.stage == 3 and torch.is_grad_enabled():
            unit.hook_saved_tensors(*self._pack_unpack(unit))

    def _after_forward(self, unit: ZeROUnit) -> None:
        """Stage 3: drop the full parameters; backward regathers what autograd saved of them."""
        unit.unhook_saved_tensors()
        for owner, name in unit.attributes:
            setattr(owner, name, None)
        unit.release()

    def _pack_unpack(self, unit: ZeROUnit):
        ptr = unit.gathered.untyped_storage().data_ptr()
        index = self.units.index(unit)

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() == ptr and t.dtype == self.dtype:
                return ("zero-param", t.shape, t.stride(), t.storage_offset())  # a marker, not the bytes
            return t

        def unpack(saved):
            if not (isinstance(saved, tuple) and saved and saved[0] == "zero-param"):
                return saved
            if self.prefetch and index > 0 and unit.module is not self.module:
                self.units[index - 1].start_gather()  # backward runs the units in reverse
            return unit.full().as_strided(saved[1], saved[2], saved[3])

        return pack, unpack

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> float:
        """Average gradients, clip by the global norm, step the shards, refresh the full copies.

        Returns the global gradient norm (before clipping).
        """
        for unit in self.units:
            _check_ready_to_step(unit)
            if self.stage == 1:
                own = unit.reduce_scatter(unit.flat.grad)  # (S,) fp32: a rank needs only its shard
                if self.dtype == torch.float32:  # ... and may keep it in the full buffer's slice
                    own = unit.own(unit.flat.grad).copy_(own)
                unit.shard.grad = own
        squares = torch.stack([u.shard.grad.float().pow(2).sum() for u in self.units]).sum()
        squares = squares.to(self.units[0].device)  # (collectives run on the compute device)
        dist.all_reduce(squares, group=self.group)  # the sum over every shard of every rank
        norm = squares.sqrt().to(self.units[0].shard.device)
        if self.max_grad_norm is not None:  # as torch.nn.utils.clip_grad_norm_
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            for unit in self.units:
                unit.shard.grad.mul_(coef)
        self.optimizer.step()
        if self.stage < 3:
            for unit in self.units:  # everyone sends its updated shard and receives the others
                shard = unit.shard.detach().to(unit.device, self.dtype)  # (from the host, if offloaded)
                all_gather_single(unit.flat.data, shard, group=self.group)
        for unit in self.units:
            unit.record_versions()  # these changes were ours
        return norm.item()

    def zero_grad(self) -> None:
        for unit in self.units:
            if self.stage == 1:
                unit.flat.grad, unit.shard.grad = None, None
            else:
                unit.shard.grad.zero_()  # a persistent (S,) buffer: accumulation adds into it

    # -- for checks and checkpoints ---------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, full and fp32, by its name(s) in the wrapped module (a collective: all ranks call it).

        A tied weight appears under each of its names, as in ``module.state_dict()``.
        """
        names = {id(m): n for n, m in self.module.named_modules()}
        out = {}
        for unit in self.units:
            flat = torch.empty(unit.world * unit.shard_size, dtype=torch.float32, device=unit.device)
            all_gather_single(flat, unit.shard.detach().to(unit.device, torch.float32), group=self.group)
            for owner, name, view in unit.views(flat):
                prefix = names[id(owner)]
                out[f"{prefix}.{name}" if prefix else name] = view.clone()
        for name, p in self.module.named_parameters(remove_duplicate=False):  # what is left: the frozen ones
            out[name] = p.detach().float().clone()
        return out


class _ShardedUnit(torch.autograd.Function):
    """Forward: the unit's full flat parameters. Backward: reduce-scatter their gradient to the shard."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, unit: ZeROUnit) -> torch.Tensor:
        ctx.unit = unit
        if unit.stage == 3:
            return unit.full()  # (N·S,) all-gathered from every rank's shard
        return unit.flat.view_as(unit.flat)  # stage 2: the persistent full copy

    @staticmethod
    def backward(ctx, grad_flat: torch.Tensor):  # (N·S,) this rank's gradient of the full buffer
        unit = ctx.unit
        unit.release()  # every user of the unit's parameters has run its backward
        return unit.reduce_scatter(grad_flat), None  # autograd adds it to shard.grad (accumulation)


# -- the checks, kept out of the way of the algorithm above ------------------------------------------
# An optimizer can be sharded by elements only if each element's update reads nothing but that
# element's parameter, gradient and state. These do; LBFGS (a line search over the whole vector),
# Adafactor-like factored moments, Shampoo, or 8-bit Adam's block-wise scales (llmedu.optim.AdamW8bit) do not.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    adamw.AdamW,  # ours, from scratch (llmedu.optim)
)


def _check_arguments(stage: int, optimizer_class: type, max_grad_norm: float | None, host) -> None:
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r} (stage 0 is plain DDP)")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, ELEMENTWISE_OPTIMIZERS)):
        raise TypeError(
            f"cannot shard {getattr(optimizer_class, '__name__', optimizer_class)!r}: ZeRO splits every tensor "
            "across ranks, so each element's update must depend on that element alone; pass an optimizer class "
            f"among {[f'{c.__module__}.{c.__name__}' for c in ELEMENTWISE_OPTIMIZERS]}"
        )
    if not dist.is_initialized():
        raise RuntimeError("ZeRO needs torch.distributed initialised (run it under llmedu.parallel.launch or torchrun)")
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
    if host is not None and stage != 2:
        raise ValueError(f"the optimizer can be offloaded with stage 2 only (ZeRO-Offload), got stage {stage}")


def _check_something_to_train(units: list[ZeROUnit]) -> None:
    if not units:
        raise ValueError(
            "nothing to train: every parameter of the module is frozen (requires_grad=False), or it has none; "
            "ZeRO shards the trainable parameters and their optimizer state"
        )


def _check_untouched(unit: ZeROUnit) -> None:
    """Before a forward: the unit's parameters were neither replaced nor changed in place outside ZeRO."""
    for owner, name in unit.attributes:
        if name in owner._parameters:
            raise RuntimeError(
                f"{type(owner).__name__}.{name} was replaced by a new parameter outside ZeRO: the wrapper owns "
                "the parameters; change them through it (or wrap the model again)"
            )
    if unit.versions_now() != unit.version:
        raise RuntimeError(
            "parameters were changed in place outside ZeRO (not by its step()): every rank's shard would "
            "disagree with the full copy; change them before wrapping, or through zero.shards"
        )


def _check_ready_to_step(unit: ZeROUnit) -> None:
    if unit.versions_now() != unit.version:
        raise RuntimeError("parameters were changed in place outside ZeRO since its last step")
    if unit.stage == 1 and unit.flat.grad is None:
        raise RuntimeError("step() before any backward(): there is no gradient to apply")
