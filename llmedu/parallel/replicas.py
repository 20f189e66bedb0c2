"""Do the ranks hold the same weights? A check at construction, before anything is split or replicated.

Tensor, sequence and expert parallelism split a full model that every rank builds for itself (same
seed, or the same checkpoint): rank r keeps its shard of each split weight, and a full copy of each
replicated one (norms, biases, a router). If one rank's weights came from another seed, nothing fails:
the shards belong to different matrices and the outputs are simply wrong. torch's DDP guards against
the same mistake at construction (it checks the ranks' parameter shapes, then broadcasts rank 0's
values); here nothing is broadcast, so the values themselves are compared.

``check_replicas_agree`` gives each tensor a checksum: its bytes, each times a weight that depends on
its position, summed in int64. Integer sums wrap around but are exact, so the checksum does not depend
on the order of the additions (threads, devices) and two ranks agree exactly when they should. Two
all-reduces (the number of tensors; then MAX of [c, n, -c, -n]: the largest and smallest checksum and
size of every tensor) tell every rank the same thing, so all of them raise together, naming the first
tensor that differs (in size first, then in values).

Left out: bytes that differ and still collide in the checksum (a deliberate forgery would get through),
and telling which rank is the odd one out (an all-gather of the checksums would say).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["check_replicas_agree", "checksum"]

_PRIME = 65_521  # position weights 1 .. 65521, so that swapped bytes change the sum


def checksum(t: torch.Tensor) -> int:
    """An int64 checksum of the bytes of ``t``, exact and independent of the order of summation."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)  # (bytes,)
    weights = torch.arange(data.numel(), device=data.device, dtype=torch.int64) % _PRIME + 1
    return int((data * weights).sum())


def check_replicas_agree(modules: dict[str, nn.Module], group=None, what: str = "the model") -> None:
    """Raise on every rank of ``group`` unless all of them hold the same tensors in ``modules``.

    ``modules``: name prefix -> module (its parameters and buffers, in order). ``what`` names the
    wrapper in the message. Every rank of ``group`` must call it, with modules of the same structure.
    """
    named = [
        (f"{prefix}.{name}" if prefix else name, t)
        for prefix, module in modules.items()
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    ]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    count = torch.tensor([len(named), -len(named)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)  # [most tensors, -fewest tensors]
    if count[0] != -count[1]:
        raise RuntimeError(
            f"{what}: the ranks hold different models ({-int(count[1])} to {int(count[0])} tensors); "
            "build the same model on every rank before splitting it"
        )
    k = len(named)
    mine = torch.tensor([[checksum(t), t.numel()] for _, t in named], dtype=torch.int64, device=device).reshape(-1, 2)
    both = torch.cat([mine, -mine], dim=1)  # (K, 4): checksum, size, and their negatives
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)  # every rank: the largest and the smallest
    largest, smallest = both[:, :2], -both[:, 2:]  # (K, 2) each
    for column, kind in ((1, "size"), (0, "values")):
        differs = (largest[:, column] != smallest[:, column]).nonzero().flatten().tolist()
        if not differs:
            continue
        name, t = named[differs[0]]
        if kind == "size":
            raise RuntimeError(
                f"{what}: the ranks hold different models: {name} has {int(smallest[differs[0], 1])} to "
                f"{int(largest[differs[0], 1])} elements; build the same model on every rank before splitting it"
            )
        raise RuntimeError(
            f"{what}: {name} {tuple(t.shape)} differs across the ranks ({len(differs)} of {k} tensors do); "
            "every rank must build the model from the same weights: seed every rank alike before building it "
            "(torch.manual_seed), or load the same checkpoint"
        )
