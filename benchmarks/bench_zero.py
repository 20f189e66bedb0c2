"""DDP against ZeRO-1, 2, 3 and ZeRO-Offload: step time, per-rank memory and bytes sent, one run.

    python benchmarks/bench_zero.py                       # 2 and 4 ranks, a 4-layer transformer
    python benchmarks/bench_zero.py --ranks 2 --layers 8 --d-model 256 --steps 10

Every rank trains the same transformer (fp32, AdamW, untied embeddings) on its own batch. For each
wrapper: a warm-up step, then ``--steps`` timed steps (the slowest rank's time per step, median);
the second step is measured with ``MemoryTracker`` (model states = parameters + gradients +
optimizer state, and the peak of everything); bytes sent per rank per step are counted by wrapping
the three collectives with the ring convention (all-reduce 2(N-1)/N of the buffer, all-gather and
reduce-scatter (N-1)/N of the full buffer). The claims checked, from the paper (§7): ZeRO-1 and 2
send what DDP sends; ZeRO-3 sends 1.5x; each stage's model states are within 10% of its formula.
The last line is the whole table as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from llmedu.parallel import launch

WRAPPERS = ("ddp", "zero1", "zero2", "zero3", "offload")


def count_bytes_sent() -> dict[str, int]:
    """Wrap dist.all_reduce and the whole-tensor all-gather and reduce-scatter (under this torch's names:
    llmedu.parallel.compat) to count bytes sent per rank."""
    from llmedu.parallel.compat import ALL_GATHER, REDUCE_SCATTER

    sent = {"bytes": 0}
    world = dist.get_world_size()
    originals = {n: getattr(dist, n) for n in ("all_reduce", ALL_GATHER, REDUCE_SCATTER)}

    def wrap(name, full_arg):
        def counted(*args, **kwargs):
            full = args[full_arg]  # all-reduce: the buffer; all-gather: the output; reduce-scatter: the input
            factor = 2 if name == "all_reduce" else 1
            sent["bytes"] += factor * (world - 1) * full.numel() * full.element_size() // world
            return originals[name](*args, **kwargs)

        return counted

    for name, full_arg in (("all_reduce", 0), (ALL_GATHER, 0), (REDUCE_SCATTER, 1)):
        setattr(dist, name, wrap(name, full_arg))
    return sent


def worker(d_model: int, layers: int, steps: int) -> dict:
    from llmedu.memory import MemoryTracker
    from llmedu.models.config import TransformerConfig
    from llmedu.models.gpt import CausalLM
    from llmedu.parallel.data_parallel import DDP
    from llmedu.parallel.offload import ZeROOffload
    from llmedu.parallel.zero import ZeRO

    rank = dist.get_rank()
    sent = count_bytes_sent()
    config = TransformerConfig(vocab_size=256, d_model=d_model, n_layers=layers, n_heads=4, tie_embeddings=False)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (4, 65), generator=g)  # (B, T + 1): this rank's batch
    results = {}
    for name in WRAPPERS:
        torch.manual_seed(0)
        model = CausalLM(config)
        n = sum(p.numel() for p in model.parameters())
        if name == "ddp":
            wrapped = DDP(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            tracked, tracked_opt = model, opt
        else:
            wrapped = ZeROOffload(model, lr=1e-3) if name == "offload" else ZeRO(model, int(name[-1]), lr=1e-3)
            tracked, tracked_opt = wrapped, wrapped.optimizer

        def step():
            logits = wrapped(tokens[:, :-1])  # (B, T, V)
            nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            if name == "ddp":
                wrapped.finish_gradient_sync()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                wrapped.step()
                wrapped.zero_grad()

        step()  # warm-up; creates the optimizer state
        tracker = MemoryTracker(tracked, tracked_opt)
        before = sent["bytes"]
        with tracker:
            step()
        bytes_per_step = sent["bytes"] - before
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is over when its slowest rank is
            times.append(elapsed.item())
        results[name] = {
            "params": n,
            "step_ms": 1e3 * statistics.median(times),
            "model_states_bytes": tracker.max_bytes("parameters", "gradients", "optimizer"),
            "peak_bytes": tracker.peak_bytes,
            "sent_bytes": bytes_per_step,
        }
    return results


def formula(name: str, n: int, world: int) -> float:
    """fp32 AdamW model states per rank (4Ψ weights, 4Ψ gradients, 8Ψ moments), ZeRO §5.2;
    offload: the device's share only in a real GPU run; here host and device are the same RAM."""
    return {
        "ddp": 16 * n,
        "zero1": 8 * n + 8 * n / world,
        "zero2": 4 * n + 12 * n / world,
        "zero3": 16 * n / world,
        "offload": 2 * n + 16 * n / world,  # bf16 weights 2Ψ + fp32 master, gradient shard, moments
    }[name]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    rows, ok = [], True
    print(
        f"{'ranks':>5} {'wrapper':>8} {'step ms':>8} {'states MiB':>10} {'formula':>8} {'peak MiB':>9} "
        f"{'sent MiB':>9} {'x DDP':>6}"
    )
    for world in args.ranks:
        per_rank = launch(worker, world, args.d_model, args.layers, args.steps, echo=False, timeout=300)
        r0 = per_rank[0]
        for name in WRAPPERS:
            m = r0[name]
            expected = formula(name, m["params"], world)
            ratio = m["sent_bytes"] / r0["ddp"]["sent_bytes"]
            row = {"ranks": world, "wrapper": name, **m, "formula_bytes": expected, "sent_vs_ddp": ratio}
            rows.append(row)
            mib = {k: m[k] / 2**20 for k in ("model_states_bytes", "peak_bytes", "sent_bytes")}
            print(
                f"{world:>5} {name:>8} {m['step_ms']:>8.1f} {mib['model_states_bytes']:>10.2f} {expected / 2**20:>8.2f} "
                f"{mib['peak_bytes']:>9.2f} {mib['sent_bytes']:>9.2f} {ratio:>6.2f}"
            )
            if name != "offload" and abs(m["model_states_bytes"] / expected - 1) > 0.10:
                ok = False
                print(f"  claim failed: {name} model states not within 10% of the formula")
        for name, want in (("zero1", 1.0), ("zero2", 1.0), ("zero3", 1.5)):
            got = r0[name]["sent_bytes"] / r0["ddp"]["sent_bytes"]
            if abs(got / want - 1) > 0.05:
                ok = False
                print(f"  claim failed: {name} sends {got:.2f}x DDP, the paper says {want}x")
    print(json.dumps({"benchmark": "zero", "claims_hold": ok, "rows": rows}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
