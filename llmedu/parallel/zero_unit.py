"""One unit of ZeRO (``zero.py``): the parameters of one module as one flat buffer, sharded across ranks.

The parameters of a unit are flattened into one buffer of Ψ_u elements, padded with zeros to N·S,
S = ceil(Ψ_u / N), so that any sizes work; rank r owns elements [r·S, (r+1)·S) of it::

    flat   (N·S,)  | rank 0's shard | rank 1's shard | ... | rank N-1's shard, ending in the padding |
    shard  (S,)    this rank's slice, fp32: the master weights its optimizer steps

A ``ZeROUnit`` holds that state and the collectives that move it: ``full()`` all-gathers the shards
into the full buffer (stage 3, just before the unit is used), ``release()`` drops it, and
``reduce_scatter()`` turns this rank's gradient of the full buffer into the average of its shard.

Which unit owns which parameter is ``assign_parameters``: each trainable parameter exactly once,
even when two submodules hold it (tied weights), and frozen ones not at all. Which modules form
units, and when a unit's parameters are gathered and handed to its submodules, is ``ZeRO``'s business.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .compat import all_gather_single, reduce_scatter_single

__all__ = ["ZeROUnit", "assign_parameters"]

Holders = list[tuple[nn.Module, str]]  # every (submodule, attribute name) under which one parameter is held


def assign_parameters(modules: list[nn.Module]) -> list[list[tuple[nn.Parameter, Holders]]]:
    """For each of ``modules`` (the units, the root last): the trainable parameters it owns, with their holders.

    A parameter goes to the first module whose subtree contains *every* holder of it. Untied, that
    is the first unit that holds it; tied across units (GPT-2's output head shares the embedding
    matrix), a unit above both uses, the root at worst, which is gathered around every use (stage 3).
    Either way it is stored, gathered, reduced and stepped once, and autograd sums the gradients of
    its uses, because each holder is handed a view of the same buffer. Frozen parameters
    (``requires_grad=False``) are assigned to no unit: ``ZeRO`` leaves them in their modules.
    """
    owners = {id(o): o for m in modules for o in m.modules()}.values()  # each submodule once
    holders: dict[int, Holders] = {}
    for owner in owners:
        for name, p in owner._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((owner, name))
    taken: set[int] = set()
    assignment = []
    for module in modules:
        inside = {id(m) for m in module.modules()}
        mine = []
        for owner in module.modules():
            for p in owner._parameters.values():
                if p is None or not p.requires_grad or id(p) in taken:
                    continue
                if all(id(holder) in inside for holder, _ in holders[id(p)]):
                    taken.add(id(p))
                    mine.append((p, holders[id(p)]))
        assignment.append(mine)
    return assignment


class ZeROUnit:
    """The parameters of ``module`` as one flat buffer and this rank's shard.

    ``params`` are ``(parameter, holders)``, as ``assign_parameters`` gives them: the holders are the
    submodules that had the parameter and under what name, so that a view of the flat buffer can be
    handed back to each (two holders of a tied weight get views of the same elements). ``stage``
    (1, 2 or 3) decides what is kept: stages 1 and 2 a persistent full copy in ``compute_dtype``,
    stage 3 only the shard.
    ``host`` (ZeRO-Offload) puts the fp32 master shard in host memory, pinned when it comes from a GPU.
    """

    def __init__(
        self,
        module: nn.Module,
        params: list[tuple[torch.Tensor, Holders]],
        *,
        stage: int,
        compute_dtype: torch.dtype,
        group: dist.ProcessGroup | None,
        host: torch.device | None,
    ):
        tensors = [p for p, _ in params]
        self.module, self.stage = module, stage
        self.holders = [holders for _, holders in params]  # per parameter: every (owner, name) that holds it
        self.attributes = [pair for holders in self.holders for pair in holders]  # all of them, flat
        self.shapes = [p.shape for p in tensors]
        self.device = tensors[0].device if tensors else torch.device("cpu")  # where compute and collectives run
        self.dtype, self.group = compute_dtype, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.numel = sum(self.sizes)
        self.shard_size = -(-self.numel // self.world)  # S = ceil(Ψ_unit / N)
        self.padding = self.shard_size * self.world - self.numel
        pad = torch.zeros(self.padding, device=self.device)
        flat32 = torch.cat([t.detach().reshape(-1).float() for t in tensors] + [pad])  # (N·S,)

        # stages 1, 2: (N·S,) persistent full copy in the compute dtype; stage 1 keeps its full .grad
        self.flat: nn.Parameter | None = None
        if stage < 3:
            self.flat = nn.Parameter(flat32.to(compute_dtype), requires_grad=stage == 1)
        # (S,) fp32 master weights of this rank: what the optimizer steps
        if host is not None:  # ZeRO-Offload: in (pinned) host memory
            shard = self.own(flat32).to(host)
            self.shard = nn.Parameter(shard.pin_memory() if self.device.type == "cuda" else shard.clone())
        elif self.flat is not None and compute_dtype == torch.float32:
            self.shard = nn.Parameter(self.own(self.flat.data))  # fp32: the master shard *is* a slice of it
        else:
            self.shard = nn.Parameter(self.own(flat32).clone())
        # stages 2, 3: a persistent (S,) gradient that backward's reduce-scatter adds into
        self.shard.grad = torch.zeros_like(self.shard) if stage >= 2 else None

        self.gathered: torch.Tensor | None = None  # stage 3: the full flat buffer while it is needed
        self.pending = None  # stage 3: (work, buffer) of an all-gather started ahead of time
        self.saved_hooks = None  # stage 3: autograd's saved-tensor hooks, active during the unit's forward
        self.version = self.versions_now()  # the in-place versions after the last legitimate change

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a (N·S,) buffer."""
        return flat[self.rank * self.shard_size : (self.rank + 1) * self.shard_size]

    def views(self, flat: torch.Tensor) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """(N·S,) buffer -> ``(owner, name, view)`` for each holder of each parameter, shaped as the parameter."""
        pieces = flat.split(self.sizes + [self.padding])
        return [
            (owner, name, piece.view(shape))
            for holders, shape, piece in zip(self.holders, self.shapes, pieces)
            for owner, name in holders
        ]

    # -- catching changes made behind the wrapper's back --------------------------------------------
    def versions_now(self) -> tuple[int, ...]:
        """Autograd's in-place counters of the shard (and of the full copy): they move on any write."""
        return (self.shard._version,) + ((self.flat._version,) if self.flat is not None else ())

    def record_versions(self) -> None:
        self.version = self.versions_now()

    # -- stage 3: the full parameters exist only while they are used ---------------------------
    def start_gather(self) -> None:
        if self.gathered is None and self.pending is None:
            flat = torch.empty(self.world * self.shard_size, dtype=self.dtype, device=self.device)
            work = all_gather_single(flat, self.shard.detach().to(self.dtype), group=self.group, async_op=True)
            self.pending = (work, flat)

    def full(self) -> torch.Tensor:
        """(N·S,) full parameters in the compute dtype, gathered once and kept until released."""
        if self.gathered is None:
            self.start_gather()
            work, self.gathered = self.pending
            work.wait()
            self.pending = None
        return self.gathered

    def release(self) -> None:
        if self.pending is not None:  # a prefetch nobody used: finish it before dropping it
            self.pending[0].wait()
            self.pending = None
        self.gathered = None

    def hook_saved_tensors(self, pack, unpack) -> None:
        """From now on autograd saves ``pack(tensor)`` and gets back ``unpack(packed)`` in backward."""
        self.saved_hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self.saved_hooks.__enter__()

    def unhook_saved_tensors(self) -> None:
        if self.saved_hooks is not None:
            self.saved_hooks.__exit__(None, None, None)
            self.saved_hooks = None

    # -- gradients ----------------------------------------------------------------------------------
    def reduce_scatter(self, grad_flat: torch.Tensor) -> torch.Tensor:
        """(N·S,) gradient of this rank's micro-batch -> (S,) fp32 average over ranks of its shard.

        The result goes where the shard lives: to the host when the optimizer is offloaded.
        """
        shard = torch.empty(self.shard_size, dtype=torch.float32, device=grad_flat.device)
        reduce_scatter_single(shard, grad_flat.float().contiguous(), group=self.group)
        return shard.div_(self.world).to(self.shard.device)
