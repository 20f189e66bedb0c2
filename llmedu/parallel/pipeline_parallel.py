"""Pipeline parallelism: the layers cut into stages, one stage per rank, micro-batches flowing through.

Stage s holds a contiguous run of blocks (the first also the embeddings, the last the final norm and the
output head). Its activations go to stage s+1 with ``send``/``recv``; in backward the gradient of those
activations comes back the same way. A batch is cut into m micro-batches so that stages can work at the
same time on different ones. Three schedules, each a list of ("F", i) / ("B", i) actions per stage:

    naive   F0 B0 F1 B1 ...: one micro-batch in the whole pipe at a time; p - 1 of p stages always idle
    GPipe   F0 .. F(m-1), then B0 .. B(m-1)                               (Huang et al. 2019)
    1F1B    p - s - 1 warm-up forwards, then alternate one forward and one backward, then drain
            (PipeDream-Flush; Narayanan et al. 2021, sec. 2.2)

GPipe and 1F1B take equally long: with equal stages of forward t_f and backward t_b, a step lasts
(m + p - 1)(t_f + t_b) of which each stage is busy m (t_f + t_b), an idle "bubble" of

    bubble = (p - 1) / (m + p - 1)                                        (GPipe, sec. 2.2)

They differ in memory: GPipe holds the activations of all m micro-batches at the turn from forward
to backward; 1F1B starts each backward as soon as it can, so stage s holds at most p - s.
Gradients are those of one process: the loss of each micro-batch is divided by m, and the gradients of
the m backwards add up in ``.grad``. With tied embeddings the first and the last stage each hold a copy
of the matrix, and their gradients are exchanged and added after backward (as Megatron-LM does).

Left out: interleaved stages (virtual pipelines), zero-bubble schedules, sending shapes (every stage
is told the activation shape), overlap of sends with compute beyond non-blocking ``isend``.
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

__all__ = [
    "SCHEDULES",
    "schedule",
    "partition",
    "PipelineStage",
    "Pipeline",
    "SleepStage",
    "bubble_fraction",
    "theoretical_bubble",
]


# -- schedules: what each stage does, in order --------------------------------------------------------------
def _naive(m: int, p: int, s: int) -> list[tuple[str, int]]:
    return [a for i in range(m) for a in (("F", i), ("B", i))]


def _gpipe(m: int, p: int, s: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def _one_f_one_b(m: int, p: int, s: int) -> list[tuple[str, int]]:
    warmup = min(p - s - 1, m)  # forwards in flight before the first backward reaches this stage
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warmup, m)]  # cool-down: drain the backwards


SCHEDULES: dict[str, Callable[[int, int, int], list[tuple[str, int]]]] = {
    "naive": _naive,
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
}


def schedule(name: str, n_micro: int, n_stages: int, stage: int) -> list[tuple[str, int]]:
    """The actions of ``stage`` (of ``n_stages``) for ``n_micro`` micro-batches under schedule ``name``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {sorted(SCHEDULES)}")
    if n_micro < 1 or not 0 <= stage < n_stages:
        raise ValueError(f"need n_micro >= 1 and 0 <= stage < n_stages, got {n_micro}, {stage}, {n_stages}")
    return SCHEDULES[name](n_micro, n_stages, stage)


def theoretical_bubble(n_stages: int, n_micro: int) -> float:
    return (n_stages - 1) / (n_micro + n_stages - 1)


def bubble_fraction(events: list[dict]) -> float:
    """Measured idle share: 1 - (compute time of a rank) / (time from first start to last end), averaged."""
    t0, t1 = min(e["start"] for e in events), max(e["end"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    busy = [sum(e["end"] - e["start"] for e in events if e["rank"] == r and e["lane"] == "compute") for r in ranks]
    return 1.0 - sum(busy) / (len(ranks) * (t1 - t0))


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
    """A stage of known duration for measuring schedules: tanh(linear(x)), then a sleep of ``forward_s``
    (twice that in backward). Unlike arithmetic, a sleep lasts as long on a machine shared with others."""

    def __init__(self, width: int, forward_s: float):
        super().__init__()
        self.linear, self.forward_s = nn.Linear(width, width), forward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, width) -> (rows, width)
        return _Sleep.apply(torch.tanh(self.linear(x)), self.forward_s, 2 * self.forward_s)


# -- running a schedule --------------------------------------------------------------------------------------
class Pipeline:
    """Runs a schedule on this rank's ``stage``; ``ranks`` are the global ranks of the stages, in order.

    ``loss_fn(output, target)`` is used on the last stage. ``act_shape(micro_input)`` gives the shape
    of the activations that cross between stages (every stage is told, none is sent it).
    """

    def __init__(self, stage: nn.Module, ranks: list[int], loss_fn: Callable, act_shape: Callable, dtype=torch.float32):
        self.stage, self.ranks, self.loss_fn, self.act_shape, self.dtype = stage, list(ranks), loss_fn, act_shape, dtype
        me = dist.get_rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not among the pipeline's ranks {self.ranks}")
        self.index, self.n_stages = self.ranks.index(me), len(self.ranks)
        self.is_first, self.is_last = self.index == 0, self.index == self.n_stages - 1
        self.log = EventLog()
        self.peak_in_flight = 0  # the most micro-batches whose activations this stage held at once

    def _recv(self, shape, src: int, label: str, device) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=self.dtype, device=device)
        with self.log.span("comm", label):
            dist.recv(buffer, src=src)
        return buffer

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, n_micro: int, schedule_name: str = "1f1b"):
        """Forward and backward of one batch in ``n_micro`` micro-batches; gradients land in ``.grad``.

        Every stage passes the same ``inputs`` and ``targets``. Returns the batch loss on the last
        stage (the mean of the micro-batch losses), None elsewhere.
        """
        if inputs.shape[0] % n_micro:
            raise ValueError(f"a batch of {inputs.shape[0]} cannot be cut into {n_micro} equal micro-batches")
        micro_in, micro_tg = inputs.chunk(n_micro), targets.chunk(n_micro)
        prev = None if self.is_first else self.ranks[self.index - 1]
        nxt = None if self.is_last else self.ranks[self.index + 1]
        device = inputs.device
        stash, sends, total = {}, [], torch.zeros((), device=device)
        self.peak_in_flight = 0
        for kind, i in schedule(schedule_name, n_micro, self.n_stages, self.index):
            shape = self.act_shape(micro_in[i])
            if kind == "F":
                x = micro_in[i] if self.is_first else self._recv(shape, prev, f"recv activation {i}", device)
                x.requires_grad_(not self.is_first)
                with self.log.span("compute", f"forward: F{i}"):
                    y = self.stage(x)
                    if self.is_last:
                        y = self.loss_fn(y, micro_tg[i]) / n_micro  # mean over micro-batches
                        total += y.detach()
                if not self.is_last:
                    sends.append(dist.isend(y.detach(), dst=nxt))
                stash[i] = (x, y)
                self.peak_in_flight = max(self.peak_in_flight, len(stash))
            else:
                x, y = stash.pop(i)
                grad = None if self.is_last else self._recv(shape, nxt, f"recv gradient {i}", device)
                with self.log.span("compute", f"backward: B{i}"):
                    y.backward(grad)
                if not self.is_first:
                    sends.append(dist.isend(x.grad, dst=prev))
        for work in sends:
            work.wait()
        self._exchange_tied_gradients()
        return total if self.is_last else None

    def _exchange_tied_gradients(self) -> None:
        """First and last stage add up the gradients of their two copies of a tied embedding."""
        tied = getattr(self.stage, "tied_weight", lambda: None)()
        if tied is None:
            return
        other = self.ranks[-1] if self.is_first else self.ranks[0]
        theirs = torch.empty_like(tied.grad)
        with self.log.span("comm", "tied embedding"):
            work = dist.isend(tied.grad.clone(), dst=other)
            dist.recv(theirs, src=other)
            work.wait()
        tied.grad += theirs
