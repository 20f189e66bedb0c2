"""What ZeRO's three stages (``zero.py``) share: units, frozen and tied parameters, the clipped step.

``ZeROBase`` cuts the model into *units* (the modules you name, by default every layer of every
``nn.ModuleList``, plus the root for the parameters left over), makes each unit's ``FlatShard``
(``zero_shard.py``), takes the parameters out of their modules (the stage hands views back before
each forward), and builds the optimizer over this rank's fp32 shards. A stage adds three things:
``setup`` (which buffers a unit keeps), ``unit_forward`` (what happens around a unit's forward) and
``step``.

Frozen parameters (``requires_grad=False``, say the base weights under LoRA) have no gradient and no
optimizer state, so there is nothing of theirs to shard in stages 1 and 2: they stay in their modules,
whole on every rank (broadcast from rank 0 once, cast to the compute dtype), and cost no communication.
Stage 3 keeps them whole too, which is simple but gives up its saving on them: 2Ψ_f + 16Ψ_t/N bytes per
rank in mixed precision (FSDP shards frozen parameters as well). A tied parameter (one tensor held by two
submodules, GPT-2's embedding and output head) belongs to one unit (``assign_parameters``): stored,
reduced and stepped once; both holders get views of the same elements, and autograd adds the gradients
of the two uses.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from .zero_checks import check_arguments, check_something_to_train, record_versions
from .zero_shard import FlatShard, Holders

__all__ = ["ZeROBase", "assign_parameters"]


def assign_parameters(modules: list[nn.Module]) -> list[list[tuple[nn.Parameter, Holders]]]:
    """For each of ``modules`` (the units, the root last): the trainable parameters it owns, with their holders.

    A parameter goes to the first module whose subtree holds *every* use of it: untied, the first unit
    that has it; tied across units, a unit above both uses (the root at worst). Frozen ones go nowhere.
    """
    holders: dict[int, Holders] = {}
    params: dict[int, nn.Parameter] = {}
    for owner in modules[-1].modules():  # the root holds every submodule once
        for name, p in owner._parameters.items():
            if p is not None and p.requires_grad:
                holders.setdefault(id(p), []).append((owner, name))
                params[id(p)] = p
    assignment = []
    for module in modules:
        inside = {id(m) for m in module.modules()}
        mine = [key for key, hs in holders.items() if all(id(owner) in inside for owner, _ in hs)]
        assignment.append([(params[key], holders.pop(key)) for key in mine])
    return assignment


class ZeROBase(nn.Module):
    """The part of ZeRO that does not depend on the stage; see ``zero.ZeRO`` for the arguments."""

    stage: int

    def __init__(
        self,
        module: nn.Module,
        optimizer_class: type = torch.optim.AdamW,
        *,
        units: list[nn.Module] | None = None,
        compute_dtype: torch.dtype = torch.float32,
        max_grad_norm: float | None = None,
        group: dist.ProcessGroup | None = None,
        host: torch.device | str | None = None,
        **optimizer_kwargs,
    ):
        super().__init__()
        check_arguments(self.stage, optimizer_class, max_grad_norm, host)
        self.module, self.dtype, self.group, self.max_grad_norm = module, compute_dtype, group, max_grad_norm
        self.host = None if host is None else torch.device(host)  # where master shards and optimizer live
        if units is None:
            units = [layer for m in module.modules() if isinstance(m, nn.ModuleList) for layer in m]
        modules = [*units, module]  # the root last
        self.units: list[FlatShard] = []
        for m, params in zip(modules, assign_parameters(modules)):
            if not params:
                continue
            unit = FlatShard(m, params, group)
            flat32 = unit.flatten([p.detach().float() for p, _ in params])  # (N·S,) the initial values
            for _, holders in params:
                for owner, name in holders:  # two of them for a tied weight
                    del owner._parameters[name]  # the wrapper owns it now; the stage hands a view back
                    setattr(owner, name, None)
            self.setup(unit, flat32)
            self.units.append(unit)
        check_something_to_train(self.units)
        self.frozen = [p for p in module.parameters() if not p.requires_grad]  # left in their modules, whole
        for p in self.frozen:  # one copy per rank, the same on all, in the dtype the computation runs in
            if p.is_floating_point():
                p.data = p.data.to(compute_dtype)
            dist.broadcast(p.data, group=group, group_src=0)
        self.shards = nn.ParameterList(u.shard for u in self.units)  # (S,) fp32 master weights of this rank
        if self.stage < 3:  # (N·S,) the persistent full parameters, registered so that .parameters() has them
            self.flats = nn.ParameterList(u.flat for u in self.units)
        self.optimizer = optimizer_class(list(self.shards), **optimizer_kwargs)
        for unit in self.units:  # every call of a unit's module goes through the stage's unit_forward
            unit.module.forward = functools.partial(self.unit_forward, unit, unit.module.forward)
        record_versions(self.units)

    def setup(self, unit: FlatShard, flat32: torch.Tensor) -> None:
        raise NotImplementedError  # each stage: which buffers the unit keeps

    def unit_forward(self, unit: FlatShard, forward, *args, **kwargs):
        raise NotImplementedError  # each stage: what happens around one unit's forward

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def master_shard(self, unit: FlatShard, flat32: torch.Tensor) -> nn.Parameter:
        """(S,) fp32 master weights of this rank: its elements of ``flat32``.

        When the stage keeps an fp32 full copy (stages 1 and 2 in fp32) the shard is a slice of it, not a
        second copy; with ``host`` (ZeRO-Offload) it lives in host memory, pinned when the device is a GPU.
        """
        if self.host is not None:
            shard = unit.mine(flat32).to(self.host)
            return nn.Parameter(shard.pin_memory() if unit.device.type == "cuda" else shard.clone())
        if unit.flat is not None and unit.flat.dtype == torch.float32:
            return nn.Parameter(unit.mine(unit.flat.data))
        return nn.Parameter(unit.mine(flat32).clone())

    def clip_and_step(self) -> float:
        """Clip by the global gradient norm, then step the optimizer over the shards; return the norm.

        The global norm is the square root of the sum, over every rank, of its shards' squared norms.
        """
        squares = torch.stack([u.shard.grad.float().pow(2).sum() for u in self.units]).sum()
        squares = squares.to(self.units[0].device)  # (collectives run on the compute device)
        dist.all_reduce(squares, group=self.group)
        norm = squares.sqrt().to(self.units[0].shard.device)
        if self.max_grad_norm is not None:  # as torch.nn.utils.clip_grad_norm_
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            for unit in self.units:
                unit.shard.grad.mul_(coef)
        self.optimizer.step()
        return norm.item()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, full and fp32, by its name(s) in the wrapped module (a collective: all ranks call it).

        A tied weight appears under each of its names, as in ``module.state_dict()``.
        """
        names = {id(m): n for n, m in self.module.named_modules()}
        out = {}
        for unit in self.units:
            flat = torch.empty(unit.world * unit.shard_size, dtype=torch.float32, device=unit.device)
            unit.all_gather(unit.shard, out=flat)
            for owner, name, view in unit.views(flat):
                prefix = names[id(owner)]
                out[f"{prefix}.{name}" if prefix else name] = view.clone()
        for name, p in self.module.named_parameters(remove_duplicate=False):  # what is left: the frozen ones
            out[name] = p.detach().float().clone()
        return out
