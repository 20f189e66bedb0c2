"""The flat shard that every ZeRO stage is built on (``zero.py``): one unit's parameters as one buffer.

The parameters of a unit (a layer, say) are concatenated into one flat buffer of Ψ_u elements and
padded with zeros to N·S, S = ceil(Ψ_u / N), so that any sizes split evenly; rank r owns elements
[r·S, (r+1)·S) of it (DeepSpeed's stages 1 and 2 and FSDP1's ``FlatParameter`` pad the same way;
DeepSpeed's stage 3 instead partitions each parameter on its own, ceil(numel / N) elements per rank;
FSDP2's ``fully_shard`` chunks each parameter on its dim 0, padding that dim to a multiple of N; and
``ZeroRedundancyOptimizer`` does not split tensors at all: it gives each rank whole parameters)::

    flat   (N·S,)  | rank 0's shard | rank 1's shard | ... | rank N-1's shard, ending in the padding |
    shard  (S,)    this rank's slice, fp32: the master weights its optimizer steps

Two collectives move it, and they are each other's transpose: ``all_gather`` turns every rank's (S,)
shard into the (N·S,) buffer, and ``reduce_scatter`` turns every rank's (N·S,) gradient into the
average of this rank's (S,) slice. ``hand_out`` gives each submodule that held a parameter a view of
its elements in a flat buffer, so that the module computes with the buffer's values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .compat import all_gather_single, reduce_scatter_single

__all__ = ["FlatShard", "Holders"]

Holders = list[tuple[nn.Module, str]]  # every (submodule, attribute name) under which one parameter is held


class FlatShard:
    """One unit: ``module`` and its trainable ``params``, each with its holders, as a flat buffer and a shard.

    The stage decides which buffers exist: ``flat`` (N·S,) the full parameters in the compute dtype,
    kept by stages 1 and 2, gathered only while needed by stage 3; ``shard`` (S,) the fp32 master weights.
    """

    def __init__(self, module: nn.Module, params: list[tuple[nn.Parameter, Holders]], group: dist.ProcessGroup | None):
        self.module, self.group = module, group
        self.holders = [holders for _, holders in params]  # per parameter: (owner, name), two for a tied weight
        self.shapes = [p.shape for p, _ in params]
        self.sizes = [p.numel() for p, _ in params]
        self.device = params[0][0].device  # where compute and collectives run
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.numel = sum(self.sizes)  # Ψ_u
        self.shard_size = -(-self.numel // self.world)  # S = ceil(Ψ_u / N)
        self.padding = self.world * self.shard_size - self.numel
        self.flat: torch.Tensor | None = None  # (N·S,) full parameters, compute dtype
        self.shard: nn.Parameter | None = None  # (S,) fp32 master weights of this rank
        self.pending = None  # stage 3: (flat, work) of an all-gather started ahead of time

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One tensor per parameter -> (N·S,): concatenated, then padded with zeros."""
        pad = tensors[0].new_zeros(self.padding)
        return torch.cat([t.reshape(-1) for t in tensors] + [pad])

    def mine(self, flat: torch.Tensor) -> torch.Tensor:
        """(N·S,) -> (S,): this rank's elements [r·S, (r+1)·S), a view."""
        return flat[self.rank * self.shard_size : (self.rank + 1) * self.shard_size]

    def views(self, flat: torch.Tensor) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """(N·S,) -> ``(owner, name, view)`` for each holder of each parameter, shaped as the parameter."""
        pieces = flat.split(self.sizes + [self.padding])
        return [(o, n, piece.view(shape)) for hs, shape, piece in zip(self.holders, self.shapes, pieces) for o, n in hs]

    def hand_out(self, flat: torch.Tensor | None) -> None:
        """Set each parameter's attribute to its view of ``flat``; ``None`` takes the views back."""
        if flat is None:
            for holders in self.holders:
                for owner, name in holders:
                    setattr(owner, name, None)
        else:
            for owner, name, view in self.views(flat):
                setattr(owner, name, view)

    def all_gather(self, shard: torch.Tensor, out: torch.Tensor, async_op: bool = False):
        """Every rank's (S,) ``shard`` -> ``out`` (N·S,), rank r's at [r·S, (r+1)·S); sends S·(N-1) elements."""
        return all_gather_single(out, shard.detach().to(out.device, out.dtype), group=self.group, async_op=async_op)

    def reduce_scatter(self, grad_flat: torch.Tensor) -> torch.Tensor:
        """(N·S,) this rank's gradient -> (S,) fp32 average over the ranks of this rank's slice.

        Reduced in fp32 so that the sum is the same in every dtype; the result goes where the shard lives
        (the host, when the optimizer is offloaded).
        """
        grad = torch.empty(self.shard_size, dtype=torch.float32, device=grad_flat.device)
        reduce_scatter_single(grad, grad_flat.float().contiguous(), group=self.group)
        return grad.div_(self.world).to(self.shard.device)
