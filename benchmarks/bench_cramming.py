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
   over this machine's measured bf16 matmul FLOP/s (``llmedu.hardware``).
2. Loss at a budget: ``pretrain`` with the crammed recipe and with the original one, the same
   wall-clock budget each, on the same data; the held-out MLM loss at the end.
3. Time to target loss (as speed-run leaderboards report it): in those same runs the
   held-out MLM loss is measured every ``--eval-every`` optimizer steps (outside the budget's clock),
   and ``llmedu.cramming.target.time_to_target`` reads the training seconds at which each recipe
   first reaches the target. The default target is the unigram cross-entropy of the held-out text
   under the training text's token frequencies (``studies.calibration.unigram_cross_entropy``, same tokenizer):
   the loss of a model that ignores the context, so reaching it is the first sign of using context.
   The resolution is one evaluation interval (printed); a recipe that does not reach the target
   within the budget says so. Each evaluation reads ``EVAL_BATCHES`` batches of the fixed held-out set.

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
from llmedu.cramming.studies.study import unigram_line
from llmedu.cramming.target import time_to_target
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


EVAL_BATCHES = 10  # held-out batches per evaluation during the runs (the final loss too)


def loss_at_budget(
    shape: dict, budget: float, device, max_chars: int | None, eval_every: int, target: float | None
) -> tuple[dict, float, str]:
    """({recipe: figures}, the target loss, where the target came from): both recipes, the same budget."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for make in (crammed, original_bert):
            recipe = make(**shape)
            run = PretrainRun(recipe, budget, max_chars=max_chars)
            s = pretrain(
                f"{tmp}/{recipe.name}",
                run,
                device=device,
                checkpoint_every=10_000,
                progress=False,
                eval_every=eval_every,
                eval_batches=EVAL_BATCHES,
            )
            keep = ("steps", "tokens_per_s", "train_loss", "val_loss", "passes", "val_history")
            results[recipe.name] = {k: s[k] for k in keep}
        source = "given"
        if target is None:  # both runs share the corpora and the tokenizer: one unigram line
            target, source = round(unigram_line(f"{tmp}/crammed"), 4), "unigram cross-entropy"
    for r in results.values():
        r["time_to_target"] = time_to_target(r["val_history"], target) if r["val_history"] else None
    return results, target, source


def run(
    budget: float | None = None,
    device=None,
    repeats: int | None = None,
    target: float | None = None,
    eval_every: int | None = None,
) -> dict:
    device = runtime.device(device) if not isinstance(device, torch.device) else device
    small = runtime.FAST
    shape = TINY_SHAPE if small else CUDA_SHAPE if device.type == "cuda" else {}
    recipe = crammed(**shape)
    budget = budget or parse_budget("20s" if small else "2m")
    repeats = repeats or (5 if small else 20)
    speed = throughput(recipe, device, repeats)
    eval_every = eval_every or (5 if small else 20)
    max_chars = 100_000 if small else None
    losses, target, source = loss_at_budget(shape, budget, device, max_chars, eval_every, target)
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
    print(f"speed-up (medians): {speed['speed-up']:.2f}x; crammed MFU {speed['crammed (ours)']['mfu']:.1%}")
    print(f"\nMLM loss after {budget:.0f} s of training each (held-out, same data):")
    for name, r in losses.items():
        print(
            f"  {name:<10} steps {r['steps']:>6}  tokens/s {r['tokens_per_s']:>10,.0f}  val loss {r['val_loss']:.3f}"
            f"  passes over the data {r['passes']:.2f}"
        )
    verdict = losses["crammed"]["val_loss"] < losses["original"]["val_loss"]
    print(f"crammed below original: {verdict}")
    print(
        f"\nTime to the held-out MLM loss {target:.3f} ({source}), evaluated every {eval_every} optimizer steps "
        f"on {EVAL_BATCHES} held-out batches; the time is an upper bound, late by at most one interval:"
    )
    times = {}
    for name, r in losses.items():
        t = r["time_to_target"]
        if t is None:
            print(f"  {name:<10} no held-out evaluation in {r['steps']} steps (fewer than {eval_every})")
        elif t["reached"]:
            times[name] = t["seconds"]
            print(f"  {name:<10} {t['seconds']:>8.1f} s  (step {t['step']}, interval {t['resolution_seconds']:.1f} s)")
        else:
            print(f"  {name:<10} not reached in {budget:.0f} s (best held-out loss {t['best_loss']:.3f})")
    ratio = times["original"] / times["crammed"] if len(times) == 2 else None
    if ratio:
        print(f"speed-up to target (original / crammed): {ratio:.2f}x")
    for r in losses.values():
        r.pop("val_history")
    return {
        "device": str(device),
        "shape": {k: getattr(model, k) for k in ("d_model", "n_layers", "vocab_size")},
        "throughput": speed,
        "budget_seconds": budget,
        "loss_at_budget": losses,
        "crammed_lower_loss": verdict,
        "target_loss": target,
        "target_source": source,
        "eval_every": eval_every,
        "time_to_target_seconds": {k: (v["time_to_target"] or {}).get("seconds") for k, v in losses.items()},
        "time_to_target_speedup": round(ratio, 3) if ratio else None,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget", type=parse_budget, default=None, help="seconds of each loss run (default 20s fast, 2m full)"
    )
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    parser.add_argument(
        "--target", type=float, default=None, help="held-out MLM loss to reach (default: the unigram cross-entropy)"
    )
    parser.add_argument("--eval-every", type=int, default=None, help="optimizer steps between held-out evaluations")
    args = parser.parse_args()
    print(json.dumps(run(args.budget, args.device, target=args.target, eval_every=args.eval_every)))
