"""Pipeline parallelism: the layers cut into stages, micro-batches flowing through, any schedule run.

Stage s holds a contiguous run of blocks (``pipeline_stages``). A batch is cut into m micro-batches so
that stages can work at the same time on different ones. For each micro-batch, stage s receives the
activation of stage s-1, runs its blocks and sends the result to stage s+1; in backward, the gradient
of that activation comes back the same way. The order of this work on each rank is a schedule
(``pipeline_schedules``: naive, GPipe, 1F1B, interleaved 1F1B, ZB-H1); ``Pipeline.step`` runs any of them.
With interleaving a rank holds v chunks: chunk c of rank r is global stage c*p + r of p*v.

Zero-bubble schedules (Qi et al. 2024) split the backward of a stage, y = f(x; W), in two:
    I  dL/dx = torch.autograd.grad(y, x, dL/dy, retain_graph=True)    the input gradient, sent on at once
    W  y.backward(dL/dy, inputs=parameters)                           the weight gradients, later
I keeps the graph; W walks it again from y, asking only for the parameters, and frees it. Autograd
runs only the nodes on a path to what was asked, so I skips the weight-gradient matmuls, but W
recomputes the gradients of the activations inside the stage (torch's ``stage_backward_weight`` keeps
them from I instead; we do not, for readability). On a language model's first stage (input: token
ids) I has nothing to compute.

Gradients are those of one process: the loss of each micro-batch is divided by m, and the gradients of
the m backwards add up in ``.grad``. Messages between two ranks are matched by the order they are posted
in, not by tag (as NCCL matches them): every rank posts its messages, through a ``Mailbox`` (p2p.py), in
the order ``message_order`` derives from the schedule, each direction in one order on both ranks, and
a receive before a send at a tie, so that no receive is posted later than its message is sent.

Sends leave without waiting (``isend``): the rank computes while its message travels, and it posts its
next receives early, so that an incoming message can travel meanwhile too. ``overlap=False`` waits for
each send instead, as a blocking ``dist.send`` would; ``link=Link(alpha, beta)`` gives every message a
known time (link.py), so that the time a pipeline hides can be measured (``pipeline_study``).

Left out: sending shapes (every stage is told the activation shape), and a separate stream per
direction (a GPU's copy engines; NCCL would need it for this order of posts, see ``message_order``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .events import EventLog
from .p2p import Mailbox, post
from .pipeline_schedules import (
    SCHEDULES,
    Action,
    Message,
    bubble_fraction,
    message_order,
    schedule,
    simulate,
    theoretical_bubble,
)
from .pipeline_stages import PipelineStage, SleepStage, partition, stage_chunks

__all__ = ["Pipeline"]
# the stages and the schedules live in their own files; these names stay importable from here
__all__ += ["PipelineStage", "stage_chunks", "partition", "SleepStage"]
__all__ += ["SCHEDULES", "Action", "schedule", "simulate", "bubble_fraction", "theoretical_bubble"]


class Pipeline:
    """Runs a schedule on this rank; ``ranks`` are the global ranks of the pipeline, in order.

    ``stage`` is this rank's module, or a list of its v chunks (chunk c: global stage c*p + index, see
    ``stage_chunks``) for the interleaved schedule. ``loss_fn(output, target)`` is used on the last
    stage. ``act_shape(micro_input)`` gives the shape of the activations that cross between stages
    (every stage is told, none is sent it). ``link``: a ``Link`` that carries (and times) the messages
    between stages; ``overlap=False``: each send holds the rank until it has left.
    """

    def __init__(
        self,
        stage,
        ranks: list[int],
        loss_fn: Callable,
        act_shape: Callable,
        dtype=torch.float32,
        *,
        link=None,
        overlap: bool = True,
    ):
        self.stage, self.ranks, self.loss_fn, self.act_shape, self.dtype = stage, list(ranks), loss_fn, act_shape, dtype
        self.link, self.overlap = link, overlap  # what carries the messages; whether sends overlap compute
        self.chunks = list(stage) if isinstance(stage, (list, tuple, nn.ModuleList)) else [stage]
        self.index, self.n_stages = _my_index(self.ranks), len(self.ranks)  # this rank's place in the pipeline
        self.is_first, self.is_last = self.index == 0, self.index == self.n_stages - 1
        self.log = EventLog()  # compute and comm spans, for timelines
        self.peak_in_flight = 0  # the most (micro-batch, chunk) activations this rank held at once
        self.posts: list = []  # the last step's operations, in the order posted: (direction, peer, Message)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, n_micro: int, schedule_name: str = "1f1b"):
        """Forward and backward of one batch in ``n_micro`` micro-batches; gradients land in ``.grad``.

        Every stage passes the same ``inputs`` and ``targets``. Returns the batch loss on the last
        stage (the mean of the micro-batch losses), None elsewhere.
        """
        _check_step(self, inputs, n_micro, schedule_name)  # every rank cuts the step alike, or a clear error
        micro_in, micro_tg = inputs.chunk(n_micro), targets.chunk(n_micro)
        p, v, last = self.n_stages, len(self.chunks), self.n_stages * len(self.chunks) - 1  # last: global stage
        mail = Mailbox(  # this step's messages, posted in the one order every rank derives from the schedule
            [(kind, self.ranks[q], m) for kind, q, m in message_order(schedule_name, n_micro, p, self.index, v)],
            new_buffer=lambda m: torch.empty(self.act_shape(micro_in[m.micro]), dtype=self.dtype, device=inputs.device),
            log=self.log,
            post=self.link.post if self.link is not None else None,
            blocking_sends=not self.overlap,
        )
        stash, total = {}, torch.zeros((), dtype=self.dtype, device=inputs.device)  # the loss in the run's dtype
        self.peak_in_flight = 0
        for a in schedule(schedule_name, n_micro, p, self.index, v):
            i, c, g = a.micro, a.chunk, a.chunk * p + self.index  # g: the global stage
            if a.kind == "F":
                if g == 0:  # a float input gets a gradient too, so that every stage's backward is alike
                    x = micro_in[i].detach().requires_grad_(micro_in[i].is_floating_point())
                else:
                    x = mail.recv(Message(i, g, grad=False)).requires_grad_()
                with self.log.span("compute", f"forward: {a}"):
                    y = self.chunks[c](x)
                    if g == last:
                        y = self.loss_fn(y, micro_tg[i]) / n_micro  # mean over micro-batches
                        total += y.detach()
                if g < last:
                    mail.send(Message(i, g + 1, grad=False), y.detach())
                stash[(i, c)] = (x, y, None)
                self.peak_in_flight = max(self.peak_in_flight, len(stash))
            elif a.kind in "BI":
                x, y, _ = stash[(i, c)]
                grad = mail.recv(Message(i, g, grad=True)) if g < last else None  # the last stage: from the loss
                with self.log.span("compute", f"backward: {a}"):
                    if a.kind == "B":  # input and weight gradients at once; the graph is freed
                        y.backward(grad)
                        del stash[(i, c)]
                        grad_x = x.grad
                    else:  # the input gradient only; the graph is kept for W
                        grad_x = torch.autograd.grad(y, x, grad, retain_graph=True)[0] if x.requires_grad else None
                        stash[(i, c)] = (x, y, grad)
                if g > 0:
                    mail.send(Message(i, g - 1, grad=True), grad_x)
            else:  # "W": the weight gradients, from the kept graph
                x, y, grad = stash.pop((i, c))
                with self.log.span("compute", f"weight: {a}"):
                    y.backward(grad, inputs=[q for q in self.chunks[c].parameters() if q.requires_grad])
        mail.wait_for_sends()
        self.posts = mail.posts
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
            for handle in post([(tied[0].grad.clone(), other)], [(theirs, other)]):  # both at once
                handle.wait()
        tied[0].grad += theirs


# -- guards: what must hold before a step runs ---------------------------------------------------------------
def _my_index(ranks: list[int]) -> int:
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not among the pipeline's ranks {ranks}")
    return ranks.index(me)


def _check_step(pipe: Pipeline, inputs: torch.Tensor, n_micro: int, schedule_name: str) -> None:
    """Every rank of the pipeline must cut the step alike: ranks that cut different numbers of micro-batches
    would pair messages of different sizes (gloo: "data size doesn't match") or wait for ever. Each rank
    first sends its choices to every other rank (one small message each), so all raise the same error."""
    names, fields = sorted(SCHEDULES), ("n_micro", "batch size", "chunks per rank", "schedule")
    mine = [n_micro, inputs.shape[0], len(pipe.chunks), names.index(schedule_name) if schedule_name in names else -1]
    mine = torch.tensor(mine, device=inputs.device)
    others = {r: torch.empty_like(mine) for r in pipe.ranks if r != dist.get_rank()}
    for handle in post([(mine, r) for r in others], [(theirs, r) for r, theirs in others.items()]):
        handle.wait()
    every = {r: dict(zip(fields, others.get(r, mine).tolist())) for r in pipe.ranks}
    for values in every.values():
        values["schedule"] = repr(names[values["schedule"]]) if values["schedule"] >= 0 else "unknown"
    differ = [f for f in fields if len({values[f] for values in every.values()}) > 1]
    if differ:
        per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{f}={v[f]}" for f in differ) for r, v in every.items())
        raise ValueError(
            f"the pipeline's ranks cut the step differently ({per_rank}): call Pipeline.step with the same "
            "batch size, n_micro and schedule on every rank, and give every rank the same number of chunks"
        )
    if inputs.shape[0] % n_micro:
        raise ValueError(f"a batch of {inputs.shape[0]} cannot be cut into {n_micro} equal micro-batches")
    if len(pipe.chunks) > 1 and pipe.n_stages == 1:
        raise ValueError("interleaving needs at least 2 ranks (one rank would send to itself)")
