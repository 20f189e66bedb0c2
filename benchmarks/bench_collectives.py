"""Our ring all-reduce (send/recv only) against torch.distributed.all_reduce (gloo's own), CPU.

    python benchmarks/bench_collectives.py                 # 2 and 4 ranks, 1 KB to 64 MB
    python benchmarks/bench_collectives.py --ranks 4 --max-mb 16 --repeats 5

Each size is timed on every rank between barriers; a repeat's time is the slowest rank's (a
collective is over when its last rank is done). The table gives the best and the median of the
repeats, the bus bandwidth of the best (bytes * 2 (N - 1) / N / time, the convention of
nccl-tests, comparable across world sizes), and gloo's time / ours (above 1: ours is faster).
The claim checked: at 4 ranks and 64 MB ours reaches at least 0.7x gloo's speed. The last line
is the whole table as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from llmedu.parallel import launch, ring_all_reduce

CLAIM_RATIO, CLAIM_RANKS, CLAIM_BYTES = 0.7, 4, 64 * 2**20


def time_all_reduces(sizes: list[int], repeats: int) -> list[dict]:
    """In each rank: best and median seconds of ours and gloo's all-reduce for each size (bytes)."""
    rows = []
    for nbytes in sizes:
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        row = {"bytes": nbytes}
        for name, op in (("ours", lambda: ring_all_reduce(x)), ("gloo", lambda: dist.all_reduce(x.clone()))):
            op()  # warm-up: connections, allocations
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                op()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank decides
                times.append(elapsed.item())
            row[name] = {"best": min(times), "median": statistics.median(times)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    sizes, s = [], 1024
    while s <= args.max_mb * 2**20:
        sizes.append(s)
        s *= 4
    table = []
    print(
        f"{'ranks':>5} {'size':>9} {'ours best':>11} {'ours median':>12} {'gloo best':>11} "
        f"{'gloo median':>12} {'ours busbw':>11} {'gloo busbw':>11} {'gloo/ours':>10}"
    )
    for n in args.ranks:
        for row in launch(time_all_reduces, n, sizes, args.repeats, echo=False, timeout=300)[0]:
            factor = 2 * (n - 1) / n
            ours, gloo = row["ours"], row["gloo"]
            ratio = gloo["best"] / ours["best"]
            table.append({"ranks": n, **row, "ratio": ratio})
            print(
                f"{n:>5} {_size(row['bytes']):>9} {ours['best'] * 1e3:>9.3f}ms {ours['median'] * 1e3:>10.3f}ms "
                f"{gloo['best'] * 1e3:>9.3f}ms {gloo['median'] * 1e3:>10.3f}ms "
                f"{row['bytes'] * factor / ours['best'] / 1e9:>7.2f}GB/s {row['bytes'] * factor / gloo['best'] / 1e9:>7.2f}GB/s "
                f"{ratio:>10.2f}"
            )
    claim = [r for r in table if r["ranks"] == CLAIM_RANKS and r["bytes"] == CLAIM_BYTES]
    if claim:
        ok = claim[0]["ratio"] >= CLAIM_RATIO
        print(
            f"claim: ours >= {CLAIM_RATIO}x gloo's speed at {CLAIM_RANKS} ranks, 64 MB: "
            f"{claim[0]['ratio']:.2f}x -> {'met' if ok else 'NOT met'}"
        )
    print(json.dumps({"benchmark": "ring_all_reduce_vs_gloo", "rows": table}))
    return 0


def _size(nbytes: int) -> str:
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


if __name__ == "__main__":
    sys.exit(main())
