"""ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", §4).

Mixed-precision Adam keeps (2 + 2 + K)Ψ bytes of model states, and K = 12 of them (fp32 master
weights, momentum, variance) are touched only by the optimizer step, which does O(Ψ) work against
the O(Ψ · tokens) of forward and backward. ZeRO-Offload moves exactly those to the host (CPU
memory and CPU cores), on top of ZeRO-2 so that each of N ranks offloads only its 1/N:

    device (GPU)   bf16 parameters 2Ψ, and each unit's bf16 gradient while it is reduce-scattered
    host (CPU)     fp32 master shard 4Ψ/N, fp32 gradient shard 4Ψ/N, Adam moments 8Ψ/N; the step

One step: forward and backward on the device; each unit's gradient is reduce-scattered (stage 2)
and its shard copied to the host (§4.1, "g16 -> CPU"); the host runs AdamW on its shard; the
updated shard is cast to bf16 and copied back, and an all-gather rebuilds the full parameters.

The code is ``ZeRO2`` with ``host=...`` (``zero.py``): ``ZeROBase.master_shard`` puts each unit's
master shard on the host, and its gradient and AdamW's moments follow it there; this file names the
configuration and says where every byte is (``placement()``). On a
CUDA machine the host tensors are pinned CPU memory and the copies really cross PCIe. On a
CPU-only machine "device" and "host" are the same RAM: the split is then a budget accounted from
the tensors each side owns, which is what ``placement()`` reports, and what the lesson plots.

Left out: the one-step delayed parameter update (DPU) that overlaps the CPU step with the
next step's GPU work; the SIMD CPU-Adam (we run ``torch.optim.AdamW`` on the CPU); NVMe offload
(ZeRO-Infinity); offloading parameters (stage 3 offload). The production code is DeepSpeed's
``offload_optimizer`` with ``DeepSpeedCPUAdam``.
"""

from __future__ import annotations

import torch
from torch import nn

from .zero import ZeRO2

__all__ = ["ZeROOffload"]


class ZeROOffload(ZeRO2):
    """ZeRO-2 with the fp32 master shards, their gradients and the optimizer on ``host``.

    ``compute_dtype`` (default bf16) is what the device holds; everything else as ``zero.ZeRO``.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer_class: type = torch.optim.AdamW,
        *,
        compute_dtype: torch.dtype = torch.bfloat16,
        host: torch.device | str = "cpu",
        **kwargs,
    ):
        if torch.device(host).type != "cpu":
            raise ValueError(f"host must be a CPU device (the host's memory), got {host!r}")
        super().__init__(module, optimizer_class, compute_dtype=compute_dtype, host=host, **kwargs)

    def host_traffic(self) -> dict[str, int]:
        """Bytes each rank copies between device and host per step (a count, from the shards' sizes).

        Down: the fp32 gradient shard that the reduce-scatter produced (DeepSpeed sends it in fp16,
        half of this). Up: the updated shard in the compute dtype, from which the all-gather rebuilds
        the full parameters. On a GPU both cross PCIe; on this CPU-only machine they are copies in RAM.
        """
        shards = sum(u.shard_size for u in self.units)
        return {"to host": 4 * shards, "to device": self.dtype.itemsize * shards}

    def placement(self) -> dict[str, dict[str, int]]:
        """Bytes of model state on each side during a step: {"device": {...}, "host": {...}}.

        Counted from the tensors themselves (each storage once), not from a formula, except the host's
        fp32 gradient shards: they exist from the first backward after ``zero_grad()`` to the step, so
        between steps they are counted from their size (4 bytes x S per unit). Device gradients exist
        only transiently, one unit at a time, during backward: they are not here. Frozen parameters
        (LoRA's base weights) are device parameters, whole in the compute dtype.
        """
        seen: set[int] = set()

        def nbytes(tensors) -> int:
            total = 0
            for t in tensors:
                key = t.untyped_storage().data_ptr()
                if t.numel() and key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
            return total

        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {
            "device": {"parameters": nbytes([*(u.flat for u in self.units), *self.frozen])},  # frozen: whole
            "host": {
                "master weights": nbytes(u.shard for u in self.units),
                "gradients": sum(
                    4 * u.shard_size if u.shard.grad is None else nbytes([u.shard.grad]) for u in self.units
                ),
                "optimizer": nbytes(state),
            },
        }
