"""The measurements of the tensor-parallel lesson (12): overlap on a link of known speed, memory per rank.

The algorithm lives in ``tensor_parallel.py``; this file only times it and weighs it.

Overlap. A column-split layer with f inside (``ColumnParallelLinear``) computes, in backward, the input
gradient, launches its all-reduce, and computes the weight gradient either after the all-reduce has
finished (synchronous) or while it runs (``async_input_grad=True``, Megatron-LM's order). With the input
gradient taking ``t_I`` seconds, the weight gradient ``t_W`` and the all-reduce ``C``, the backward takes

    synchronous   t_I + C + t_W
    async         t_I + max(t_W, C)          so the overlap saves min(t_W, C)

(``backward_model``). To make both sides known on a shared CPU, ``SleepColumnParallelLinear`` sleeps a
fixed time in each gradient product (and then computes it, so the gradients stay right), as lesson 11's
``SleepStage`` does, and a ``Link`` (``link.py``) gives the all-reduce the alpha-beta time of lesson 10.

Memory. ``block_memory`` runs one transformer block (unsplit, or its attention and MLP replaced by
``ParallelAttention`` and ``ParallelMLP``) under ``MemoryTracker`` (lesson 06) and returns the bytes of
parameters and of the tensors autograd saved for backward, on this rank.

Left out: the forward (g's all-reduce, which nothing can hide here), and the noise of real arithmetic,
on purpose.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ..memory.tracker import MemoryTracker
from ..models import CausalLM, TransformerConfig
from .link import Link
from .tensor_parallel import ColumnParallelLinear, ParallelAttention, ParallelMLP

__all__ = ["SleepColumnParallelLinear", "backward_model", "overlap_study", "block_memory"]


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
    """Launched on N ranks: for each weight-gradient time and each order, ``repeats`` backwards (after two
    warm-ups) of a (width -> width) column-split layer on (tokens, width) over ``Link(alpha, beta)``.

    Returns {(weight_s, overlap): dict(steps, input_s, weight_s, comm_s, overruns, timeline)}: per repeat
    the backward's seconds and the measured seconds of the two products; the modelled all-reduce; the
    all-reduces gloo finished after the model; the last repeat's spans (seconds from its start).
    """
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = nn.Linear(width, width)  # the same on every rank
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1))
    results = {}
    for weight_s in weight_times:
        for overlap in (False, True):
            link = Link(alpha, beta)
            layer = SleepColumnParallelLinear(full, input_s, weight_s, async_input_grad=overlap, link=link)
            row = dict(steps=[], input_s=[], weight_s=[], overruns=0, timeline=[])
            for i in range(2 + repeats):
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
            results[weight_s, overlap] = row
    return results


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
