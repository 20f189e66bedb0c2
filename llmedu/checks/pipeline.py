"""Graders for lesson 13 (pipeline parallelism): a bubble predicted by hand, the activation memory a ZB-H1
rank holds, the cost of receives posted late, and a number of micro-batches chosen.

``check_slow_stage_bubble`` wants the idle share of a GPipe step with one slow stage worked out with pen and
paper: it fails a function that asks the library's schedules or simulator (``llmedu.parallel``) for it.
``check_zb_h1_peak`` wants the most activation bytes a rank of ZB-H1 holds when a micro-batch whose input
gradient has run keeps only what its weight gradient needs, and ``check_late_receive_step`` the overlapped GPipe step of a ``Mailbox`` whose order breaks ties with the
lower rank's send first, both worked out by hand too (``mailbox_step`` is the reference: the executor's
posts simulated, each message leaving when it is sent or when its receive is posted, whichever is later).
``check_micro_batches`` wants the m that gives the shortest 1F1B step within a memory budget, when each
micro-batch also pays a fixed cost; its cases are built so that ignoring the memory, the fixed cost, or
the bubble each picks a wrong m somewhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

from ..parallel.pipeline_schedules import Message, bubble_fraction, message_order, schedule, simulate
from .core import CheckResult, Grader, call_watching

__all__ = ["check_slow_stage_bubble", "check_micro_batches", "slow_stage_bubble", "best_micro_batches"]
__all__ += ["check_zb_h1_peak", "zb_h1_peak", "check_late_receive_step", "mailbox_step"]

_LIBRARY = Path(__file__).resolve().parents[1] / "parallel"


def _run_cases(g: Grader, fn: Callable, cases: list[tuple[str, tuple]], reference: Callable, what: str, **tol):
    """Each (label, args) case: ``fn(*args)`` against ``reference(*args)``, failing at once (and stopping) if
    ``fn`` called ``llmedu.parallel``: the answer is to be worked out by hand, not asked of the library."""
    for case, args in cases:
        got, called = call_watching(g, fn, args, _LIBRARY)
        if not g.expect(f"{case}: {what}", called is None, f"your function called {called}"):
            break
        g.compare(case, got, reference(*args), **tol)
    return g.result()


def slow_stage_bubble(n_stages: int, n_micro: int, slow_stage: int, slowdown: float) -> float:
    """The reference, by simulation: GPipe, t_b = 2 t_f, stage ``slow_stage`` ``slowdown`` times slower."""
    times = [{"F": slowdown, "B": 2 * slowdown} if r == slow_stage else {} for r in range(n_stages)]
    return bubble_fraction(simulate([schedule("gpipe", n_micro, n_stages, r) for r in range(n_stages)], times))


def check_slow_stage_bubble(fn: Callable[[int, int, int, float], float]) -> CheckResult:
    """``fn(n_stages, n_micro, slow_stage, slowdown)`` -> the idle share of a GPipe step (idle time over
    p x step time) when one stage's forward and backward take ``slowdown`` times as long as the others'.
    Worked out by hand: a function that calls ``llmedu.parallel`` (``simulate``, ``schedule``) fails."""
    cases = [(4, 8, 1, 2.0), (2, 3, 0, 3.0), (8, 16, 5, 1.25), (4, 2, 3, 2.0), (6, 24, 2, 1.5), (3, 5, 1, 1.0)]
    labelled = [(f"p={p}, m={m}, stage {k} x{s}", (p, m, k, s)) for p, m, k, s in cases]
    g = Grader("check_slow_stage_bubble")
    return _run_cases(g, fn, labelled, slow_stage_bubble, "worked out, not simulated", atol=1e-9)


def zb_h1_peak(n_micro: int, n_stages: int, stage: int, act_bytes: int, w_bytes: int) -> int:
    """The reference, counted over the schedule: the most bytes rank ``stage`` of ZB-H1 holds at once, a
    micro-batch holding ``act_bytes`` from its F to its I and ``w_bytes`` from its I to its W."""
    full, waiting, peak = set(), set(), 0
    for a in schedule("zb-h1", n_micro, n_stages, stage):
        if a.kind == "F":
            full.add(a.micro)
        elif a.kind == "I":
            full.discard(a.micro)
            waiting.add(a.micro)
        else:  # W
            waiting.discard(a.micro)
        peak = max(peak, len(full) * act_bytes + len(waiting) * w_bytes)
    return peak


_ZB_CASES = [  # (m, p, act_bytes, w_bytes): m above, at and below p, and a W that keeps everything
    (8, 4, 10, 3),
    (4, 4, 7, 2),
    (2, 4, 10, 3),
    (12, 6, 9, 4),
    (5, 8, 6, 1),
    (3, 6, 5, 5),
    (16, 2, 3, 1),
]


def check_zb_h1_peak(fn: Callable[[int, int, int, int, int], int]) -> CheckResult:
    """``fn(n_micro, n_stages, stage, act_bytes, w_bytes)`` -> the most activation bytes rank ``stage`` of
    ZB-H1 holds at once, when a micro-batch holds ``act_bytes`` from its F until its I and ``w_bytes <=
    act_bytes`` from its I until its W. Worked out by hand: a function that calls ``llmedu.parallel`` fails."""
    cases = [
        (f"m={m}, p={p}, rank {s}, act_bytes={a}, w_bytes={w}", (m, p, s, a, w))
        for m, p, a, w in _ZB_CASES
        for s in range(p)
    ]
    return _run_cases(Grader("check_zb_h1_peak"), fn, cases, zb_h1_peak, "worked out, not counted")


def mailbox_step(n_stages: int, n_micro: int, t_f: float, c: float, receives_first: bool = True) -> float:
    """The reference: an overlapped GPipe step (F t_f, B 2 t_f, c per message) as ``Pipeline.step`` runs it
    over a ``Link``: the ``Mailbox`` posts receives in ``message_order``'s order up to its next send, and a
    message leaves when it is sent or when its receive is posted, whichever is later; each rank's incoming
    and outgoing link carries one message at a time."""
    p, last = n_stages, n_stages - 1
    orders = [deque(message_order("gpipe", n_micro, p, r, receives_first=receives_first)) for r in range(p)]
    actions = [deque(schedule("gpipe", n_micro, p, r)) for r in range(p)]
    posted, sent, clock = {}, {}, [0.0] * p
    free = {(r, d): 0.0 for r in range(p) for d in ("send", "recv")}

    def post_through(r, key, now):  # the messages up to key, then the receives up to the next send
        while True:
            direction, _, k = orders[r].popleft()
            posted.update({k: now} if direction == "recv" else {})
            if k == key:
                break
        while orders[r] and orders[r][0][0] == "recv":
            posted[orders[r].popleft()[2]] = now

    while any(actions):
        for r in range(p):
            while actions[r]:
                a, now = actions[r][0], clock[r]
                needs = (
                    Message(a.micro, r, a.kind == "B")
                    if (a.kind == "F" and r > 0 or a.kind == "B" and r < last)
                    else None
                )
                if needs is not None:
                    if needs not in sent:
                        break
                    if needs not in posted:
                        post_through(r, needs, now)
                    start = max(sent[needs], posted[needs], free[(r, "recv")])
                    free[(r, "recv")] = start + c
                    now = max(now, start + c)
                now += t_f if a.kind == "F" else 2 * t_f
                to = r + 1 if a.kind == "F" else r - 1
                if 0 <= to <= last:
                    key = Message(a.micro, to, a.kind == "B")
                    post_through(r, key, now)
                    sent[key] = now
                    free[(r, "send")] = max(now, free[(r, "send")]) + c
                clock[r] = now
                actions[r].popleft()
    return max(clock)


def check_late_receive_step(fn: Callable[[int, int, float, float], float]) -> CheckResult:
    """``fn(n_stages, n_micro, t_f, c)`` -> the overlapped GPipe step (backward 2 t_f, c per message, c <=
    t_f) when the ``Mailbox`` posts its messages in the order ``message_order(..., receives_first=False)``
    gives. Worked out by hand: a function that calls ``llmedu.parallel`` fails."""
    cases = [(4, 8, 0.02, 0.01), (2, 4, 0.02, 0.01), (3, 5, 1.0, 0.5), (8, 16, 1.0, 0.25), (4, 1, 1.0, 1.0)]
    labelled = [(f"p={p}, m={m}, t_f={t_f}, c={c}", (p, m, t_f, c)) for p, m, t_f, c in cases]

    def late(p, m, t_f, c):
        return mailbox_step(p, m, t_f, c, receives_first=False)

    g = Grader("check_late_receive_step")
    return _run_cases(g, fn, labelled, late, "worked out, not simulated", rtol=1e-9)


def best_micro_batches(batch: int, n_stages: int, fixed: float, per_sample: float, memory: int) -> int:
    """The reference: the divisor m of ``batch`` with the shortest 1F1B step (m + p - 1) x 3 (fixed +
    per_sample x batch/m), among those whose stage 0 holds at most ``memory`` samples (min(m, p) x batch/m)."""
    fits = [m for m in range(1, batch + 1) if batch % m == 0 and min(m, n_stages) * batch // m <= memory]
    if not fits:
        return 0
    return min(fits, key=lambda m: ((m + n_stages - 1) * 3 * (fixed + per_sample * batch / m), m))


_CASES = [  # (batch, n_stages, fixed, per_sample, memory): the bubble, the fixed cost and the memory each decide one
    (64, 4, 0.0, 1.0, 64),  # no fixed cost: the most micro-batches
    (64, 4, 2.0, 1.0, 64),  # a fixed cost per micro-batch: fewer, larger ones
    (64, 4, 2.0, 1.0, 20),  # the memory rules out the step's best m
    (96, 8, 0.5, 0.25, 96),
    (48, 2, 1.0, 1.0, 12),
    (128, 4, 8.0, 1.0, 1000),
    (60, 3, 0.3, 1.0, 25),
]


def check_micro_batches(fn: Callable[[int, int, float, float, int], int]) -> CheckResult:
    """``fn(batch, n_stages, fixed, per_sample, memory)`` -> the number of micro-batches m (a divisor of
    ``batch``) that gives the shortest 1F1B step, when a micro-batch of b samples takes fixed + per_sample x b
    seconds forward and twice that backward, and stage 0 may hold the activations of at most ``memory``
    samples; 0 if no m fits."""
    g = Grader("check_micro_batches")
    for batch, p, fixed, per_sample, memory in _CASES:
        case = f"batch={batch}, p={p}, fixed={fixed}, per_sample={per_sample}, memory={memory} samples"
        g.compare(
            case,
            g.call(fn, batch, p, fixed, per_sample, memory),
            best_micro_batches(batch, p, fixed, per_sample, memory),
        )
    return g.result()
