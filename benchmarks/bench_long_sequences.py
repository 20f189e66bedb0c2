"""Long sequences: activation memory per rank under sequence parallelism, and ring attention's peak memory.

    python benchmarks/bench_long_sequences.py                          # N = 2 and 4, ring attention at T <= 8192
    python benchmarks/bench_long_sequences.py --ranks 2 --seq-lens 1024 2048 --repeats 1

Part 1, sequence parallelism (Korthikanti et al. 2022): the bytes one rank saves for backward in one
pre-LN block (d_ff = 4d, GELU, dropout 0.1, bf16), counted by autograd's saved-tensor hooks, for
one process, tensor parallelism and sequence parallelism over N ranks, with the paper's formula
beside them (its table 2: 34sbh + 5as^2b per layer, TP 10sbh + (24sbh + 5as^2b) / t, SP all / t;
it assumes 1-byte dropout masks and a dropout on the attention probabilities, which ours lacks).
A count from autograd, deterministic: no repeats.

Part 2, context parallelism (Liu et al. 2023): the per-rank peak bytes of one forward and backward
of ``ring_attention`` (one head, D = 64, fp32, causal, zig-zag and contiguous layouts), measured by
``MemoryTracker`` (every storage alive), against one process running the same code on the whole
sequence, which materialises the (T, T) score tile as plain attention does. The claim it checks: a
rank's peak is at most 1/N of one process's plus 10% of it, at T = 8192 (the "bound" column says ok or
MISS). The time per forward + backward (slowest rank, min and median of ``--repeats``) is printed too;
on a shared CPU it is noisy.
The last line is the key figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from llmedu.parallel import launch
from llmedu.parallel.sequence_parallel_attention import paper_block_activation_bytes

MiB = 2**20


def sp_worker(batch: int, seq_len: int, d_model: int, n_heads: int) -> dict:
    from llmedu.parallel.sequence_parallel_attention import block_activation_bytes

    torch.set_num_threads(1)
    return {impl: block_activation_bytes(batch, seq_len, d_model, n_heads, attn_impl=impl) for impl in ("math", "sdpa")}


def ring_worker(seq_lens: list[int], layouts: list[str], head_dim: int, repeats: int) -> dict:
    from llmedu.parallel.context_parallel import attention_peak_memory, ring_attention
    from llmedu.parallel.sequence_layout import split_sequence

    torch.set_num_threads(1)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    out = {}
    for n in seq_lens:
        full = torch.randn(1, 1, n, head_dim, generator=torch.Generator().manual_seed(0))  # (B, H, T, D)
        for layout in layouts:
            q = split_sequence(full, rank, world, layout)  # (1, 1, T/N, D)
            peak = attention_peak_memory(q, causal=True, layout=layout)
            times = []
            for _ in range(repeats):
                qkv = [q.clone().requires_grad_() for _ in range(3)]
                if world > 1:
                    dist.barrier()
                start = time.perf_counter()
                ring_attention(*qkv, causal=True, layout=layout).sum().backward()
                elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                if world > 1:
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
                times.append(elapsed.item())
            out[(n, layout)] = (peak, times)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sp-shape", type=int, nargs=4, default=[1, 1024, 256, 8], metavar=("B", "T", "D", "H"))
    args = parser.parse_args(argv)
    figures: dict = {"sp": {}, "ring": {}}

    b, s, h, a = args.sp_shape
    print(
        f"== sequence parallelism: bytes saved for backward per rank, one pre-LN block, bf16, B={b} T={s} d={h} H={a}"
    )
    print(
        f"{'N':>2} {'attention':>9} {'one (MiB)':>10} {'TP':>8} {'SP':>8} {'SP/TP':>6} {'SP x N/one':>10}   paper: one, TP, SP"
    )
    for n in args.ranks:
        memory = launch(sp_worker, n, b, s, h, a, echo=False)[0]
        paper = [paper_block_activation_bytes(s, b, h, a, n, mode) / MiB for mode in ("one", "tp", "sp")]
        for impl, m in memory.items():
            print(
                f"{n:>2} {impl:>9} {m['one'] / MiB:>10.2f} {m['tp'] / MiB:>8.2f} {m['sp'] / MiB:>8.2f} "
                f"{m['sp'] / m['tp']:>6.2f} {m['sp'] * n / m['one']:>10.2f}   "
                + ("{:.2f}, {:.2f}, {:.2f}".format(*paper) if impl == "math" else "")
            )
            figures["sp"][f"N={n} {impl}"] = {k: v for k, v in m.items()}

    layouts = ["zigzag", "contiguous"]
    print(f"\n== ring attention: per-rank peak memory of forward + backward, causal, 1 head, D={args.head_dim}, fp32")
    single = ring_worker(args.seq_lens, ["contiguous"], args.head_dim, args.repeats)  # one process, whole sequence
    print(f"{'T':>6} {'N':>2} {'layout':>10} {'peak MiB':>9} {'/ one':>6} {'bound':>6} {'ms min':>8} {'ms med':>8}")
    for n in args.seq_lens:
        peak, times = single[(n, "contiguous")]
        print(
            f"{n:>6} {1:>2} {'-':>10} {peak / MiB:>9.1f} {1:>6.3f} {'':>6} {1e3 * min(times):>8.0f} {1e3 * statistics.median(times):>8.0f}"
        )
        figures["ring"][f"T={n} N=1"] = peak
    for world in args.ranks:
        results = launch(ring_worker, world, args.seq_lens, layouts, args.head_dim, args.repeats, echo=False)
        for n in args.seq_lens:
            for layout in layouts:
                peak = max(r[(n, layout)][0] for r in results)  # the fullest rank
                times = results[0][(n, layout)][1]  # already the max over ranks
                ratio = peak / single[(n, "contiguous")][0]
                ok = "ok" if ratio <= 1 / world + 0.10 else "MISS"
                print(
                    f"{n:>6} {world:>2} {layout:>10} {peak / MiB:>9.1f} {ratio:>6.3f} {ok:>6} "
                    f"{1e3 * min(times):>8.0f} {1e3 * statistics.median(times):>8.0f}"
                )
                figures["ring"][f"T={n} N={world} {layout}"] = peak
    key = max(args.seq_lens)
    figures["ring_ratio_at_max_T"] = {
        f"N={w} {layout}": figures["ring"][f"T={key} N={w} {layout}"] / figures["ring"][f"T={key} N=1"]
        for w in args.ranks
        for layout in layouts
    }
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
