"""The measurements of the tensor-parallel lesson (12): the check against one process and torch, overlap on a
link of known speed, memory per rank.

The algorithm lives in ``tensor_parallel.py``; this file only checks it, times it and weighs it.

Check. ``compare_with_one_process`` (inside ``launch``) runs the Megatron-LM MLP, a GPT-2-like and a
LLaMA-like model (GQA) split over the ranks beside the same layers whole in each process, and the MLP
beside PyTorch's ``ColwiseParallel`` / ``RowwiseParallel`` on a ``DeviceMesh``: the largest differences
of outputs, losses and gradients (each shard's against the matching slice of the full gradient).

Overlap. A column-split layer with f inside (``ColumnParallelLinear``) computes, in backward, the input
gradient, launches its all-reduce, and computes the weight gradient either after the all-reduce has
finished (synchronous) or while it runs (``async_input_grad=True``, Megatron-LM's order). With the input
gradient taking ``t_I`` seconds, the weight gradient ``t_W`` and the all-reduce ``C``, the backward takes

    synchronous   t_I + C + t_W
    async         t_I + max(t_W, C)          so the overlap saves min(t_W, C)

(``backward_model``). To make both sides known on a shared CPU, ``SleepColumnParallelLinear`` sleeps a
fixed time in each gradient product (and then computes it, so the gradients stay right), as lesson 11's
``SleepStage`` does, and a ``Link`` (``link.py``) gives the all-reduce the alpha-beta time of lesson 10.
The two orders alternate repeat by repeat, so that each synchronous backward has an overlapped one run
next to it under the same load; ``summarise_overlap`` reads the per-repeat paired difference sync - async
against min(t_W, C), and the model at the product times each repeat measured.

Memory. ``block_memory`` runs one transformer block (unsplit, or its attention and MLP replaced by
``ParallelAttention`` and ``ParallelMLP``) under ``MemoryTracker`` (lesson 06) and returns the bytes of
parameters and of the tensors autograd saved for backward, on this rank.

Left out: the forward (g's all-reduce, which nothing can hide here), and the noise of real arithmetic,
on purpose.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ..memory.tracker import MemoryTracker
from ..models import CausalLM, TransformerConfig
from ..models.gpt import lm_loss
from ..nn.activations import FeedForward
from .link import Link
from .tensor_parallel import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    shard,
    tensor_parallel,
    vocab_parallel_lm_loss,
)

__all__ = [
    "compare_with_one_process",
    "SleepColumnParallelLinear",
    "backward_model",
    "overlap_study",
    "summarise_overlap",
    "block_memory",
]


def compare_with_one_process(world_size: int) -> dict[str, float]:
    """Inside ``launch``: the largest |difference| of our tensor-parallel MLP against the unsplit one and torch's
    DTensor TP, and of two split models' logits, loss and gradients against the same model whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))  # (B, T, d)
    diffs = {}
    torch.manual_seed(0)
    full, theirs = FeedForward(32, 128), FeedForward(32, 128)
    theirs.load_state_dict(full.state_dict())
    ours = ParallelMLP(full)
    plan = {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    parallelize_module(theirs, init_device_mesh("cpu", (world_size,)), plan)
    diffs["MLP, ours vs one process"] = (ours(x) - full(x)).abs().max().item()
    diffs["MLP, ours vs torch's DTensor TP"] = (ours(x) - theirs(x)).abs().max().item()
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))  # (B, T)
    models = {
        "GPT-2-like": TransformerConfig.gpt2(vocab_size=64, d_model=32, n_layers=2, n_heads=4),
        "LLaMA-like (GQA)": TransformerConfig.llama(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2),
    }
    for name, cfg in models.items():
        torch.manual_seed(0)
        model = CausalLM(cfg)
        tp = tensor_parallel(model)
        full_loss = lm_loss(model(ids), ids)
        full_loss.backward()
        logits = tp(ids)  # (B, T, V / N): this rank's words
        loss = vocab_parallel_lm_loss(logits, ids)
        loss.backward()
        pieces = [torch.empty_like(logits) for _ in range(world_size)]
        dist.all_gather(pieces, logits.detach())
        whole = dict(model.named_parameters())
        diffs[f"{name}: logits"] = (torch.cat(pieces, -1) - model(ids)).abs().max().item()
        diffs[f"{name}: loss"] = abs(loss.item() - full_loss.item())
        diffs[f"{name}: gradients"] = max(
            (p.grad - (whole[n].grad if p.tp_dim is None else shard(whole[n].grad, p.tp_dim))).abs().max().item()
            for n, p in tp.named_parameters()
        )
    return diffs


class SleepColumnParallelLinear(ColumnParallelLinear):
    """A ``ColumnParallelLinear`` whose input gradient takes ``input_s`` seconds and weight gradient
    ``weight_s`` (sleeps, then the real products); ``spans`` records when each ran."""

    def __init__(self, linear: nn.Linear, input_s: float, weight_s: float, **kwargs):
        super().__init__(linear, **kwargs)
        self.input_s, self.weight_s = input_s, weight_s
        self.spans: list[tuple[str, float, float]] = []  # (what, start, end) in perf_counter seconds

    def input_grad(self, grad_y, weight):
        start = time.perf_counter()
        time.sleep(self.input_s)
        out = super().input_grad(grad_y, weight)
        self.spans.append(("input gradient", start, time.perf_counter()))
        return out

    def weight_grad(self, grad_y, x, has_bias):
        start = time.perf_counter()
        time.sleep(self.weight_s)
        out = super().weight_grad(grad_y, x, has_bias)
        self.spans.append(("weight gradient", start, time.perf_counter()))
        return out


def backward_model(input_s: float, weight_s: float, comm_s: float, overlap: bool) -> float:
    """Seconds of the column-split layer's backward: t_I + C + t_W, or t_I + max(t_W, C) with overlap."""
    return input_s + (max(weight_s, comm_s) if overlap else comm_s + weight_s)


def overlap_study(input_s, weight_times, alpha, beta, tokens, width, repeats) -> dict:
    """Launched on N ranks: for each weight-gradient time, ``repeats`` backwards (after two warm-ups) of a
    (width -> width) column-split layer on (tokens, width) over ``Link(alpha, beta)``, in each order, the two
    orders alternating so that repeat k of each ran side by side.

    Returns {(weight_s, overlap): dict(steps, input_s, weight_s, comm_s, overruns, timeline)}: per repeat
    the backward's seconds and the measured seconds of the two products; the modelled all-reduce; the
    all-reduces gloo finished after the model; the last repeat's spans (seconds from its start).
    """
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = nn.Linear(width, width)  # the same on every rank
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1))  # (tokens, width)
    results = {}
    for weight_s in weight_times:
        layers = {
            o: SleepColumnParallelLinear(full, input_s, weight_s, async_input_grad=o, link=Link(alpha, beta))
            for o in (False, True)
        }
        for o in (False, True):
            results[weight_s, o] = dict(steps=[], input_s=[], weight_s=[], overruns=0, timeline=[])
        for i in range(2 + repeats):
            for overlap, layer in layers.items():
                row, link = results[weight_s, overlap], layer.link
                y = layer(x.clone().requires_grad_())  # (tokens, width / N)
                layer.spans.clear()
                link.records.clear()
                dist.barrier()
                start = time.perf_counter()
                y.sum().backward()  # the input gradient arrives all-reduced: the backward has waited for it
                if i < 2:
                    continue
                row["steps"].append(time.perf_counter() - start)
                took = {what: end - begin for what, begin, end in layer.spans}
                row["input_s"].append(took["input gradient"])
                row["weight_s"].append(took["weight gradient"])
                row["overruns"] += sum(r["overrun"] for r in link.records)
                (record,) = link.records
                row["comm_s"] = record["seconds"]
                row["timeline"] = [
                    dict(rank=rank, lane="compute", label=f"backward: {what}", start=b - start, end=e - start)
                    for what, b, e in layer.spans
                ] + [
                    dict(
                        rank=rank,
                        lane="comm",
                        label="all-reduce",
                        start=record["start"] - start,
                        end=record["end"] - start,
                    )
                ]
    return results


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, statistics.median(values), q3


def summarise_overlap(study: list[dict], weight_times) -> list[dict]:
    """One row per weight-gradient time of ``overlap_study``'s per-rank results, each repeat read on the slower
    rank: (q1, median, q3) of the synchronous and the overlapped backward, the model at the product times that
    repeat measured (its median), the paired difference sync - async of each repeat (q1, median, q3), the
    model's saving min(t_W, C) and whether it lies inside that difference's quartiles, and gloo's overruns."""
    rows = []
    for w in weight_times:
        comm = study[0][w, False]["comm_s"]
        steps, model = {}, {}
        for o in (False, True):
            steps[o] = [max(ts) for ts in zip(*(r[w, o]["steps"] for r in study))]
            per_rank = [
                [backward_model(i, t, comm, o) for i, t in zip(r[w, o]["input_s"], r[w, o]["weight_s"])] for r in study
            ]
            model[o] = statistics.median(max(ts) for ts in zip(*per_rank))
        saved = _quartiles([s - a for s, a in zip(steps[False], steps[True])])
        expected = min(w, comm)
        rows.append(
            dict(
                weight_s=w,
                comm_s=comm,
                sync=_quartiles(steps[False]),
                sync_model=model[False],
                overlap=_quartiles(steps[True]),
                overlap_model=model[True],
                saved=saved,
                saved_model=expected,
                consistent=saved[0] <= expected <= saved[2],
                overruns=sum(r[w, o]["overruns"] for r in study for o in (False, True)),
                repeats=len(steps[False]),
            )
        )
    return rows


def block_memory(d_model: int, n_heads: int, batch: int, seq: int, split: bool) -> dict:
    """Bytes of one GPT-2 block's parameters and saved activations on this rank (fp32, no dropout), with
    fused norms and GELU and the plain ("math") attention, as lesson 06 measures them. ``split=True`` (inside
    ``launch``) replaces its attention and MLP by their tensor-parallel shards."""
    torch.manual_seed(0)
    cfg = TransformerConfig.gpt2(
        vocab_size=64,
        d_model=d_model,
        n_layers=1,
        n_heads=n_heads,
        max_seq_len=seq,
        attn_impl="math",
        activation="gelu",
        fused=True,
        dropout=0.0,
    )
    block = CausalLM(cfg).transformer.blocks[0]
    if split:
        block.attn, block.mlp = ParallelAttention(block.attn), ParallelMLP(block.mlp)
    x = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with MemoryTracker(block) as tracker:
        block(x, causal=True).sum().backward()
    return dict(parameters=tracker.max_bytes("parameters"), activations=tracker.max_bytes("activations"))
