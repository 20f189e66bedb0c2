"""The planner's cost model against measurement: real layouts trained on CPU processes, predicted vs measured.

    python benchmarks/bench_planner.py                 # 15 layouts of a 4-layer GPT on 1, 2 and 4 processes
    python benchmarks/bench_planner.py --steps 3 --d-model 64 --seq-len 32

Every layout trains the same small GPT (``TransformerConfig``, fp32, AdamW) on one global batch with our
wrappers: ``DDP`` for data parallelism (its buckets, ``no_sync`` for accumulation), ``ZeRO`` for stages
1-3, ``tensor_parallel`` + ``PipelineStage``/``Pipeline`` (1F1B) for TP and PP, a flat all-reduce of the
gradients over the DP group of a 3D mesh, ``train.recompute`` for full recomputation. For each layout:
a warm-up step, one step under ``MemoryTracker`` (the peak of the busiest rank), then ``--steps`` timed
steps (a step's time is its slowest rank's; the median is reported, the minimum beside it).

The prediction is ``llmedu.planner.evaluate`` on ``local_cluster``: one thread's fp32 matmul FLOP/s and gloo's
alpha-beta, measured in this run (``llmedu.planner.probes``), and for each world size how the ranks
share the CPU (``llmedu.planner.shared_cores``: the speed a rank keeps while all compute, timed on the
model's step, reported with the probe's raw reading and noise, and what a blocking message waits beyond
alpha-beta), no overlap of communication with
compute, and ONE calibration: the efficiency of the model's step
relative to the matmul probe, from the one-process layout (the first). Every other layout tests what the
model adds: division of the work, collectives, bubble, shared cores. This host's speed drifts (the same
one-process step took 77, 83 and 153 ms in three runs minutes apart), so the first layout is also run
right before and after every launch, each layout is predicted with the efficiency of the reference timed
beside it, and the whole sweep is measured ``--rounds`` times (medians kept). The bounds a prediction is
held to: peak memory within 10% of the measured peak, step time within 25% of the measured median.
The last line is the whole table as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from llmedu.planner.measured import measure_layouts, predict_layouts, probe_machine, small_gpt
from llmedu.planner.memory import Layout

MEMORY_TARGET, TIME_TARGET = 0.10, 0.25

# the batch is --sequences sequences; the micro-batch is each layout's; the first is the calibration
LAYOUTS = (
    Layout(dp=1, micro_batch=8),
    Layout(dp=1, micro_batch=2),
    Layout(dp=2, micro_batch=4),
    Layout(dp=4, micro_batch=2),
    Layout(dp=4, micro_batch=1),
    Layout(dp=2, micro_batch=4, recompute="full"),
    Layout(dp=4, zero=1, micro_batch=2),
    Layout(dp=4, zero=2, micro_batch=2),
    Layout(dp=4, zero=3, micro_batch=2),
    Layout(tp=2, micro_batch=8, sequence_parallel=False),  # our tensor_parallel has no sequence parallelism
    Layout(pp=2, micro_batch=2),
    Layout(pp=4, micro_batch=1),
    Layout(dp=2, tp=2, micro_batch=4, sequence_parallel=False),
    Layout(dp=2, pp=2, micro_batch=1),
    Layout(tp=2, pp=2, micro_batch=2, sequence_parallel=False),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="times every layout is measured (the median is kept)")
    args = parser.parse_args(argv)
    cfg, cores = small_gpt(args.d_model, args.layers, args.seq_len), os.cpu_count()
    # one thread per rank, for every world size: a 2-thread rank on a shared machine waits for its
    # slowest thread at every kernel (lesson 00); the model is told the same (local_cluster's threads)
    os.environ["OMP_NUM_THREADS"] = "1"
    probes = probe_machine(cfg, sorted({lay.world for lay in LAYOUTS}), cores)
    print(
        f"probes: one thread {probes['thread_flops'] / 1e9:.1f} GFLOP/s fp32 matmul; AdamW "
        f"{probes['adam_rate'] / 32 / 1e6:.0f} M parameters/s; overhead {probes['overheads'][0] * 1e3:.2f} ms per "
        f"layer, {probes['overheads'][1] * 1e3:.2f} ms per micro-batch; {cores} cores"
    )
    for w, link in probes["links"].items():
        share = probes["sharing"][w]
        print(
            f"probes: gloo, {w} ranks: alpha {link.latency * 1e6:.0f} us, beta {link.bandwidth / 1e9:.2f} GB/s; "
            f"a rank keeps {share.speed:.0%} of its speed when all {w} compute; a blocking message waits "
            f"{share.wait * 1e3:.2f} ms beyond alpha-beta ({share.source})"
        )
    measured = measure_layouts(cfg, args.sequences, LAYOUTS, args.steps, reference=LAYOUTS[0], rounds=args.rounds)
    rows, efficiency = predict_layouts(cfg, args.sequences, LAYOUTS, measured, probes)
    spread = [r["efficiency"] for r in rows]
    print(
        f"calibration: the one-process step's FLOPs run at {efficiency:.0%} of the matmul probe's FLOP/s "
        f"({min(spread):.0%}-{max(spread):.0%} in the reference runs timed beside each launch: the host's drift)"
    )
    print(
        f"{'layout':<34} {'meas ms':>8} {'pred ms':>8} {'err':>6}  {'meas MiB':>8} {'pred MiB':>8} {'err':>6}  parts (ms)"
    )
    for r in rows:
        parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r["parts"].items())
        print(
            f"{r['layout']:<34} {r['measured_s'] * 1e3:>8.1f} {r['predicted_s'] * 1e3:>8.1f} {r['time_error']:>+6.0%}  "
            f"{r['measured_peak'] / 2**20:>8.2f} {r['predicted_peak'] / 2**20:>8.2f} {r['memory_error']:>+6.1%}  {parts}"
        )
    mem_ok = sum(abs(r["memory_error"]) <= MEMORY_TARGET for r in rows)
    time_ok = sum(abs(r["time_error"]) <= TIME_TARGET for r in rows)
    print(
        f"peak memory within {MEMORY_TARGET:.0%}: {mem_ok}/{len(rows)}; step time within {TIME_TARGET:.0%}: {time_ok}/{len(rows)}"
    )
    summary = {
        "benchmark": "planner",
        "thread_gflops": probes["thread_flops"] / 1e9,
        "cores": cores,
        "adam_params_per_s": probes["adam_rate"] / 32,
        "overhead_ms": [o * 1e3 for o in probes["overheads"]],
        "efficiency": efficiency,
        "efficiency_range": [min(spread), max(spread)],
        "rounds": args.rounds,
        "links": {
            w: {
                "alpha_us": k.latency * 1e6,
                "beta_gbs": k.bandwidth / 1e9,
                "speed": probes["sharing"][w].speed,
                "speed_read": probes["sharing"][w].measured,  # the probe's median before clipping at 1
                "speed_noise": probes["sharing"][w].noise,  # half the range of its repeats
                "wait_ms": probes["sharing"][w].wait * 1e3,
            }
            for w, k in probes["links"].items()
        },
        "memory_within_10pct": f"{mem_ok}/{len(rows)}",
        "time_within_25pct": f"{time_ok}/{len(rows)}",
        "rows": rows,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
