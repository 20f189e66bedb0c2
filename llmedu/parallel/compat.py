"""The whole-tensor collectives of ``torch.distributed`` under the names this PyTorch has.

PyTorch 2.13 named them ``all_gather_single`` and ``reduce_scatter_single`` (after ``all_to_all_single``)
and deprecated the older ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, the only names before it.
They do the same: every rank passes one flat tensor, not a list of pieces. The course supports PyTorch 2.5
and later (``pyproject.toml``), so ZeRO and sequence parallelism call them through here. Each call looks
the function up in ``torch.distributed`` when it runs, so that a test which wraps ``dist.<name>`` to count
messages sees these too.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["ALL_GATHER", "REDUCE_SCATTER", "all_gather_single", "reduce_scatter_single"]

ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_single(output, input, group=None, async_op=False):
    """output (N * S,) <- every rank's input (S,), in rank order."""
    return getattr(dist, ALL_GATHER)(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, group=None, async_op=False):
    """output (S,) <- this rank's S-slice of the sum over ranks of each rank's input (N * S,)."""
    return getattr(dist, REDUCE_SCATTER)(output, input, group=group, async_op=async_op)
