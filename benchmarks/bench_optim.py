"""What does an optimizer's state cost? torch's AdamW, ours, and 8-bit AdamW on the same model, in the same run.

    python benchmarks/bench_optim.py                      # sizes for this machine (smaller with LLMEDU_FAST=1)
    python benchmarks/bench_optim.py --d-model 1024 --layers 8 --steps 200   # a GPU

Three optimizers train the same GPT from the same initialisation on the same batch:

    torch AdamW     torch.optim.AdamW (the reference: ratios are against it)
    ours            llmedu.optim.AdamW (the same numbers in fp32, one tensor at a time)
    8-bit           llmedu.optim.AdamW8bit (Dettmers et al. 2022: block-wise 8-bit moments, block 2048)

Memory: bytes of every tensor in the optimizer's state after the first step, per parameter (8 for
fp32 Adam's m and v; ~2 for 8-bit). Step time: ``optimizer.step()`` alone (``--inner`` of them per
repeat), on fixed gradients; the repeats of the three are interleaved so that a slow moment of a
shared machine hurts all alike; min and median of the repeats. Loss: after ``--steps`` training
steps of each, and the largest gap to torch's loss curve. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llmedu import runtime
from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.optim import AdamW, AdamW8bit, state_bytes

OPTIMIZERS = {
    "torch AdamW": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "ours": lambda params, lr: AdamW(params, lr=lr),
    "8-bit": lambda params, lr: AdamW8bit(params, lr=lr),
}


def build(name: str, config: TransformerConfig, lr: float, dev: torch.device):
    runtime.seed_everything(0)
    model = CausalLM(config).to(dev)
    return model, OPTIMIZERS[name](model.parameters(), lr)


def main(argv=None) -> dict:
    small = runtime.FAST
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=128 if small else 256)
    parser.add_argument("--layers", type=int, default=2 if small else 4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64 if small else 128)
    parser.add_argument("--batch", type=int, default=4 if small else 8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats of each optimizer")
    parser.add_argument("--inner", type=int, default=3, help="optimizer steps per timed repeat")
    parser.add_argument("--steps", type=int, default=30 if small else 100, help="training steps for the loss")
    args = parser.parse_args(argv)

    dev = runtime.device()
    config = TransformerConfig.gpt2(
        vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(dev)  # (B, T)
    built = {name: build(name, config, args.lr, dev) for name in OPTIMIZERS}
    n_params = sum(p.numel() for p in built["ours"][0].parameters())
    print(
        f"device {dev}, {torch.get_num_threads()} threads, torch {torch.__version__}, GPT with "
        f"{n_params / 1e6:.2f}M parameters, batch {args.batch} x {args.seq} tokens"
    )

    results = {name: {"step_s": []} for name in OPTIMIZERS}
    for name, (model, opt) in built.items():
        lm_loss(model(ids), ids).backward()  # fixed gradients for the timed steps; the first step makes the state
        opt.step()
        results[name]["state_bytes_per_param"] = state_bytes(opt) / n_params
    for _ in range(args.repeats):  # interleaved: every optimizer sees the same moments of the machine
        for name, (_, opt) in built.items():
            runtime.synchronize(dev)
            start = time.perf_counter()
            for _ in range(args.inner):
                opt.step()
            runtime.synchronize(dev)
            results[name]["step_s"].append((time.perf_counter() - start) / args.inner)

    for name in OPTIMIZERS:  # a fresh run of --steps training steps from the same initialisation
        model, opt = build(name, config, args.lr, dev)
        losses = []
        for _ in range(args.steps):
            loss = lm_loss(model(ids), ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        results[name]["loss_first"], results[name]["loss_last"] = losses[0], losses[-1]
        results[name]["losses"] = losses

    base = results["torch AdamW"]
    print(
        f"\n{'optimizer':<13}{'state B/param':>14}{'memory':>8}{'step ms min':>13}{'median':>9}{'time':>8}"
        f"{f'loss @{args.steps}':>11}{'max |gap|':>11}"
    )
    for name, r in results.items():
        r["step_ms_min"], r["step_ms_median"] = 1e3 * min(r["step_s"]), 1e3 * statistics.median(r["step_s"])
        r["memory_ratio"] = r["state_bytes_per_param"] / base["state_bytes_per_param"]
        r["time_ratio"] = r["step_ms_median"] / (1e3 * statistics.median(base["step_s"]))
        r["max_loss_gap"] = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        print(
            f"{name:<13}{r['state_bytes_per_param']:>14.3f}{r['memory_ratio']:>7.2f}x{r['step_ms_min']:>13.2f}"
            f"{r['step_ms_median']:>9.2f}{r['time_ratio']:>7.2f}x{r['loss_last']:>11.4f}{r['max_loss_gap']:>11.4f}"
        )
    summary = {
        "benchmark": "optim",
        "device": str(dev),
        "torch": torch.__version__,
        "params": n_params,
        "config": vars(args),
        "results": {
            name: {k: round(v, 6) for k, v in r.items() if k not in ("step_s", "losses")} for name, r in results.items()
        },
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
