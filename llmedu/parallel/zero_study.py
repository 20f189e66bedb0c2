"""The apparatus of lesson 15 around ``zero.py``: the check against one process and torch's peers, and
the measurement of memory and bytes per rank. Research code, kept apart from the algorithm.

``compare_with_peers``   a tiny MLP whose units do not divide by 2 trains 3 clipped steps of 2 micro-batches
                         with ZeRO-1/2/3, ``ZeroRedundancyOptimizer`` (under DDP) and FSDP2's ``fully_shard``;
                         every parameter after every step against AdamW on one process
``measure``              one GPT step per wrapper (our DDP, ZeRO-1/2/3, ZeRO-Offload), all fp32, under
                         ``MemoryTracker``: the model states (a count), the true peak (a measurement) and
                         the bytes each rank sends (counted from the collectives' sizes)

The production peers differ from ``zero.py`` in how they cut the model: ``ZeroRedundancyOptimizer`` gives
each rank whole parameters (no padding; under DDP the gradients are all-reduced in full, then each rank
broadcasts the parameters it stepped), FSDP2 chunks each parameter on dim 0. Both run with ``launch``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from .offload import ZeROOffload
from .zero import ZeRO

__all__ = ["Gated", "Tiny", "compare_with_peers", "count_bytes_sent", "measure", "fp32_formula", "WRAPPERS"]

STEPS, ACCUM, LR, CLIP = 3, 2, 1e-2, 0.05  # CLIP is below every step's gradient norm: every step clips
WRAPPERS = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "Offload")


class Gated(nn.Module):
    """A residual branch scaled by a learned gate: gate · GELU(W h + b)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.gate = nn.Parameter(torch.ones(1))

    def forward(self, h):  # (B, width) -> (B, width)
        return self.gate * nn.functional.gelu(self.linear(h))


class Tiny(nn.Module):
    """An MLP of gated residual layers: at width 6 a layer holds 6·6 + 6 + 1 = 43 parameters and the root
    (input and output layers) 36 + 21 = 57, so on 2 ranks every unit is padded."""

    def __init__(self, width: int = 6, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.layers = nn.ModuleList(Gated(width) for _ in range(depth))
        self.out = nn.Linear(width, 3)

    def forward(self, x):  # (B, 5) -> (B, 3)
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def _train(model, params, step, zero_grad, micro_batches, batches, sync=None):
    """STEPS steps of ACCUM micro-batches; per step the parameters (``params()``) and ``step()``'s return value."""
    states, norms = [], []
    for x, y in batches:
        for i, (xm, ym) in enumerate(zip(micro_batches(x), micro_batches(y))):
            loss = nn.functional.mse_loss(model(xm), ym) / ACCUM
            with sync() if sync is not None and i < ACCUM - 1 else torch.enable_grad():
                loss.backward()
        norms.append(float(step()))
        zero_grad()
        states.append({k: v.detach().clone() for k, v in params().items()})
    return states, norms


def compare_with_peers() -> dict:
    """Run on every rank (``launch``): max |parameter - one-process AdamW| after each step, per implementation.

    Returns {"diff": {name: [per step]}, "norm": {name: [gradient norm before clipping, per step]}, "units":
    [(Ψ_u, padding)] of our ZeRO}.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = Tiny()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8 * world, 5, generator=g), torch.randn(8 * world, 3, generator=g)) for _ in range(STEPS)]
    mine = lambda t: t.chunk(world)[rank].chunk(ACCUM)  # noqa: E731  this rank's micro-batches

    def clip_step(params, opt):
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP)  # the norm before clipping
        opt.step()
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    one = copy.deepcopy(base)
    opt = torch.optim.AdamW(one.parameters(), lr=LR)
    oracle = lambda: dict(one.named_parameters())  # noqa: E731
    runs = {"one process": _train(one, oracle, lambda: clip_step(one.parameters(), opt), opt.zero_grad,
                                  lambda t: t.chunk(ACCUM), batches)}  # fmt: skip
    for stage in (1, 2, 3):
        z = ZeRO(copy.deepcopy(base), stage, lr=LR, max_grad_norm=CLIP)
        runs[f"ZeRO-{stage}"] = _train(z, z.full_state_dict, z.step, z.zero_grad, mine, batches)
    units = [(u.numel, u.padding) for u in z.units]
    ddp = DistributedDataParallel(copy.deepcopy(base))
    zro = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    runs["ZeroRedundancyOptimizer"] = _train(ddp, lambda: dict(ddp.module.named_parameters()),
                                             lambda: clip_step(ddp.parameters(), zro), zro.zero_grad, mine, batches,
                                             ddp.no_sync)  # fmt: skip
    fsdp = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))  # the ranks' CPUs (its default is the GPUs, one per rank)
    for layer in fsdp.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fopt = torch.optim.AdamW(fsdp.parameters(), lr=LR)
    runs["FSDP2"] = _train(fsdp, lambda: {k: v.full_tensor() for k, v in fsdp.named_parameters()},
                           lambda: clip_step(fsdp.parameters(), fopt), fopt.zero_grad, mine, batches)  # fmt: skip
    want = runs.pop("one process")
    diff = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in b)  # noqa: E731
    table = {name: [diff(s, o) for s, o in zip(states, want[0])] for name, (states, _) in runs.items()}
    table["(distance moved from the start)"] = [diff(o, dict(base.named_parameters())) for o in want[0]]
    norms = {"one process": want[1], **{name: n for name, (_, n) in runs.items()}}
    return {"diff": table, "norm": norms, "units": units}


def count_bytes_sent() -> dict:
    """Wrap this process's all-reduce, all-gather and reduce-scatter so that they add what this rank sends.

    Ring convention: an all-reduce sends 2(N-1)/N of its buffer, an all-gather or reduce-scatter (N-1)/N of
    the full one. Returns the dict whose ``"bytes"`` grows.
    """
    from .compat import ALL_GATHER, REDUCE_SCATTER  # this torch's names of the two

    sent, world = {"bytes": 0}, dist.get_world_size()

    def counting(original, which: int, factor: int):
        def counted(*args, **kwargs):
            full = args[which]  # the full buffer: the input of a reduce-scatter, the output of an all-gather
            sent["bytes"] += factor * (world - 1) * full.numel() * full.element_size() // world
            return original(*args, **kwargs)

        return counted

    for name, which, factor in (("all_reduce", 0, 2), (ALL_GATHER, 0, 1), (REDUCE_SCATTER, 1, 1)):
        setattr(dist, name, counting(getattr(dist, name), which, factor))
    return sent


def _device_only(tracker, host_parameters: int) -> tuple[int, str, dict[str, int]]:
    """ZeRO-Offload's peak on the device: every sample less what lives on the host (master shards, their
    gradients, AdamW's moments). On this CPU-only machine both are the same RAM, so it is subtracted here
    (on a GPU the reduce-scatter's (S,) output is on the device until it is copied: one unit's shard)."""
    device = lambda s: s.total - s.by_category["optimizer"] - s.by_category["gradients"] - host_parameters  # noqa: E731
    peak = max(tracker.timeline, key=device)
    by = {**peak.by_category, "gradients": 0, "optimizer": 0}
    by["parameters"] -= host_parameters
    return device(peak), f"{peak.op} ({peak.phase})", by


def measure(d_model: int, layers: int) -> dict:
    """Run on every rank (``launch``): per wrapper, the second step of our GPT under ``MemoryTracker``."""
    from ..memory import MemoryTracker
    from ..models.config import TransformerConfig
    from ..models.gpt import CausalLM
    from .data_parallel import DDP

    sent = count_bytes_sent()
    config = TransformerConfig(vocab_size=256, d_model=d_model, n_layers=layers, n_heads=4, tie_embeddings=False)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(dist.get_rank()))  # (B, T + 1)
    out = {}
    for name in WRAPPERS:
        torch.manual_seed(0)
        model = CausalLM(config)
        if name == "DDP":
            wrapped = DDP(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            tracked = (model, opt)
        else:  # Offload computes in fp32 here too, so that its device bytes compare with the others'
            kw = dict(compute_dtype=torch.float32, lr=1e-3)
            wrapped = ZeROOffload(model, **kw) if name == "Offload" else ZeRO(model, int(name[-1]), **kw)
            tracked = (wrapped, wrapped.optimizer)

        def step():
            logits = wrapped(tokens[:, :-1])  # (B, T, V)
            nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            if name == "DDP":
                wrapped.finish_gradient_sync(), opt.step(), opt.zero_grad()
            else:
                wrapped.step(), wrapped.zero_grad()

        step()  # the optimizer state exists from here on
        before = sent["bytes"]
        with MemoryTracker(*tracked) as tracker:
            step()
        r = {
            "params": sum(p.numel() for p in model.parameters()) if name == "DDP" else out["DDP"]["params"],
            "states": {c: tracker.max_bytes(c) for c in ("parameters", "gradients", "optimizer")},
            "peak": tracker.peak_bytes,
            "peak_op": tracker.peak_op,
            "peak_by": tracker.peak_by_category(),
            "sent": sent["bytes"] - before,
        }
        if name == "Offload":
            r["placement"], r["traffic"] = wrapped.placement(), wrapped.host_traffic()
            r["peak"], r["peak_op"], r["peak_by"] = _device_only(tracker, r["placement"]["host"]["master weights"])
        out[name] = r
    return out


def fp32_formula(name: str, n: float, world: int) -> tuple[float, float]:
    """Model-state bytes per rank in fp32 (4Ψ weights, 4Ψ gradients, 8Ψ moments), as (device, host): only
    ZeRO-Offload has a host part (its fp32 master shard, gradient shard and moments, 16Ψ/N)."""
    return {
        "DDP": (16 * n, 0.0),
        "ZeRO-1": (8 * n + 8 * n / world, 0.0),
        "ZeRO-2": (4 * n + 12 * n / world, 0.0),
        "ZeRO-3": (16 * n / world, 0.0),
        "Offload": (4 * n, 16 * n / world),
    }[name]
