"""Mixture of experts: tokens dropped vs capacity factor, parameters vs FLOPs, all-to-all bytes.

    python benchmarks/bench_moe.py                  # about a minute on 2 CPU cores
    python benchmarks/bench_moe.py --tokens 8192 --d-model 512 --repeats 7

1. Dropped tokens. One ``MoE`` layer (E = 8, top-2) routes ``--tokens`` tokens; the share of the
   N * k assignments over capacity, for capacity factors 0.5-2, once with a fresh router (nearly
   balanced) and once with a skewed one (the router's logits plus a bias that favours expert 0, as
   an untrained or collapsing router does). A balanced routing drops nothing from a factor of 1 up.
2. Parameters vs FLOPs. A dense GPT and MoE GPTs of 2-32 experts, top-1 (Switch: each token runs
   one FFN, so the active compute matches the dense model's): total and active parameters, training
   FLOPs per token (6N + 12LTd, N active), and a training step's time, min and median of
   ``--repeats``, as a ratio to the dense model's measured in the same run. The MoE's extra time is
   its routing and per-expert dispatch, not arithmetic.
3. All-to-all bytes. Expert parallelism on 2 and 4 processes (gloo), with torch's all-to-all and
   ours from send/recv: the bytes each rank sends in forward and backward, counted by
   ``p2p.traffic()``, against ``all_to_all_bytes`` from every rank's routing (equal), and against
   the balanced-routing estimate 2 * 2 * n_tok * k * (N - 1) / N * d * 4 (forward and backward).

The last line is the key figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.config import MoEConfig
from llmedu.models.counting import count_parameters, flops_per_token, matmul_parameters
from llmedu.models.gpt import lm_loss
from llmedu.nn.moe import MoE
from llmedu.parallel import launch

FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


def dropped_vs_capacity(tokens: int, d_model: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    x = torch.randn(tokens, d_model)
    out = {}
    for name, skew in (("fresh router", 0.0), ("skewed router", 1.0)):
        shares = []
        for cf in FACTORS:
            torch.manual_seed(0)
            moe = MoE(d_model, 4 * d_model, n_experts=8, top_k=2, capacity_factor=cf)
            bias = torch.zeros(8)
            bias[0] = skew  # expert 0's logit raised by ``skew``: its probability e^skew times larger
            moe.router.linear.register_forward_hook(lambda module, inputs, logits: logits + bias)
            with torch.no_grad():
                _, stats = moe(x)
            shares.append(stats.dropped / (tokens * 2))
        out[name] = shares
    return out


def step_times(config: TransformerConfig, batch: torch.Tensor, repeats: int) -> list[float]:
    torch.manual_seed(0)
    model = CausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        loss = lm_loss(model(batch), batch) + model.transformer.moe_loss()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if i:
            times.append(time.perf_counter() - start)
    return times


def parameters_vs_flops(d_model: int, layers: int, seq: int, repeats: int) -> list[dict]:
    base = dict(vocab_size=512, d_model=d_model, n_layers=layers, n_heads=4, max_seq_len=seq)
    batch = torch.randint(0, 512, (8, seq), generator=torch.Generator().manual_seed(0))
    rows = []
    for experts in (None, 2, 8, 32):
        moe = MoEConfig(n_experts=experts, top_k=1, capacity_factor=None) if experts else None
        config = TransformerConfig(**base, moe=moe)
        with torch.device("meta"):
            model = CausalLM(config)
        times = step_times(config, batch, repeats)
        rows.append(
            {
                "experts": experts or 0,
                "parameters": count_parameters(model),
                "active": count_parameters(model, active=True),
                "flops_per_token": flops_per_token(config, matmul_parameters(model, active=True), seq),
                "step_ms_min": 1e3 * min(times),
                "step_ms_median": 1e3 * statistics.median(times),
            }
        )
    return rows


def ep_worker(tokens: int, d_model: int) -> dict:
    from llmedu.parallel.experts import ExpertParallelMoE, all_to_all_bytes
    from llmedu.parallel.p2p import traffic

    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for impl in ("torch", "p2p"):
        torch.manual_seed(0)
        layer = ExpertParallelMoE(MoE(d_model, 4 * d_model, 2 * n, top_k=2, capacity_factor=None), impl=impl)
        x = torch.randn(tokens, d_model, generator=torch.Generator().manual_seed(rank)).requires_grad_()  # as in a
        # stack, where the layers below need the gradient: the dispatch's backward sends it back
        with traffic() as t:
            y, stats = layer(x)
            y.sum().backward()
        kept = [torch.empty(2 * n, dtype=torch.long) for _ in range(n)]  # every rank's routing
        dist.all_gather(kept, stats.kept_per_expert.contiguous())
        kept = torch.stack(kept)  # (N, E)
        formula = all_to_all_bytes(kept, rank, d_model)
        counts = (2 * n - 2) * 8  # the counts for the other ranks' experts, forward only
        out[impl] = {
            "counted": t.bytes_sent,
            "formula": 2 * formula - counts,  # backward: the two row terms again
            "balanced": 2 * 2 * tokens * 2 * (n - 1) // n * d_model * 4 + counts,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    drops = dropped_vs_capacity(args.tokens, args.d_model)
    print(f"1. assignments dropped (share of N*k), E=8, top-2, {args.tokens} tokens")
    print("capacity factor " + "".join(f"{cf:>8}" for cf in FACTORS))
    for name, shares in drops.items():
        print(f"{name:<16}" + "".join(f"{s:>8.1%}" for s in shares))

    rows = parameters_vs_flops(args.d_model, args.layers, args.seq, args.repeats)
    dense = rows[0]
    print(f"\n2. dense vs top-1 MoE, d={args.d_model}, {args.layers} layers, T={args.seq}, batch 8 (1 thread)")
    print(f"{'experts':>8}{'params':>12}{'x dense':>9}{'active':>12}{'FLOPs/token':>13}{'x dense':>9}"
          f"{'step ms min/med':>18}{'x dense':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['experts'] or 'dense':>8}{r['parameters']:>12,}{r['parameters'] / dense['parameters']:>9.2f}"
            f"{r['active']:>12,}{r['flops_per_token']:>13.3g}{r['flops_per_token'] / dense['flops_per_token']:>9.3f}"
            f"{r['step_ms_min']:>9.1f}/{r['step_ms_median']:<8.1f}{r['step_ms_min'] / dense['step_ms_min']:>9.2f}"
        )

    traffic_rows = {}
    print("\n3. expert parallelism, bytes each rank sends (forward + backward), top-2, no drops")
    print(f"{'ranks':>6}{'impl':>7}{'rank':>6}{'counted':>12}{'formula':>12}{'balanced est.':>15}")
    for n in (2, 4):
        results = launch(ep_worker, n, args.tokens // n, args.d_model, echo=False)
        for impl in ("torch", "p2p"):
            for rank, r in enumerate(results):
                r = r[impl]
                print(f"{n:>6}{impl:>7}{rank:>6}{r['counted']:>12,}{r['formula']:>12,}{r['balanced']:>15,}")
        traffic_rows[n] = results
    equal = all(r[i]["counted"] == r[i]["formula"] for res in traffic_rows.values() for r in res for i in r)
    print(f"counted == formula on every rank: {equal}")
    print(
        json.dumps(
            {
                "benchmark": "moe",
                "dropped_share": {k: dict(zip(map(str, FACTORS), v)) for k, v in drops.items()},
                "dense_vs_moe": rows,
                "all_to_all_counted_equals_formula": equal,
                "all_to_all": {str(n): res for n, res in traffic_rows.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
