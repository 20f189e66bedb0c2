"""Does simulated fp8 train like bf16 and fp32? Loss after N steps and step time, from one start, in one run.

    python benchmarks/bench_fp8.py                      # 200 steps (40 with LLMEDU_FAST=1), 3 repeats
    python benchmarks/bench_fp8.py --steps 500 --d-model 128 --layers 4

``llmedu.train.fp8_run.compare_precisions`` trains one small GPT on Shakespeare bytes three times,
fp32, bf16 autocast and simulated fp8 (E4M3 forward, E5M2 gradients, delayed scaling), on the same
batches. Each repeat uses another seed (other weights, other batches): the table gives the final loss
(mean of the last 10 steps) as min and median over the repeats, its gap to fp32 in the same repeat,
the seconds per step, and the byte-unigram loss of the text, the trivial baseline a model must beat.
fp8 here is *simulated* (values on the fp8 grid, held in fp32), so its time says nothing about fp8
hardware: it is the cost of the simulation. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import Counter

import torch

from llmedu import runtime
from llmedu.data import load_corpus
from llmedu.train.fp8_run import PRECISIONS_COMPARED, compare_precisions


def unigram_loss(text: str) -> float:
    """Entropy of the byte frequencies, in nats: the loss of a model that ignores context."""
    counts = Counter(text.encode("utf-8"))
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40 if runtime.FAST else 200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.steps < 10 or args.repeats < 1:
        parser.error("--steps must be >= 10 and --repeats >= 1")

    final: dict[str, list[float]] = {p: [] for p in PRECISIONS_COMPARED}
    gap: dict[str, list[float]] = {p: [] for p in PRECISIONS_COMPARED}
    per_step: dict[str, list[float]] = {p: [] for p in PRECISIONS_COMPARED}
    counts = None
    for seed in range(args.repeats):
        losses = {}
        for precision in PRECISIONS_COMPARED:  # one at a time, to time each
            start = time.perf_counter()
            run = compare_precisions(
                args.steps, seed=seed, precisions=(precision,), d_model=args.d_model, n_layers=args.layers
            )
            per_step[precision].append((time.perf_counter() - start) / args.steps)
            losses[precision] = statistics.fmean(run["losses"][precision][-10:])
            counts = run["fp8_counts"] or counts
        for precision in PRECISIONS_COMPARED:
            final[precision].append(losses[precision])
            gap[precision].append(losses[precision] - losses["fp32"])

    baseline = unigram_loss(load_corpus("shakespeare"))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; GPT d_model {args.d_model}, "
        f"{args.layers} layers; {args.steps} steps; {args.repeats} repeats (seeds)"
    )
    print(f"byte-unigram loss of the text (the baseline): {baseline:.4f} nats")
    print(
        f"{'precision':<10}{'loss min':>10}{'median':>10}{'gap to fp32':>13}{'s/step min':>12}{'median':>9}{'time':>8}"
    )
    fp32_time = min(per_step["fp32"])
    for p in PRECISIONS_COMPARED:
        print(
            f"{p:<10}{min(final[p]):>10.4f}{statistics.median(final[p]):>10.4f}{statistics.median(gap[p]):>+13.4f}"
            f"{min(per_step[p]):>12.3f}{statistics.median(per_step[p]):>9.3f}{min(per_step[p]) / fp32_time:>7.2f}x"
        )
    print(f"fp8 overflows/underflows of the last repeat: {counts}")
    summary = {
        "benchmark": "fp8",
        "steps": args.steps,
        "unigram_loss": round(baseline, 4),
        **{
            p: {
                "final_loss_median": round(statistics.median(final[p]), 4),
                "gap_to_fp32_median": round(statistics.median(gap[p]), 4),
                "seconds_per_step_min": round(min(per_step[p]), 4),
            }
            for p in PRECISIONS_COMPARED
        },
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
