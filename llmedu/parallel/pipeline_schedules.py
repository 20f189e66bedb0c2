"""Pipeline schedules: which forward and backward each rank runs, in what order, and what it costs.

A schedule is, for every rank, a list of actions ``Action(kind, micro, chunk)``:

    F  forward of micro-batch ``micro`` through model chunk ``chunk`` of this rank
    B  its whole backward (input and weight gradients together)
    I  the input-gradient half of B only (what the previous stage waits for)
    W  the weight-gradient half of B only (nobody waits for it: it can be run later)

With ``v`` chunks per rank ("virtual stages"), chunk c of rank r is global stage ``c*p + r`` of
``p*v``: a micro-batch goes round the ranks v times. Five schedules:

    naive        F0 B0 F1 B1 ...: one micro-batch in the pipe at a time
    gpipe        all forwards, then all backwards                            (Huang et al. 2019)
    1f1b         p-r-1 warm-up forwards, then one F and one B alternately    (Narayanan et al. 2021, 2.2.1)
    interleaved  1F1B over v chunks per rank, micro-batches in groups of p   (Narayanan et al. 2021, 2.2.2)
    zb-h1        1F1B with B split into I and W; rank r runs its first r backwards as I alone and
                 keeps their W for the drain (as torch.distributed.pipelining) (Qi et al. 2024, sec. 2.1)

**Bubble, one definition throughout**: the idle share of the step, 1 - busy / (p x step time), the
same quantity ``bubble_fraction`` measures from recorded events. With equal stages (forward t_f,
backward t_b = 2 t_f, on one rank per micro-batch and stage) and free communication:

    gpipe, 1f1b   (p-1)(t_f+t_b) idle in a step of (m+p-1)(t_f+t_b):  (p-1) / (m+p-1)
    interleaved   chunks are 1/v as long, and the ramp-up and drain cross p-1 chunks, not p-1
                  stages: idle (p-1)(t_f+t_b)/v, which is Narayanan's (p-1)/(v m) *of the ideal
                  time* m(t_f+t_b); as a share of the step:             (p-1) / (v m + p-1)
    zb-h1         t_F = t_B = t_W = t (B: input gradient, W: weight gradient), m >= p. In 1F1B a
                  stage idles (p-1)(t_F + t_B + t_W) = 3(p-1)t: the whole backward of a micro-batch
                  crosses the p-1 later stages before stage 0 can start its own. In ZB-H1 only I
                  crosses stages: stage 0 runs p forwards, F0 reaches the last stage at p t and I0
                  is back at stage 0 at (2p-1) t, an idle (p-1) t; rank r keeps r of its W for the
                  drain, where they fill the gaps while the last I's travel up, so no stage idles
                  again: (p-1)t, a third of 1F1B's (Qi et al. sec. 2.1, Fig. 3; their "bubble rate"
                  (p-1)/(3m) is relative to the ideal 3mt), in a step of 3mt + (p-1)t:
                                                                        (p-1) / (3m + p-1)
                  (peak memory as 1F1B's: every rank holds at most p micro-batches until their W)

**Messages**: a forward sends its activation to the next stage, a backward (B or I) its input gradient
to the one before. ``message_order`` gives each rank the order in which it posts its messages: in each
direction between two ranks both post them in one order (sends and receives are paired by that order
alone, not by tag, as NCCL pairs them), and at a tie a rank posts its receive before its send.

``simulate`` runs any schedule with given action times (free communication unless given a latency
per message; sends overlapped with compute, or ``blocking`` their rank until delivered) and refuses a schedule that cannot run (a stage waiting for work that comes after it).
With free communication its step times equal the formulas above
(tests/test_parallel_pipeline_schedules.py). Left out: ZB-H2 and ZB-V (more memory or a V-shaped
layout for zero bubble), Megatron's rule for m not a multiple of p in the interleaved schedule, and
communication in the formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = [
    "Action",
    "SCHEDULES",
    "schedule",
    "simulate",
    "theoretical_bubble",
    "bubble_fraction",
    "Message",
    "message_order",
]


class Action(NamedTuple):
    kind: str  # "F", "B", "I" or "W"
    micro: int
    chunk: int = 0

    def __str__(self) -> str:  # F3, or F3.1 for chunk 1
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def _naive(m: int, p: int, r: int, v: int) -> list[Action]:
    return [Action(k, i) for i in range(m) for k in "FB"]


def _gpipe(m: int, p: int, r: int, v: int) -> list[Action]:
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def _one_f_one_b(m: int, p: int, r: int, v: int) -> list[Action]:
    warmup = min(p - r - 1, m)  # forwards in flight before the first backward reaches this stage
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        actions += [Action("F", warmup + i), Action("B", i)]
    return actions + [Action("B", i) for i in range(m - warmup, m)]  # cool-down: drain the backwards


def _interleaved(m: int, p: int, r: int, v: int) -> list[Action]:
    def nth(k: int, backward: bool) -> Action:  # the k-th forward (backward) of this rank
        group, within = divmod(k, p * v)  # p micro-batches at a time go through all v chunks
        chunk = within // p
        return Action("B" if backward else "F", group * p + within % p, v - 1 - chunk if backward else chunk)

    total = m * v
    # forwards before the first backward (Megatron-LM's count): p forwards for each of the v-1 later
    # chunks, and for chunk 0 two per later rank, not one (Megatron gives no reason; our reading: a late
    # message can then wait in a queue instead of stalling this rank); free communication: the same bubble
    warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
    actions = [nth(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [nth(warmup + k, False), nth(k, True)]
    return actions + [nth(k, True) for k in range(total - warmup, total)]


def _zb_h1(m: int, p: int, r: int, v: int) -> list[Action]:
    held = r  # rank r runs its first r backwards as I alone and keeps their W for the drain
    actions = []
    for a in _one_f_one_b(m, p, r, 1):
        if a.kind == "F":
            actions.append(a)
        else:
            actions.append(Action("I", a.micro))
            if a.micro >= held:  # from then on each I is followed by the oldest W still owed
                actions.append(Action("W", a.micro - held))
    return actions + [Action("W", i) for i in range(max(m - held, 0), m)]


SCHEDULES: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "naive": _naive,
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved": _interleaved,
    "zb-h1": _zb_h1,
}


def schedule(name: str, n_micro: int, n_stages: int, stage: int, n_chunks: int = 1) -> list[Action]:
    """The actions of rank ``stage`` of ``n_stages`` for ``n_micro`` micro-batches; ``n_chunks`` model
    chunks per rank (only "interleaved" takes more than one)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {sorted(SCHEDULES)}")
    if n_micro < 1 or not 0 <= stage < n_stages:
        raise ValueError(f"need n_micro >= 1 and 0 <= stage < n_stages, got {n_micro}, {stage}, {n_stages}")
    if n_chunks < 1:
        raise ValueError(f"n_chunks (virtual stages per rank) must be >= 1, got {n_chunks}")
    if name != "interleaved" and n_chunks != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank, got n_chunks={n_chunks}")
    if name == "interleaved" and n_micro % n_stages:
        raise ValueError(
            f"the interleaved schedule needs n_micro a multiple of the number of ranks (as Megatron-LM "
            f"does): micro-batches go round the ranks in groups of {n_stages}, got n_micro={n_micro}"
        )
    return SCHEDULES[name](n_micro, n_stages, stage, n_chunks)


def simulate(
    per_rank: list[list[Action]], times: dict | list[dict] | None = None, latency: float = 0.0, blocking: bool = False
) -> list[dict]:
    """Run the ranks' action lists with durations ``times`` (default F 1, B 2, I 1, W 1; a list of such
    dicts gives each rank its own), each message between stages arriving ``latency`` after it is sent;
    each action starts once its rank is free and its inputs have arrived. ``blocking``: a send holds its
    rank until the message has arrived (no overlap of sends with compute; a "comm" event each), else it
    leaves at once. Returns events (rank, lane, label, start, end) as ``Pipeline`` records them;
    ValueError if the lists are not a valid schedule (an action twice, a backward before its forward,
    or ranks waiting on each other).
    """
    return _simulate(per_rank, times, latency, blocking)[0]


def _simulate(
    per_rank, times=None, latency=0.0, blocking=False
) -> tuple[list[dict], dict[tuple[str, int, int], float]]:
    """``simulate``'s events, and the end time of every action as {(kind, micro, global stage): time}."""
    p = len(per_rank)
    default = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    if isinstance(times, (list, tuple)):
        if len(times) != p:
            raise ValueError(f"times gives {len(times)} ranks their durations, but the schedule has {p} ranks")
        durations = [{**default, **t} for t in times]
    else:
        durations = [{**default, **(times or {})}] * p
    last = p * (1 + max(a.chunk for actions in per_rank for a in actions)) - 1  # the last global stage
    grad_kind = {}  # (micro, global stage) -> "B" or "I": the action that sends the input gradient
    for r, actions in enumerate(per_rank):
        for n, a in enumerate(actions):
            before = {"F": None, "B": "F", "I": "F", "W": "I"}[a.kind]
            if a in actions[:n]:
                raise ValueError(f"rank {r} runs {a} twice")
            if before and Action(before, a.micro, a.chunk) not in actions[:n]:
                raise ValueError(f"rank {r} runs {a} before {Action(before, a.micro, a.chunk)}")
            if a.kind in "BI":
                grad_kind[(a.micro, a.chunk * p + r)] = a.kind
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, global stage) -> end time
    free, nxt, events = [0.0] * p, [0] * p, []
    names = {"F": "forward", "B": "backward", "I": "backward", "W": "weight"}
    while any(nxt[r] < len(per_rank[r]) for r in range(p)):
        progress = False
        for r in range(p):
            while nxt[r] < len(per_rank[r]):
                a = per_rank[r][nxt[r]]
                g = a.chunk * p + r
                if a.kind == "F":  # the activation from the stage before
                    needs = [("F", a.micro, g - 1)] if g > 0 else []
                elif a.kind in "BI":  # the gradient from the stage after
                    needs = [(grad_kind.get((a.micro, g + 1), "B"), a.micro, g + 1)] if g < last else []
                else:  # W: its own input-gradient pass (already run: checked above)
                    needs = []
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] + latency for n in needs])
                free[r] = done[(a.kind, a.micro, g)] = start + durations[r][a.kind]
                events.append(dict(rank=r, lane="compute", label=f"{names[a.kind]}: {a}", start=start, end=free[r]))
                sends = (a.kind == "F" and g < last) or (a.kind in "BI" and g > 0)
                if blocking and sends and latency > 0:  # the rank waits until its message has arrived
                    events.append(dict(rank=r, lane="comm", label=f"send: {a}", start=free[r], end=free[r] + latency))
                    free[r] += latency
                nxt[r] += 1
                progress = True
        if not progress:
            stuck = {r: str(per_rank[r][nxt[r]]) for r in range(p) if nxt[r] < len(per_rank[r])}
            raise ValueError(f"the schedule cannot run: ranks wait on each other at {stuck}")
    return events, done


def theoretical_bubble(n_stages: int, n_micro: int, name: str = "1f1b", n_chunks: int = 1) -> float:
    """Idle share of a step with equal stages (t_b = 2 t_f; for zb-h1 t_F = t_B = t_W), free communication."""
    p, m, v = n_stages, n_micro, n_chunks
    if name == "naive":
        return (p - 1) / p
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        if m < p:
            raise ValueError(f"the zb-h1 bubble (p-1)/(3m+p-1) assumes a full pipe, n_micro >= n_stages; got {m} < {p}")
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"unknown schedule {name!r}; choose from {sorted(SCHEDULES)}")


def bubble_fraction(events: list[dict]) -> float:
    """Measured idle share: 1 - (compute time of a rank) / (time from first start to last end), averaged."""
    t0, t1 = min(e["start"] for e in events), max(e["end"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    busy = [sum(e["end"] - e["start"] for e in events if e["rank"] == r and e["lane"] == "compute") for r in ranks]
    return 1.0 - sum(busy) / (len(ranks) * (t1 - t0))


# -- the order of messages ------------------------------------------------------------------------------------
class Message(NamedTuple):
    """One tensor that crosses between stages in a step."""

    micro: int
    to_stage: int  # the global stage that receives it
    grad: bool  # False: the activation from stage to_stage - 1; True: the gradient from stage to_stage + 1

    def __str__(self) -> str:
        return f"{'gradient' if self.grad else 'activation'} of micro-batch {self.micro} to stage {self.to_stage}"


def message_order(
    name: str, n_micro: int, n_stages: int, rank: int, n_chunks: int = 1, receives_first: bool = True
) -> list[tuple]:
    """The messages of ``rank`` in a step, in the order it posts them: [("send" or "recv", peer, Message)].

    Messages between two ranks are matched by the order they are posted in, not by their tag (NCCL
    ignores tags, pytorch/pytorch#94819): the n-th send from i to j meets the n-th receive on j from i.
    So every rank posts its messages in the order in which ``simulate``, with its unit times, sends
    them; every rank computes it from the schedules alone, so no message is needed to agree on it.
    Each direction between two ranks then has one order on both sides (a rank sends one message at a
    time), and no rank waits for a message that is sent after one it has still to send.

    Ties, a send and a receive of this rank at the same unit time: **the receive first**. ``Mailbox``
    posts the receives ahead up to the rank's next send; a receive ordered after a send is posted only
    when that send is, and a message is delivered only once its receive is posted: in GPipe's
    backward, rank s sends the gradient of B_i as rank s+1 sends that of B_(i+1), and with the send first
    that receive is posted a backward late, each time. Gloo matches each (peer, direction) on its own,
    which this order keeps. Where a rank's operations run one after another in the order posted (NCCL's
    rule within one stream), two ranks that each post a receive from the other at the same time, each
    before its send, would wait for each other: there the order needs a queue per direction (sends and
    receives on separate streams), or ties broken the same way on both ranks (the lower rank's send
    first), which posts those receives late: ``receives_first=False`` gives that order, for comparison.
    """
    p, v = n_stages, n_chunks
    _, end = _simulate([schedule(name, n_micro, p, r, v) for r in range(p)])
    last = p * v - 1  # the last global stage
    sent = []  # (time sent, sending rank, message)
    for (kind, i, g), t in end.items():
        if kind == "F" and g < last:  # a forward sends its activation on
            sent.append((t, g % p, Message(i, g + 1, grad=False)))
        elif kind in "BI" and g > 0:  # a backward (or its input half) sends the input gradient back
            sent.append((t, g % p, Message(i, g - 1, grad=True)))
    order = []  # by the time sent; at a tie, this rank's receive before its send
    for _, _, sender, message in sorted(
        (t, receives_first and message.to_stage % p != rank, s, message) for t, s, message in sent
    ):
        receiver = message.to_stage % p
        if sender == rank:
            order.append(("send", receiver, message))
        elif receiver == rank:
            order.append(("recv", sender, message))
    return order
