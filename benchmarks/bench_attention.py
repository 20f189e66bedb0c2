"""Claims of lessons 17-18, measured in one run: FlashAttention's memory, PagedAttention's waste.

    python benchmarks/bench_attention.py                      # T = 1024 .. 8192, 3 repeats
    python benchmarks/bench_attention.py --lengths 1024 2048 --repeats 2
    python benchmarks/bench_attention.py --threads 1          # on a busy shared CPU

1. Attention forward + backward at sequence lengths T, for the naive implementation (the score
   matrix written out), PyTorch's ``scaled_dot_product_attention`` and ``llmedu.kernels.flash_attention``:
   peak memory (CUDA: ``max_memory_allocated``; CPU: ``llmedu.memory.MemoryTracker``, which sees
   every tensor but not a fused kernel's internal scratch) and wall-clock time (min and median).
   Claim: at T = 8192 our peak is at most 1/10 of the naive one.
2. KV-cache waste on one workload of requests of mixed lengths, served by continuous batching over
   a paged cache: the share of slots that hold no token, paged vs a contiguous cache that reserves
   the model's maximum length per sequence. Claim: paged < 5%, contiguous > 50%.
3. One decoding step of attention over a paged cache (batch of sequences, one query each), two ways:
   ``paged_attention`` (gather the blocks into a contiguous copy, then SDPA) and
   ``paged_attention_blockwise`` (block by block through the tables, online softmax): time (min and
   median) and peak memory (MemoryTracker, on CPU). No claim on time; the outputs must agree.

The last line is JSON with every number above.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from llmedu.inference import ContinuousBatcher, Request
from llmedu.inference.kv_waste import contiguous_breakdown, external_fragmentation, paged_waste
from llmedu.inference.paged_attention import paged_attention, paged_attention_blockwise
from llmedu.kernels import flash_attention
from llmedu.memory import MemoryTracker
from llmedu.models import CausalLM, TransformerConfig
from llmedu.nn.attention import math_attention, sdpa_attention
from llmedu.runtime import Timer, device, seed_everything

IMPLEMENTATIONS = {
    "naive": lambda q, k, v: math_attention(q, k, v, True, None),
    "sdpa": lambda q, k, v: sdpa_attention(q, k, v, True, None),
    "flash (ours)": lambda q, k, v: flash_attention(q, k, v, causal=True, block_size=128),
}


def step(fn, q, k, v) -> None:
    """One forward and backward pass of attention."""
    fn(q, k, v).sum().backward()


def peak_bytes(fn, q, k, v, dev) -> int:
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(fn, q, k, v)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base + 3 * q.nbytes  # inputs counted, as on CPU
    with MemoryTracker(torch.nn.Module(), device=q.device) as tracker:
        step(fn, q, k, v)
    return tracker.peak_bytes


def attention_table(lengths, repeats, heads, head_dim, dev) -> dict:
    results = {}
    for T in lengths:
        seed_everything(T)
        q, k, v = (torch.randn(1, heads, T, head_dim, device=dev, requires_grad=True) for _ in range(3))
        results[T] = {}
        for name, fn in IMPLEMENTATIONS.items():
            times = []
            for _ in range(repeats):
                with Timer(dev) as t:
                    step(fn, q, k, v)
                times.append(t.seconds)
                q.grad = k.grad = v.grad = None
            peak = peak_bytes(fn, q, k, v, dev)
            q.grad = k.grad = v.grad = None
            results[T][name] = {
                "peak_mib": peak / 2**20,
                "time_min_s": min(times),
                "time_median_s": statistics.median(times),
            }
            print(
                f"  T={T:<6} {name:<13} peak {peak / 2**20:9.1f} MiB   time min {min(times):7.3f} s  median {statistics.median(times):7.3f} s",
                flush=True,
            )
    return results


def waste_workload(n_requests: int, seed: int = 0) -> list[Request]:
    """Prompts of 8..128 tokens; replies end at token 0 (sampled), at most 512 tokens."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
    return [
        Request([rand(1, 255) for _ in range(rand(8, 128))], max_new_tokens=512, temperature=1.0, seed=i)
        for i in range(n_requests)
    ]


def kv_waste(n_requests: int, block_size: int = 16, max_len: int = 1024) -> dict:
    seed_everything(0)
    model = CausalLM(
        TransformerConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, max_seq_len=max_len, position="rope")
    ).eval()
    requests = waste_workload(n_requests)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: splitting its small matmuls across cores costs more than it saves
    try:
        batcher = ContinuousBatcher(model, num_blocks=256, block_size=block_size, max_batch=32, eos_id=0)
        with Timer("cpu") as t:
            outputs = batcher.run(requests, progress=False)
    finally:
        torch.set_num_threads(threads)
    history = batcher.history
    exact = {s: len(requests[i].prompt) + requests[i].max_new_tokens for s, i in batcher.request_of.items()}
    max_length = contiguous_breakdown(history, max_len)
    reserved = contiguous_breakdown(history, exact)
    result = {
        "requests": n_requests,
        "tokens_generated": sum(len(o[0]) for o in outputs),
        "steps": len(history),
        "seconds": t.seconds,
        "paged_waste": paged_waste(history),
        "contiguous_max_length_waste": 1 - max_length["used"],
        "contiguous_max_length": max_length,
        "contiguous_exact_reservation": reserved,
        "first_fit_arena": external_fragmentation(history, exact, capacity=256 * block_size),
    }
    return result


def paged_decode(
    context: int, batch: int, block_size: int, repeats: int, heads: int = 8, n_kv: int = 2, head_dim: int = 64
):
    """One decode step over a shuffled pool: gathered copy + SDPA against block-by-block reads."""
    g = torch.Generator().manual_seed(0)
    n_blocks = -(-context // block_size)
    pool_blocks = batch * n_blocks
    k_pool, v_pool = (torch.randn(pool_blocks, n_kv, block_size, head_dim, generator=g) for _ in range(2))
    tables = torch.randperm(pool_blocks, generator=g).view(batch, n_blocks)  # (B, n_blocks), scattered blocks
    lengths = torch.full((batch,), context)
    q = torch.randn(batch, heads, 1, head_dim, generator=g)
    results, outputs = {}, {}
    for name, fn in (("gathered + sdpa", paged_attention), ("block by block", paged_attention_blockwise)):
        times = []
        for _ in range(repeats):
            with Timer("cpu") as t:
                outputs[name] = fn(q, k_pool, v_pool, tables, lengths)
            times.append(t.seconds)
        with MemoryTracker(torch.nn.Module(), device=q.device) as tracker:
            fn(q, k_pool, v_pool, tables, lengths)
        results[name] = {
            "peak_mib": tracker.peak_bytes / 2**20,
            "time_min_s": min(times),
            "time_median_s": statistics.median(times),
        }
        print(
            f"  {name:<16} peak {tracker.peak_bytes / 2**20:7.1f} MiB  "
            f"time min {1e3 * min(times):7.2f} ms  median {1e3 * statistics.median(times):7.2f} ms",
            flush=True,
        )
    results["pools_mib"] = (k_pool.nbytes + v_pool.nbytes) / 2**20
    print(f"  (MemoryTracker counts the K/V pools once an op reads them: {results['pools_mib']:.1f} MiB of each peak)")
    results["max_abs_difference"] = (outputs["gathered + sdpa"] - outputs["block by block"]).abs().max().item()
    print(f"  max |gathered - block by block| = {results['max_abs_difference']:.1e}")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--decode-context", type=int, default=2048, help="tokens per sequence in the paged decode step")
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's own choice)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # on a shared machine, 1 thread avoids OpenMP threads waiting on each other
    dev = device()
    print(
        f"attention forward + backward, causal, batch 1, {args.heads} heads of dim {args.head_dim}, fp32, on {dev}, "
        f"{torch.get_num_threads()} CPU thread(s)",
        flush=True,
    )
    table = attention_table(args.lengths, args.repeats, args.heads, args.head_dim, dev)

    print("\n  T       naive/ours peak   naive/ours time   sdpa/ours time")
    ratios = {}
    for T, row in table.items():
        naive, sdpa, ours = row["naive"], row["sdpa"], row["flash (ours)"]
        ratios[T] = {
            "peak_naive_over_ours": naive["peak_mib"] / ours["peak_mib"],
            "time_naive_over_ours": naive["time_median_s"] / ours["time_median_s"],
            "time_sdpa_over_ours": sdpa["time_median_s"] / ours["time_median_s"],
        }
        r = ratios[T]
        print(
            f"  {T:<7} {r['peak_naive_over_ours']:>14.1f}x {r['time_naive_over_ours']:>16.2f}x {r['time_sdpa_over_ours']:>15.2f}x"
        )

    print(
        f"\nKV-cache waste: {args.requests} requests of mixed lengths, continuous batching, paged blocks of 16",
        flush=True,
    )
    waste = kv_waste(args.requests)
    print(f"  {waste['tokens_generated']} tokens in {waste['steps']} steps ({waste['seconds']:.1f} s)")
    print(f"  paged: {100 * waste['paged_waste']:.1f}% of allocated slots empty")
    print(
        f"  contiguous, max length: {100 * waste['contiguous_max_length_waste']:.1f}% empty  "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in waste["contiguous_max_length"].items())
    )
    print(
        "  contiguous, prompt + max_new_tokens: "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in waste["contiguous_exact_reservation"].items())
    )
    print(
        "  first-fit arena of the same size: "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in waste["first_fit_arena"].items())
    )

    print(
        f"\npaged decode step: {args.decode_batch} sequences x {args.decode_context} tokens, blocks of 16, "
        "8 query heads, 2 K/V heads of 64, fp32",
        flush=True,
    )
    decode = paged_decode(args.decode_context, args.decode_batch, 16, args.repeats)

    longest = max(table)
    claims = {
        f"flash peak <= naive/10 at T={longest}": ratios[longest]["peak_naive_over_ours"] >= 10,
        "paged waste < 5%": waste["paged_waste"] < 0.05,
        "contiguous max-length waste > 50%": waste["contiguous_max_length_waste"] > 0.5,
        "paged decode: block by block equals gathered (1e-5)": decode["max_abs_difference"] < 1e-5,
    }
    for claim, ok in claims.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {claim}")
    print(
        json.dumps(
            {
                "device": str(dev),
                "attention": table,
                "ratios": ratios,
                "kv_waste": waste,
                "paged_decode": decode,
                "claims": claims,
            }
        )
    )
    return 0 if all(claims.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
