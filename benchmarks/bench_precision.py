"""Is bf16 "2-3x faster and half the memory"? fp32 vs bf16 on the same model, in the same run.

    python benchmarks/bench_precision.py                  # sizes for this machine (smaller with LLMEDU_FAST=1)
    python benchmarks/bench_precision.py --d-model 1024 --layers 8 --seq 1024 --batch 8   # a GPU

Three ways to train our GPT with AdamW, one training step each (forward, backward, update):

    fp32            everything in fp32
    bf16 autocast   fp32 weights, gradients and optimizer state; matmuls in bf16 (the practical path)
    bf16 weights    bf16 model, fp32 master weights in the optimizer (llmedu.train.MasterWeights)

Throughput: the repeats of the three modes are interleaved, so that a slow moment of a shared
machine hurts all of them alike; tokens/s of the fastest (min time) and the median repeat. Memory: the peak of one
step after a warm-up step (so that Adam's state exists), measured by llmedu.memory.MemoryTracker on
any device, and by torch.cuda.max_memory_allocated on CUDA. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llmedu import runtime
from llmedu.memory import MemoryTracker
from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.train import MasterWeights

MODES = ("fp32", "bf16 autocast", "bf16 weights")


def build(mode: str, config: TransformerConfig, dev: torch.device):
    """The model, and one training step as a function of the batch."""
    runtime.seed_everything(0)
    model = CausalLM(config).to(dev)
    masters = MasterWeights(model, torch.bfloat16) if mode == "bf16 weights" else None
    opt = torch.optim.AdamW(masters.params if masters else model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mode == "bf16 autocast"):
            loss = lm_loss(model(ids), ids)
        loss.backward()
        if masters:
            masters.grads_to_master()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters:
            masters.master_to_model()

    return model, opt, step


def main(argv=None) -> dict:
    small = runtime.FAST
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=128 if small else 384)
    parser.add_argument("--layers", type=int, default=2 if small else 6)
    parser.add_argument("--heads", type=int, default=4 if small else 6)
    parser.add_argument("--seq", type=int, default=128 if small else 256)
    parser.add_argument("--batch", type=int, default=4 if small else 8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3 if small else 7)
    parser.add_argument("--steps", type=int, default=2 if small else 3, help="training steps per timed repeat")
    args = parser.parse_args(argv)

    dev = runtime.device()
    config = TransformerConfig.gpt2(
        vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq
    )
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(
        dev
    )  # (B, T)
    built = {mode: build(mode, config, dev) for mode in MODES}
    n_params = sum(p.numel() for p in built["fp32"][0].parameters())
    print(
        f"device {dev}, {torch.get_num_threads()} threads, torch {torch.__version__}, GPT with {n_params / 1e6:.1f}M parameters, batch {args.batch} x {args.seq} tokens"
    )

    results = {}
    for mode, (model, opt, step) in built.items():
        step(ids)  # warm-up: Adam's state now exists, kernels are chosen
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with MemoryTracker(model, opt) as tracker:
            step(ids)
        results[mode] = {
            "peak_bytes": tracker.peak_bytes,
            "peak_by_category": tracker.peak_by_category(),
            "tokens_per_s": [],
        }
        if dev.type == "cuda":
            results[mode]["cuda_max_allocated"] = torch.cuda.max_memory_allocated()

    for _ in range(args.repeats):  # interleaved: every mode sees the same moments of the machine
        for mode, (_, _, step) in built.items():
            runtime.synchronize(dev)
            start = time.perf_counter()
            for _ in range(args.steps):
                step(ids)
            runtime.synchronize(dev)
            results[mode]["tokens_per_s"].append(args.steps * ids.numel() / (time.perf_counter() - start))

    base = results["fp32"]
    print(f"\n{'mode':<15}{'tokens/s best':>14}{'median':>10}{'peak MiB':>10}{'speed-up':>10}{'memory':>9}")
    for mode, r in results.items():
        r["best"], r["median"] = max(r["tokens_per_s"]), statistics.median(r["tokens_per_s"])  # best = min time
        r["speedup"] = r["median"] / statistics.median(base["tokens_per_s"])
        r["memory_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        print(
            f"{mode:<15}{r['best']:>14,.0f}{r['median']:>10,.0f}{r['peak_bytes'] / 2**20:>10.1f}{r['speedup']:>9.2f}x{r['memory_ratio']:>8.2f}x"
        )
    print("\npeak by category (MiB):")
    for mode, r in results.items():
        print(f"  {mode:<15}" + "  ".join(f"{k} {v / 2**20:.1f}" for k, v in r["peak_by_category"].items()))
    summary = {
        "benchmark": "precision",
        "device": str(dev),
        "torch": torch.__version__,
        "params": n_params,
        "config": vars(args),
        "results": {m: {k: v for k, v in r.items() if k != "peak_by_category"} for m, r in results.items()},
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
