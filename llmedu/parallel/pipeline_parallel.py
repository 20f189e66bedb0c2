"""Pipeline parallelism: the layers cut into stages, micro-batches flowing through, any schedule run.

Stage s holds a contiguous run of blocks (the first also the embeddings, the last the final norm and the
output head). Its activations go to stage s+1 with ``send``/``recv``; in backward the gradient of those
activations comes back the same way. A batch is cut into m micro-batches so that stages can work at the
same time on different ones; the order of work on each rank is a schedule (``pipeline_schedules``:
naive, GPipe, 1F1B, interleaved 1F1B, ZB-H1, with their bubbles).

With interleaving (Narayanan et al. 2021, sec. 2.2.2) a rank holds v model chunks: chunk c of rank r is
global stage c*p + r of p*v (``stage_chunks``), so a micro-batch goes round the ranks v times; every
message carries a tag naming its micro-batch, stage and direction, so that sends and receives pair up
whatever order the ranks run them in.

Zero-bubble schedules (Qi et al. 2024) split the backward of a stage, y = f(x; W), in two:
    I  dL/dx = torch.autograd.grad(y, x, dL/dy, retain_graph=True)    the input gradient, sent on at once
    W  y.backward(dL/dy, inputs=parameters)                           the weight gradients, later
I keeps the graph; W walks it again from y, asking only for the parameters, and frees it. Autograd
runs only the nodes on a path to what was asked, so I skips the weight-gradient matmuls, but W
recomputes the gradients of the activations inside the stage (torch's ``stage_backward_weight`` keeps
them from I instead; we do not, for readability). On a language model's first stage (input: token
ids) I has nothing to compute. ``SleepStage`` puts known I and W times on separate paths.

Gradients are those of one process: the loss of each micro-batch is divided by m, and the gradients of
the m backwards add up in ``.grad``. With tied embeddings the first and the last stage each hold a copy
of the matrix, and their gradients are exchanged and added after backward (as Megatron-LM does).

Left out: sending shapes (every stage is told the activation shape), overlap of sends with compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..models.gpt import CausalLM
from ..models.transformer import Transformer
from .events import EventLog
from .pipeline_schedules import SCHEDULES, Action, bubble_fraction, schedule, simulate, theoretical_bubble

__all__ = ["PipelineStage", "stage_chunks", "partition", "Pipeline", "SleepStage"]
# the schedules moved to pipeline_schedules; these names stay importable from here
__all__ += ["SCHEDULES", "Action", "schedule", "simulate", "bubble_fraction", "theoretical_bubble"]


# -- cutting the model ---------------------------------------------------------------------------------------
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
    Unlike arithmetic, a sleep lasts as long on a machine shared with others."""

    def __init__(self, width: int, forward_s: float):
        super().__init__()
        self.linear, self.forward_s = nn.Linear(width, width), forward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, width) -> (rows, width)
        x = _Sleep.apply(x, self.forward_s, self.forward_s)  # on the input-gradient path
        weight = _Sleep.apply(self.linear.weight, 0.0, self.forward_s)  # on the weight-gradient path
        return torch.tanh(nn.functional.linear(x, weight, self.linear.bias))


# -- running a schedule --------------------------------------------------------------------------------------
class Pipeline:
    """Runs a schedule on this rank; ``ranks`` are the global ranks of the pipeline, in order.

    ``stage`` is this rank's module, or a list of its v chunks (chunk c: global stage c*p + index, see
    ``stage_chunks``) for the interleaved schedule. ``loss_fn(output, target)`` is used on the last
    stage. ``act_shape(micro_input)`` gives the shape of the activations that cross between stages
    (every stage is told, none is sent it).
    """

    def __init__(self, stage, ranks: list[int], loss_fn: Callable, act_shape: Callable, dtype=torch.float32):
        self.stage, self.ranks, self.loss_fn, self.act_shape, self.dtype = stage, list(ranks), loss_fn, act_shape, dtype
        self.chunks = list(stage) if isinstance(stage, (list, tuple, nn.ModuleList)) else [stage]
        me = dist.get_rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not among the pipeline's ranks {self.ranks}")
        self.index, self.n_stages = self.ranks.index(me), len(self.ranks)
        self.is_first, self.is_last = self.index == 0, self.index == self.n_stages - 1
        self.log = EventLog()
        self.peak_in_flight = 0  # the most (micro-batch, chunk) activations this rank held at once

    def _recv(self, shape, src: int, tag: int, label: str, device) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=self.dtype, device=device)
        with self.log.span("comm", label):
            dist.recv(buffer, src=src, tag=tag)
        return buffer

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, n_micro: int, schedule_name: str = "1f1b"):
        """Forward and backward of one batch in ``n_micro`` micro-batches; gradients land in ``.grad``.

        Every stage passes the same ``inputs`` and ``targets``. Returns the batch loss on the last
        stage (the mean of the micro-batch losses), None elsewhere.
        """
        if inputs.shape[0] % n_micro:
            raise ValueError(f"a batch of {inputs.shape[0]} cannot be cut into {n_micro} equal micro-batches")
        micro_in, micro_tg = inputs.chunk(n_micro), targets.chunk(n_micro)
        p, v, device = self.n_stages, len(self.chunks), inputs.device
        if v > 1 and p == 1:
            raise ValueError("interleaving needs at least 2 ranks (one rank would send to itself)")
        last = p * v - 1  # the last global stage

        def tag(i: int, to_stage: int, grad: bool) -> int:  # one number per message of this step
            return 2 * (i * (last + 1) + to_stage) + grad

        stash, sends, total = {}, [], torch.zeros((), device=device)
        self.peak_in_flight = 0
        for a in schedule(schedule_name, n_micro, p, self.index, v):
            i, c, g = a.micro, a.chunk, a.chunk * p + self.index  # g: the global stage
            shape = self.act_shape(micro_in[i])
            if a.kind == "F":
                if g == 0:  # a float input gets a gradient too, so that every stage's backward is alike
                    x = micro_in[i].detach().requires_grad_(micro_in[i].is_floating_point())
                else:
                    x = self._recv(shape, self.ranks[(g - 1) % p], tag(i, g, False), f"recv activation {a}", device)
                    x.requires_grad_()
                with self.log.span("compute", f"forward: {a}"):
                    y = self.chunks[c](x)
                    if g == last:
                        y = self.loss_fn(y, micro_tg[i]) / n_micro  # mean over micro-batches
                        total += y.detach()
                if g < last:
                    sends.append(dist.isend(y.detach(), dst=self.ranks[(g + 1) % p], tag=tag(i, g + 1, False)))
                stash[(i, c)] = (x, y, None)
                self.peak_in_flight = max(self.peak_in_flight, len(stash))
            elif a.kind in "BI":
                x, y, _ = stash[(i, c)]
                grad = None
                if g < last:
                    grad = self._recv(shape, self.ranks[(g + 1) % p], tag(i, g, True), f"recv gradient {a}", device)
                with self.log.span("compute", f"backward: {a}"):
                    if a.kind == "B":  # input and weight gradients at once; the graph is freed
                        y.backward(grad)
                        del stash[(i, c)]
                        grad_x = x.grad
                    else:  # the input gradient only; the graph is kept for W
                        grad_x = torch.autograd.grad(y, x, grad, retain_graph=True)[0] if x.requires_grad else None
                        stash[(i, c)] = (x, y, grad)
                if g > 0:
                    sends.append(dist.isend(grad_x, dst=self.ranks[(g - 1) % p], tag=tag(i, g - 1, True)))
            else:  # "W": the weight gradients, from the kept graph
                x, y, grad = stash.pop((i, c))
                with self.log.span("compute", f"weight: {a}"):
                    y.backward(grad, inputs=[q for q in self.chunks[c].parameters() if q.requires_grad])
        for work in sends:
            work.wait()
        self._exchange_tied_gradients()
        return total if self.is_last else None

    def _exchange_tied_gradients(self) -> None:
        """The first and the last stage add up the gradients of their two copies of a tied embedding."""
        # the first chunk of rank 0 or the last chunk of the last rank (two ranks at least: refused above)
        tied = [w for w in (getattr(ch, "tied_weight", lambda: None)() for ch in self.chunks) if w is not None]
        if not tied:
            return
        other = self.ranks[-1] if self.is_first else self.ranks[0]
        theirs = torch.empty_like(tied[0].grad)
        with self.log.span("comm", "tied embedding"):
            work = dist.isend(tied[0].grad.clone(), dst=other)
            dist.recv(theirs, src=other)
            work.wait()
        tied[0].grad += theirs
