"""How long ``launch`` takes to start ranks that do nothing, against a fresh interpreter per rank.

    python benchmarks/bench_launch.py                  # world sizes 1, 2, 4; 5 repeats
    python benchmarks/bench_launch.py --sizes 2 8 --repeats 3

Each repeat starts ``world_size`` ranks that join a gloo group and return at once, and waits for all of
them. Two ways: ``llmedu.parallel.launch`` (ranks forked from its fork servers, one per rank index), and
``torch.multiprocessing.spawn`` (the reference: a fresh interpreter per rank, each importing PyTorch and the
benchmark's own module). The servers start at a launcher's first launch: that first launch, of the largest
world size, is timed on its own ("cold"), and the repeats come after it. Min and median of the repeats, and
their ratio. No claim is asserted: the times are this machine's. The last line is JSON with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from llmedu.parallel import launch


def _nothing() -> int:
    return dist.get_rank()


def _spawned(rank: int, world_size: int, port: int) -> None:
    """The same work under torch.multiprocessing.spawn: join the group, leave it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seconds(start, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        start()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    (cold,) = seconds(lambda: launch(_nothing, max(args.sizes), echo=False), 1)  # starts the servers
    print(f"first launch of {max(args.sizes)} ranks, starting the fork servers: {cold:.2f} s")
    rows = []
    print(f"{'ranks':>5}  {'launch min':>10}  {'median':>7}  {'spawn min':>9}  {'median':>7}  {'spawn/launch':>12}")
    for n in args.sizes:
        ours = seconds(lambda n=n: launch(_nothing, n, echo=False), args.repeats)
        theirs = seconds(lambda n=n: mp.spawn(_spawned, args=(n, _free_port()), nprocs=n), args.repeats)
        row = {
            "ranks": n,
            "launch_min_s": min(ours),
            "launch_median_s": statistics.median(ours),
            "spawn_min_s": min(theirs),
            "spawn_median_s": statistics.median(theirs),
        }
        row["spawn_over_launch_median"] = row["spawn_median_s"] / row["launch_median_s"]
        rows.append(row)
        print(
            f"{n:>5}  {row['launch_min_s']:>10.2f}  {row['launch_median_s']:>7.2f}  {row['spawn_min_s']:>9.2f}  "
            f"{row['spawn_median_s']:>7.2f}  {row['spawn_over_launch_median']:>11.1f}x"
        )
    print(
        json.dumps(
            {
                "benchmark": "launch_startup",
                "cpu_count": os.cpu_count(),
                "cold_launch_s": cold,
                "cold_launch_ranks": max(args.sizes),
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
