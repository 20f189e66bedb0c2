"""Pipeline stages: a model cut into contiguous runs of blocks, one per rank (or v chunks per rank).

Stage s of p holds blocks ``partition(costs, p)[s]``, the first stage also the embeddings, the last
the final norm and the output head. ``partition`` chooses the cuts that minimise the most expensive
stage (dynamic programming over prefix sums). With interleaving (Narayanan et al. 2021, sec. 2.2.2) a
rank holds v model chunks: chunk c of rank r is global stage c*p + r of p*v (``stage_chunks``).
With tied embeddings the last stage holds a copy of the embedding matrix; ``Pipeline`` adds the two
copies' gradients after backward (as Megatron-LM does). ``SleepStage`` is a stage of known duration,
for timing schedules on a shared machine.

``Pipeline`` (pipeline_parallel.py) runs any schedule over these stages.

Left out: T5-style relative bias, segment embeddings and an embedding norm (refused), and balancing by
measured time (costs are layer or parameter counts).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..models.gpt import CausalLM
from ..models.transformer import Transformer

__all__ = ["partition", "PipelineStage", "stage_chunks", "SleepStage"]


def partition(costs: list[float], n_stages: int) -> list[range]:
    """Contiguous runs of items, one per stage, minimising the most expensive stage (dynamic programming)."""
    n = len(costs)
    if n < n_stages:
        raise ValueError(f"{n} layers cannot fill {n_stages} pipeline stages (each needs at least one)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][j]: the smallest possible maximum stage cost putting the first j items on k stages
    best = [[float("inf")] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):  # the last stage holds items i .. j-1
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    bounds, j = [], n
    for k in range(n_stages, 0, -1):
        bounds.append(range(cut[k][j], j))
        j = cut[k][j]
    return bounds[::-1]


class PipelineStage(nn.Module):
    """Stage ``stage`` of ``n_stages`` of a ``CausalLM`` (or of its tensor-parallel version).

    ``balance="layers"`` gives every stage the same number of blocks (the number must divide);
    ``"parameters"`` balances parameter counts, the embeddings counted on the first stage and the
    head on the last. Parameters keep their names relative to the full model (see ``full_name``).
    The stage takes its modules from ``model`` (no copy): build a fresh model for each stage.
    """

    # Transformer's own methods for before and after the blocks (a method is just a function on its
    # class); they read config, pos_bias, tok_embed, type_embed, pos_embed, embed_norm, drop, final_norm
    embed = Transformer.embed
    attention_inputs = Transformer.attention_inputs
    apply_final_norm = Transformer.apply_final_norm

    def __init__(self, model: CausalLM, stage: int, n_stages: int, balance: str = "layers"):
        super().__init__()
        c, t = model.config, model.transformer
        if not 0 <= stage < n_stages:
            raise ValueError(f"stage must be in [0, {n_stages}), got {stage}")
        if c.position == "relative" or c.type_vocab_size or c.embedding_norm:
            raise ValueError("pipeline stages support GPT/LLaMA-style models (no T5 bias, segments or embedding norm)")
        if balance == "layers":
            if c.n_layers % n_stages:
                raise ValueError(
                    f"{c.n_layers} layers cannot be divided into {n_stages} equal stages "
                    "(change n_layers or use balance='parameters')"
                )
            costs = [1.0] * c.n_layers
        elif balance == "parameters":
            costs = [float(sum(p.numel() for p in b.parameters())) for b in t.blocks]
            costs[0] += sum(p.numel() for p in [*t.tok_embed.parameters(), *(t.pos_embed or nn.Module()).parameters()])
            costs[-1] += 0 if c.tie_embeddings else model.lm_head.weight.numel()
        else:
            raise ValueError(f"balance must be 'layers' or 'parameters', got {balance!r}")
        self.config, self.stage, self.n_stages = c, stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.layers = partition(costs, n_stages)[stage]
        self.blocks = nn.ModuleDict({str(i): t.blocks[i] for i in self.layers})
        self.pos_bias = t.pos_bias  # ALiBi has no parameters: every stage can build it
        if self.is_first:
            self.tok_embed, self.pos_embed, self.drop = t.tok_embed, t.pos_embed, t.drop
            self.type_embed, self.embed_norm = t.type_embed, t.embed_norm  # None: refused above
        if self.is_last:
            self.final_norm, self.lm_head = t.final_norm, model.lm_head
            if c.tie_embeddings and not self.is_first:  # a copy of the embedding, kept equal by gradient exchange
                shared = self.lm_head.weight
                self.lm_head.weight = nn.Parameter(shared.detach().clone())
                self.lm_head.weight.tp_dim = getattr(shared, "tp_dim", None)  # split as the original (under TP)

    def tied_weight(self) -> nn.Parameter | None:
        """The copy of the tied embedding this stage must exchange gradients for (None: nothing to do)."""
        if not self.config.tie_embeddings or self.n_stages == 1 or not (self.is_first or self.is_last):
            return None
        return self.tok_embed.weight if self.is_first else self.lm_head.weight

    @staticmethod
    def full_name(name: str) -> str:
        """This stage's parameter name -> the name in the full ``CausalLM``."""
        return name if name.startswith("lm_head") else "transformer." + name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: ids (B, T); others: hidden (B, T, d). Last stage: logits; others: hidden."""
        if self.is_first:
            x = self.embed(x)  # (B, T, d)
        mask, rope = self.attention_inputs(x)  # positions 0..T-1: no cache, no padding
        for i, block in self.blocks.items():
            x = block(x, causal=self.config.causal, attn_mask=mask, rope=rope, layer=int(i))  # (B, T, d)
        if self.is_last:
            x = self.lm_head(self.apply_final_norm(x))  # (B, T, V)
        return x


def stage_chunks(model: CausalLM, rank: int, n_ranks: int, n_chunks: int = 1, balance: str = "layers") -> nn.ModuleList:
    """The ``n_chunks`` model chunks of ``rank`` for an interleaved pipeline: chunk c is global stage
    c * n_ranks + rank of n_ranks * n_chunks (one chunk: the plain stage)."""
    if n_chunks < 1:
        raise ValueError(f"n_chunks (virtual stages per rank) must be >= 1, got {n_chunks}")
    if balance == "layers" and model.config.n_layers % (n_ranks * n_chunks):
        raise ValueError(
            f"{model.config.n_layers} layers cannot be cut into {n_ranks} ranks x {n_chunks} chunks = "
            f"{n_ranks * n_chunks} equal chunks"
        )
    return nn.ModuleList(PipelineStage(model, c * n_ranks + rank, n_ranks * n_chunks, balance) for c in range(n_chunks))


class _Sleep(torch.autograd.Function):
    """Identity that takes a fixed time: ``forward_s`` in forward, ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepStage(nn.Module):
    """A stage of known duration for measuring schedules: tanh(x W^T + b) and sleeps of ``forward_s`` in
    forward, in the input gradient and in the weight gradient (a whole backward: twice forward). The
    sleeps sit on the input's and on the weight's path, so that a split backward (I, W) takes one each.
    Unlike arithmetic, a sleep lasts at least its set time on a machine shared with others."""

    def __init__(self, width: int, forward_s: float):
        super().__init__()
        self.linear, self.forward_s = nn.Linear(width, width), forward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, width) -> (rows, width)
        x = _Sleep.apply(x, self.forward_s, self.forward_s)  # on the input-gradient path
        weight = _Sleep.apply(self.linear.weight, 0.0, self.forward_s)  # on the weight-gradient path
        return torch.tanh(nn.functional.linear(x, weight, self.linear.bias))
