"""Does the crammed recipe buy speed and loss? Our crammed BERT vs transformers' BertForMaskedLM.

    python benchmarks/bench_cramming.py                 # sizes for this machine (tiny with LLMEDU_FAST=1)
    python -m llmedu.cramming bench --budget 2m   # the same, from the package's command line

1. Throughput: one training step (forward, MLM loss, backward, AdamW) of our crammed MaskedLM
   (pre-LN, no biases, GEGLU, sparse prediction, no dropout) against ``BertForMaskedLM`` of the same
   width, depth, heads, vocabulary and sequence length (post-LN, biases, GELU, dropout 0.1, the head
   over every position: the original recipe), both under bf16 autocast with fp32 weights. Attention:
   the recipe's (written out on a CPU, SDPA on a GPU); transformers' SDPA, which on a CPU takes
   torch's math path since dropout is on. The repeats alternate between the two models, so that a
   slow moment of a shared machine hurts both; tokens/s of the fastest and of the median repeat, the
   speed-up of the medians. MFU = FLOPs per token (``llmedu.models.counting``: 6N + 12LTd, where
   the crammed head's N counts only at the 15% masked positions it runs on) x tokens/s (median)
   over this machine's measured bf16 matmul FLOP/s (``llmedu.hardware``). Issue #11's targets: a
   speed-up >= 2.0x and MFU >= 35%.
2. Loss at a budget: ``pretrain`` with the crammed recipe and with the original one, the same
   wall-clock budget each, on the same data; the held-out MLM loss at the end.

The paper's claim this checks is in Geiping & Goldstein 2022, sec. 4 (their table 1 and fig. 2):
the tricks raise tokens/s and lower the loss reached in a fixed time. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM

from llmedu import runtime
from llmedu.cramming.pretrain import PretrainRun, mlm_flops_per_token, mlm_loss_fn, pretrain
from llmedu.cramming.recipe import CUDA_SHAPE, TINY_SHAPE, crammed, original_bert, parse_budget
from llmedu.data.packing import mask_tokens
from llmedu.hardware import measure_matmul_flops
from llmedu.models import MaskedLM
from llmedu.models.counting import flops_per_token, matmul_parameters


def hf_twin(recipe) -> BertForMaskedLM:
    """BertForMaskedLM at the recipe's shape, with BERT's own settings (the original recipe)."""
    shape = recipe.model
    config = BertConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.d_model,
        num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads,
        intermediate_size=4 * shape.d_model,
        max_position_embeddings=shape.max_seq_len,
        type_vocab_size=2,
        attn_implementation="sdpa",
    )
    return BertForMaskedLM(config)


def throughput(recipe, device, repeats: int) -> dict:
    runtime.seed_everything(0)
    vocab, seq_len = recipe.model.vocab_size, recipe.model.max_seq_len
    ids = torch.randint(5, vocab, (recipe.micro_batch, seq_len))  # (B, T)
    inputs, labels = mask_tokens(ids, 0.15, 4, vocab, [0, 1, 2, 3, 4], torch.Generator().manual_seed(0))
    batch = {"input_ids": inputs.to(device), "labels": labels.to(device)}
    ours, theirs = MaskedLM(recipe.model).to(device), hf_twin(recipe).to(device)
    ours_loss = mlm_loss_fn(sparse=True)

    def theirs_loss(model, b):
        logits = model(input_ids=b["input_ids"]).logits  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(), ignore_index=-100)

    steps = {}
    for name, model, loss_fn in (("crammed (ours)", ours, ours_loss), ("BertForMaskedLM", theirs, theirs_loss)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model.train()

        def step(model=model, loss_fn=loss_fn, optimizer=optimizer):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[name] = step
        step()  # warm-up: allocations, kernel choice, Adam's state
    times = {name: [] for name in steps}
    for _ in range(repeats):  # interleaved
        for name, step in steps.items():
            runtime.synchronize(device)
            start = time.perf_counter()
            step()
            runtime.synchronize(device)
            times[name].append(time.perf_counter() - start)
    tokens = recipe.micro_batch * seq_len
    peak = measure_matmul_flops("bf16", device=device).best
    flops = {  # per token; ours runs its head on the masked positions only, BertForMaskedLM on every one
        "crammed (ours)": mlm_flops_per_token(recipe, ours),
        "BertForMaskedLM": flops_per_token(recipe.model, matmul_parameters(theirs), seq_len),
    }
    rows = {}
    for name, fpt in flops.items():
        tps = tokens / statistics.median(times[name])
        rows[name] = {
            "tokens_per_s": round(tps, 1),
            "tokens_per_s_best": round(tokens / min(times[name]), 1),
            "mfu": round(fpt * tps / peak, 4),
            "flops_per_token": fpt,
        }
    rows["speed-up"] = round(rows["crammed (ours)"]["tokens_per_s"] / rows["BertForMaskedLM"]["tokens_per_s"], 3)
    rows["peak_bf16_flops"] = peak
    return rows


def loss_at_budget(shape: dict, budget: float, device, max_chars: int | None) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for make in (crammed, original_bert):
            recipe = make(**shape)
            run = PretrainRun(recipe, budget, max_chars=max_chars)
            s = pretrain(f"{tmp}/{recipe.name}", run, device=device, checkpoint_every=10_000, progress=False)
            results[recipe.name] = {k: s[k] for k in ("steps", "tokens_per_s", "train_loss", "val_loss")}
    return results


def run(budget: float | None = None, device=None, repeats: int | None = None) -> dict:
    device = runtime.device(device) if not isinstance(device, torch.device) else device
    small = runtime.FAST
    shape = TINY_SHAPE if small else CUDA_SHAPE if device.type == "cuda" else {}
    recipe = crammed(**shape)
    budget = budget or parse_budget("20s" if small else "2m")
    repeats = repeats or (5 if small else 20)
    speed = throughput(recipe, device, repeats)
    losses = loss_at_budget(shape, budget, device, max_chars=100_000 if small else None)
    model = recipe.model
    print(
        f"bf16 autocast, {device}, d={model.d_model}, {model.n_layers} layers, batch {recipe.micro_batch}x"
        f"{model.max_seq_len}, {repeats} alternating repeats; measured bf16 matmul peak "
        f"{speed['peak_bf16_flops'] / 1e9:.1f} GFLOP/s"
    )
    print(f"{'model':<18}{'tokens/s best':>15}{'tokens/s median':>17}{'FLOPs/token':>13}{'MFU (median)':>14}")
    for name in ("crammed (ours)", "BertForMaskedLM"):
        r = speed[name]
        print(
            f"{name:<18}{r['tokens_per_s_best']:>15,.0f}{r['tokens_per_s']:>17,.0f}{r['flops_per_token'] / 1e6:>12.1f}M"
            f"{r['mfu']:>14.2%}"
        )
    print(
        f"speed-up (medians): {speed['speed-up']:.2f}x (target >= 2.0x); crammed MFU {speed['crammed (ours)']['mfu']:.1%} "
        f"(target >= 35%)"
    )
    print(f"\nMLM loss after {budget:.0f} s of training each (held-out, same data):")
    for name, r in losses.items():
        print(f"  {name:<10} steps {r['steps']:>6}  tokens/s {r['tokens_per_s']:>10,.0f}  val loss {r['val_loss']:.3f}")
    verdict = losses["crammed"]["val_loss"] < losses["original"]["val_loss"]
    print(f"crammed below original: {verdict}")
    return {
        "device": str(device),
        "shape": {k: getattr(model, k) for k in ("d_model", "n_layers", "vocab_size")},
        "throughput": speed,
        "budget_seconds": budget,
        "loss_at_budget": losses,
        "crammed_lower_loss": verdict,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget", type=parse_budget, default=None, help="seconds of each loss run (default 20s fast, 2m full)"
    )
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    args = parser.parse_args()
    print(json.dumps(run(args.budget, args.device)))
