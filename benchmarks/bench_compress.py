"""Compression of one fine-tuned model: bytes on disk, CPU latency per batch and accuracy, one run.

    python benchmarks/bench_compress.py                  # the base: Recipe()'s if cached, else the shipped one
    python benchmarks/bench_compress.py --base full      # Recipe()'s, fine-tuned first if not cached
    python benchmarks/bench_compress.py --threads 1 --batch 8 --distill-steps 20 --finetune-steps 5 \
        --val-limit 128 --base fast                      # lesson 22's fast mode

The base is all-MiniLM-L6-v2 fine-tuned on Rotten Tomatoes by ``llmedu.compress.finetuned``
(``Recipe()``, cached in the data cache after the first run: fine-tune it with the ordinary wrapper before
a quiet run, so that the quiet run only measures), or fast mode's ``SHIPPED`` base (lesson 19's shipped
LoRA adapter merged into the pretrained weights: nothing to train); the table's header names the one used. Every row compresses that same model and is measured by
``llmedu.compress.compare.measure``: safetensors bytes (torch.save bytes where safetensors cannot hold
the weights), the median and minimum of ``--repeats`` forward passes over one batch of ``--batch``
validation snippets padded to their longest (at most 64 tokens), at ``torch.set_num_threads(--threads)``,
and accuracy on the 1,285 validation snippets. Size ratios are against the fp32 row of the same run; the
latency ratio ("x fp32") is paired: every row is timed alternately with the fp32 base, ``--repeats`` pairs
on the same batch, and the table gives the median of the per-pair ratios and their range (the fp32 row is
the base paired with itself: the spread of the method), so that the host's drift between rows stays out of it.

The calibrated rows (``llmedu.compress.rows_quant``): LLM.int8 (outlier columns at |x| >= 6 in fp32, the
rest vector-wise int8) and beside it the same layers without the decomposition (vector-wise int8 alone), SmoothQuant (alpha 0.5, then the same W8A8 ``QuantLinear`` as "int8 ours: linears",
so the migration is the only difference), and 4-bit GPTQ beside round-to-nearest on the same per-row grid,
both stored as packed codes (``gptq.PackedLinear``: two codes a byte, a fp32 scale and a uint8 zero point a
row). Their calibration text is ``--calibration`` snippets of the *training* split. All of them run as
separate torch operations (LLM.int8 splits and quantizes per call; the 4-bit layers dequantize their whole
weight per call), so their latency is this code's, not a fused kernel's. Beside accuracy, the relative
error of the logits against fp32 (on the first 256 validation snippets) shows differences that the argmax
hides, and the outlier columns that LLM.int8 finds at threshold 6 on the calibration text are counted, with
the features that pass the paper's criterion (>= 6 in >= 25% of the hidden states that feed the attention
projections and the FFN expansion, and in >= 6% of their positions).

The claims it checks: int8 within 1 point of fp32 accuracy at <= 1/3.5 of its size, and faster
than fp32 on this CPU; a 2:4 mask has 50% sparsity and saves nothing on a CPU (stored dense, run dense).
Timings on a machine shared with other work are noisy: the load average is printed beside them.
The last line is the whole table as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def quantization_rows(base, val, batch, repeats, measure, calibration):
    """The int8 (ours and torch.ao), NF4, LLM.int8, SmoothQuant and GPTQ/RTN rows (the quantization half
    of ``llmedu.compress``), and the logit error of each against fp32."""
    import copy

    from llmedu.compress import compare, rows_quant
    from llmedu.compress.compare import int8_embeddings, torch_ao_int8
    from llmedu.compress.int8 import quantize_linears

    rows, models = [], {}

    def add(method, detail, model):
        rows.append(measure(method, detail, model, val, batch, repeats))
        models[method] = model

    linears = copy.deepcopy(base)
    quantize_linears(linears, per_channel=True)
    add("int8 ours: linears", "8 bit (W8A8 dynamic)", linears)
    add("int8 ours: + embeddings", "8 bit, embeddings too", int8_embeddings(copy.deepcopy(linears)))
    ao = torch_ao_int8(base)
    add("int8 torch.ao dynamic", "8 bit (W8A8 dynamic)", ao)
    add("int8 torch.ao + embeddings", "8 bit, embeddings too", int8_embeddings(copy.deepcopy(ao)))
    nf4 = compare.nf4_linears(base)
    add("NF4 linears, double quant", "4.127 bit, block 64", nf4)
    add("NF4 + int8 embeddings", "4.127 bit, block 64", int8_embeddings(copy.deepcopy(nf4)))
    add("LLM.int8 encoder linears", "8 bit + fp32 cols >= 6", rows_quant.llm_int8_linears(base, 6.0))
    add("vector-wise int8 encoder", "8 bit, no fp32 cols", rows_quant.vectorwise_int8_linears(base))
    add("SmoothQuant W8A8 linears", "8 bit W8A8, alpha 0.5", rows_quant.smoothquant_int8(base, calibration, 0.5))
    add("RTN 4-bit encoder linears", "4 bit, per-row grid", rows_quant.rtn_linears(base, 4))
    gptq = rows_quant.gptq_linears(base, calibration, 4)
    add("GPTQ 4-bit encoder linears", "4 bit, per-row grid", gptq)
    add("GPTQ 4-bit + int8 embeddings", "4 bit, embeddings 8", int8_embeddings(copy.deepcopy(gptq)))
    held_out = [val[i] for i in range(min(4, len(val)))]  # the first 256 validation snippets (batches of 64)
    errors = rows_quant.logit_errors(base, models, held_out)
    return rows, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="snippets per timed batch")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--distill-steps", type=int, default=60, help="steps of each 3-layer student")
    parser.add_argument("--finetune-steps", type=int, default=20, help="steps of fine-tuning after pruning")
    parser.add_argument("--val-limit", type=int, default=None, help="evaluate on the first N validation snippets")
    parser.add_argument(
        "--calibration", type=int, default=256, help="training snippets that calibrate SmoothQuant and GPTQ"
    )
    parser.add_argument(
        "--base",
        choices=("auto", "full", "fast"),
        default="auto",
        help="full: Recipe(); fast: the shipped base; auto: Recipe() if cached, else the shipped base",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from llmedu.compress import compare
    from llmedu.compress.baselines import BagOfWords, majority_accuracy
    from llmedu.compress.finetuned import (
        SHIPPED,
        Recipe,
        finetuned_classifier,
        lesson_base,
        rotten_tomatoes,
        shipped_base,
    )
    from llmedu.compress.pruning import head_importance, linear_weights, sparsity
    from llmedu.data import load_classification

    if args.base == "auto":
        base, recipe = lesson_base(fast=True)
    elif args.base == "full":
        recipe = Recipe()
        base = finetuned_classifier(recipe)
    else:
        recipe, base = SHIPPED, shipped_base()
    val = rotten_tomatoes("validation", 64, limit=args.val_limit)
    train = rotten_tomatoes("train", recipe.batch_size, seed=1)  # another order than the base's
    batch = rotten_tomatoes("validation", args.batch, seed=2)[0]

    def measure(method, detail, model, data, batch, repeats):  # paired with the fp32 base
        return compare.measure(method, detail, model, data, batch, repeats, reference=base)

    started = time.perf_counter()

    rows = []
    train_texts, train_labels = load_classification("rotten_tomatoes", "train")
    rows.append(compare.Row("majority class", "-", 0, 0.0, 0.0, majority_accuracy(train_labels, val.labels)))
    bow = BagOfWords().fit(train_texts, train_labels)
    start = time.perf_counter()
    predictions = bow.predict(val.texts)
    bow_s = (time.perf_counter() - start) * args.batch / len(val.texts)
    bow_acc = (predictions == torch.tensor(val.labels)).float().mean().item()
    from safetensors.torch import save

    rows.append(
        compare.Row(
            "TF-IDF + logistic regression", "-", len(save(bow.state_dict())), bow_s, bow_s, bow_acc, "+ vocabulary"
        )
    )

    rows.append(measure("fp32 (the base)", "32 bit", base, val, batch, args.repeats))
    rows.append(measure("bf16", "16 bit", compare.to_bf16(base), val, batch, args.repeats))
    from llmedu.compress import rows_quant
    from llmedu.compress.llm_int8 import outlier_features, outlier_hits

    calibration = rows_quant.calibration_batches(args.calibration)  # the training split, never validation
    outliers = outlier_features(base, calibration, threshold=6.0)
    states, layers = rows_quant.outlier_tracked_inputs(base)  # attention projections' and FFN expansion's inputs
    hits = outlier_hits(base, calibration, states, threshold=6.0, layers=layers)
    quant_rows, logit_errors = quantization_rows(base, val, batch, args.repeats, measure, calibration)
    rows += quant_rows

    distilled, _ = compare.student(base, train, args.distill_steps, distill=True)
    rows.append(measure("student 3 layers, distilled", "3 of 6 layers", distilled, val, batch, args.repeats))
    labels_only, _ = compare.student(base, train, args.distill_steps, distill=False)
    rows.append(measure("student 3 layers, labels only", "3 of 6 layers", labels_only, val, batch, args.repeats))

    for steps in (0, args.finetune_steps):
        suffix = f", + {steps} steps" if steps else ""
        pruned = compare.magnitude_pruned(base, 0.5, "global", train, steps)
        detail = f"{sparsity(linear_weights(pruned)):.0%} of linears"
        rows.append(measure(f"magnitude 50% global{suffix}", detail, pruned, val, batch, args.repeats))
        pruned = compare.nm_pruned(base, 2, 4, train, steps)
        detail = f"2:4, {sparsity(linear_weights(pruned)):.0%} of linears"
        rows.append(measure(f"2:4 semi-structured{suffix}", detail, pruned, val, batch, args.repeats))
    importance = head_importance(base, rotten_tomatoes("train", 32, seed=3), n_batches=8)
    for steps in (0, args.finetune_steps):
        suffix = f", + {steps} steps" if steps else ""
        pruned = compare.heads_pruned(base, importance, 0.5, train, steps)
        rows.append(measure(f"heads 50% removed{suffix}", "36 of 72 heads", pruned, val, batch, args.repeats))

    fp32 = next(r for r in rows if r.method.startswith("fp32"))
    again, again_min = compare.latency(base, batch, args.repeats)  # the drift of the machine over the run
    load = os.getloadavg()[0]
    print(
        f"\nall-MiniLM-L6-v2 on Rotten Tomatoes, {recipe}: {len(val.texts)} validation snippets; latency: batch of {args.batch}, "
        f"torch.set_num_threads({args.threads}), median of {args.repeats}; load average {load:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        f"{'method':<34}{'bits / sparsity':<26}{'MB':>8}{'x fp32':>8}{'ms/batch':>10}{'min':>8}{'x fp32':>8}"
        f"{'pairs':>13}{'accuracy':>10}{'+-se':>6}{'vs fp32':>9}"
    )
    n_val = len(val.texts)
    for r in rows:
        speed = f"{r.ratio:>8.2f}{r.ratio_lo:>7.2f}-{r.ratio_hi:<5.2f}" if r.ratio else f"{'-':>8}{'':>13}"
        print(
            f"{r.method:<34}{r.detail:<26}{r.bytes / 1e6:>8.2f}{r.bytes / fp32.bytes:>8.3f}"
            f"{r.latency_s * 1e3:>10.1f}{r.latency_min_s * 1e3:>8.1f}{speed}{r.accuracy:>10.1%}"
            f"{100 * compare.accuracy_se(r.accuracy, n_val):>6.1f}{100 * (r.accuracy - fp32.accuracy):>+8.1f}  {r.note}"
        )
    print(
        "x fp32 (latency): median over the pairs of (row's time / fp32's time in the same pair); pairs: the "
        "smallest and largest pair ratio; +-se: sqrt(p(1-p)/n), one accuracy's sampling error"
    )
    print(
        f"fp32 re-timed after every other row: {again * 1e3:.1f} ms (min {again_min * 1e3:.1f}), "
        f"{again / fp32.latency_s:.2f}x its first timing: the drift that pairing keeps out of the ratios "
        "(the absolute ms column still carries it)"
    )
    print(f"relative logit error against fp32 on {min(256, len(val.texts))} validation snippets:")
    for method, error in logit_errors.items():
        print(f"  {method:<34}{error:.4f}")
    encoder = {n: r for n, r in outliers.items() if n.startswith("bert.encoder")}
    kinds = ("attention.self.query", "attention.output.dense", "intermediate.dense", "output.dense")
    print(f"outlier columns at |x| >= 6 on {args.calibration} training snippets (LLM.int8's float columns):")
    for kind in kinds:  # a name is bert.encoder.layer.<i>.<kind>
        counts = [len(r["columns"]) for n, r in encoder.items() if n.split(".", 4)[-1] == kind]
        print(f"  {kind:<24} blocks 0-5: {counts}")
    layer_share, token_share, systematic = hits.layer_share(), hits.token_share(), hits.systematic()
    print(
        f"per feature, over the {len(states)} inputs of query/key/value, attention output and FFN up in "
        f"{len(set(layers))} blocks: {int((hits.hits.sum(0) > 0).sum())} features reach 6 somewhere, "
        f"{int(systematic.sum())} pass the paper's criterion (>= 25% of the blocks, >= 6% of all positions):"
    )
    for j in systematic.nonzero().flatten().tolist():
        print(f"  feature {j:>3}: {layer_share[j]:.0%} of the blocks, {token_share[j]:.1%} of positions")
    print(f"({time.perf_counter() - started:.0f} s in all)")
    for name in ("int8 ours: + embeddings", "int8 torch.ao + embeddings"):
        int8 = next(r for r in rows if r.method == name)
        points, smaller, speedup = 100 * (int8.accuracy - fp32.accuracy), fp32.bytes / int8.bytes, 1 / int8.ratio
        print(
            f"target, {name}: within 1 point of fp32 ({points:+.1f}: {abs(points) <= 1}), <= 1/3.5 of its size "
            f"({smaller:.2f}x smaller: {smaller >= 3.5}), faster than fp32 (speed-up {speedup:.2f}x: {speedup > 1})"
        )
    print(
        json.dumps(
            {
                "threads": args.threads,
                "batch": args.batch,
                "load_average": round(load, 1),
                "base": str(recipe),
                "fp32_ms_retimed": round(again * 1e3, 2),
                "calibration_snippets": args.calibration,
                "logit_error": {m: round(e, 5) for m, e in logit_errors.items()},
                "outlier_columns_t6": {n: len(r["columns"]) for n, r in encoder.items()},
                "systematic_features": systematic.nonzero().flatten().tolist(),
                "rows": [
                    {
                        "method": r.method,
                        "bytes": r.bytes,
                        "ms": round(r.latency_s * 1e3, 2),
                        "x_fp32_paired": None if r.ratio is None else round(r.ratio, 3),
                        "pair_range": None if r.ratio is None else [round(r.ratio_lo, 3), round(r.ratio_hi, 3)],
                        "accuracy": round(r.accuracy, 4),
                    }
                    for r in rows
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
