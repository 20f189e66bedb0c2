"""Lesson 00's exercise 3: a read-bandwidth probe, graded on the ops it runs, not on the clock's verdict.

    check_read_probe(fn)            fn(nbytes) -> (bytes read per call, seconds of >= 5 timed calls)
    check_gap_prediction(gap)       {line of the buggy probe: factor of its gap the fault there explains}

A ``TorchDispatchMode`` records every op the learner's probe runs: which byte ranges were written (an
untouched page of ``torch.empty`` maps the OS's shared zero page, so reading it reads the cache), and each op
that reads a tensor of at least ``nbytes``, timed by the recorder itself. The learner's seconds are then
matched with the recorder's timings of the same calls, so the check holds on a loaded machine: one read per
timing, not two, not an allocation with it, not another op. What it leaves out: reads through a non-torch
path (NumPy on the tensor's memory) are not seen, and writes smaller than a page or through strided views
are not counted as writing the buffer.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from unittest import mock

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..hardware import probe
from .core import CheckResult, Grader

__all__ = ["check_read_probe", "check_gap_prediction"]

_UNWRITTEN = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")  # outputs hold garbage
_WRITE_ONLY = ("fill_", "zero_", "uniform_", "normal_", "random_", "bernoulli_", "exponential_", "copy_")
_PAGE = 4096  # bytes: an untouched page reads the shared zero page; a write smaller than one is not tracked


@dataclass
class _Read:
    """One op that read a tensor of at least ``nbytes``, as the recorder saw it."""

    name: str
    seconds: float  # the op and the recorder's bookkeeping of it
    unwritten: int  # bytes of its big inputs that nothing had written before it
    rewritten: bool  # a large write touched its input since the previous big read
    contiguous: bool
    wrote: int  # bytes of its outputs
    read: int  # bytes of its big inputs


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The [start, end) addresses of the bytes a tensor's elements lie in (strides are never negative in torch)."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _dense(t: torch.Tensor) -> bool:  # its elements fill its span: a write to it writes every byte there
    start, end = _span(t)
    return end - start == t.numel() * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


class _ReadRecorder(TorchDispatchMode):
    """Which byte ranges were written (by dense writes of at least a page), and each op that reads a tensor of at
    least ``nbytes``, timed alone (a ``_Read``)."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.nbytes, self.written, self.recent, self.big_reads = nbytes, [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()  # a big read's time includes this bookkeeping, which the learner's clock sees
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        read_args = args[1:] if name in _WRITE_ONLY else args  # a fill_ or copy_ does not read its destination
        tensors = [t for t in pytree.tree_leaves((read_args, kwargs)) if isinstance(t, torch.Tensor)]
        big = [t for t in tensors if t.numel() * t.element_size() >= self.nbytes and not func.is_view]
        spans = [_span(t) for t in big]
        out = func(*args, **kwargs)
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if big:
            unwritten = max(b - a - sum(_overlap((a, b), w) for w in self.written) for a, b in spans)
            rewritten = any(_overlap(s, w) for s in spans for w in self.recent)
            wrote = sum(t.numel() * t.element_size() for t in outputs)
            read = sum(t.numel() * t.element_size() for t in big)
            contiguous = all(t.is_contiguous() for t in big)
            self.recent = []
            self.big_reads.append(_Read(name, 0.0, unwritten, rewritten, contiguous, wrote, read))
        targets = args[:1] if name in _WRITE_ONLY else [] if func.is_view else outputs
        for t in targets:
            if isinstance(t, torch.Tensor) and _dense(t) and t.numel() * t.element_size() >= _PAGE:
                self._forget(_span(t))  # a new buffer, perhaps at the address of a freed, written one
                if name not in _UNWRITTEN:
                    self.written.append(_span(t))
                    if t.numel() * t.element_size() >= self.nbytes // 2:
                        self.recent.append(_span(t))
        if big:
            self.big_reads[-1].seconds = time.perf_counter() - start
        return out

    def _forget(self, span: tuple[int, int]) -> None:
        a, b = span
        self.written = [r for s, e in self.written for r in ((s, min(e, a)), (max(s, b), e)) if r[1] > r[0]]


def _timing_fit(seconds: list[float], reads: list[float]) -> tuple[float, int]:
    """How the learner's seconds fit the recorder's timings of the same reads: for each way of splitting the last
    reads into len(seconds) groups of c consecutive reads (c = 1, 2, ...; the reads before them warm-ups), the
    ratios seconds[i] / mean(group i). The split whose ratios agree best (it pairs each timing with its own
    reads, so a slow moment slows both) gives (its median ratio, c): about 1 when each timing is one read."""
    k, fits = len(seconds), []
    for c in range(1, len(reads) // k + 1):
        timed = reads[len(reads) - c * k :]
        ratios = sorted(s / statistics.mean(timed[i * c : (i + 1) * c]) for i, s in enumerate(seconds))
        fits.append((ratios[-2] / ratios[1], statistics.median(ratios), c))  # (spread without the extremes, ...)
    _, ratio, c = min(fits)
    return ratio, c


def _refuse_library_timing(*args, **kwargs):
    raise RuntimeError("llmedu's own probe was called: the exercise asks for your timing loop, not measure_*()")


def check_read_probe(fn, nbytes: int | None = None) -> CheckResult:
    """``fn(nbytes) -> (bytes_per_call, seconds)``: a read-bandwidth probe on the CPU.

    The method, from the ops the probe runs (recorded, each large read timed alone): the kernel it times
    reads a contiguous buffer of at least ``nbytes`` whose every page was written first (an untouched page
    of ``torch.empty`` reads the OS's shared zero page, from the cache), and not written again between
    reads (a write leaves the buffer's end in cache); it writes almost nothing (a copy measures a copy) and
    runs once more than it is timed (a warm-up); the seconds are 0.7-1.5x the recorder's own timings of the
    same calls (one read per timing, or a batch's time divided by its calls: not two reads, not an
    allocation with it, not another op); at least 5 repeats, which fit in the call's duration; ``bytes_per_call`` is what one call of
    the kernel reads (the bytes of the tensor it reads, not the ``nbytes`` asked for). ``nbytes`` defaults
    to 4x the last-level cache, at least 64 MiB.
    """
    g = Grader("check_read_probe")
    if nbytes is None:
        nbytes = max(4 * (probe.last_level_cache_bytes() or 0), 64 * 2**20)
    nbytes -= nbytes % 4
    case = f"a probe of {nbytes / 2**20:g} MiB"
    recorder = _ReadRecorder(nbytes)
    start = time.perf_counter()
    with mock.patch.object(probe, "_seconds_per_call", _refuse_library_timing), recorder:  # every llmedu timing
        got = g.call(fn, nbytes)
    wall = time.perf_counter() - start
    if g.failure is not None:
        return g.result()
    shaped = isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[1], (tuple, list))
    if not g.expect(case, shaped, f"expected (bytes_per_call, [seconds, ...]), got {got!r:.80}"):
        return g.result()
    counted, seconds = got
    if not g.expect(
        case,
        len(seconds) >= 5 and all(isinstance(s, float) and s > 0 for s in seconds),
        f"expected at least 5 positive times in seconds, got {seconds!r:.80}",
    ):
        return g.result()
    if not g.expect(case, bool(recorder.big_reads), f"no op read a buffer of {nbytes:,} bytes; one in cache is faster"):
        return g.result()
    kernel = statistics.mode(r.name for r in recorder.big_reads)
    calls = [r for r in recorder.big_reads if r.name == kernel]
    read = max(r.read for r in calls)  # the bytes of the buffer the timed kernel actually reads
    g.expect(
        case,
        all(r.contiguous for r in calls),
        f"the timed {kernel} reads a strided view: it moves every cache line its elements lie in, not only the "
        "elements' bytes, so its bytes per call are not numel() * element_size(). Read a contiguous buffer",
    )
    g.expect(
        case,
        all(r.unwritten < _PAGE for r in calls),
        f"the timed {kernel} reads bytes that nothing has written (torch.empty): {max(r.unwritten for r in calls):,} "
        f"of its {read:,}. The OS maps each untouched page to one shared page of zeros, so it reads the cache, not "
        "memory. Write the whole buffer first",
    )
    g.expect(
        case,
        sum(r.rewritten for r in calls[1:]) <= len(calls[1:]) // 2,
        f"the buffer is written again (allocated or filled) before each {kernel}: timed, that times a write too; "
        "untimed, the write leaves the buffer's last megabytes in cache. Write it once, before the loop",
    )
    g.expect(
        case,
        max(r.wrote for r in calls) < nbytes // 2,
        f"the timed {kernel} writes as many bytes as it reads: that measures a copy, not a read. Reduce (x.sum())",
    )
    g.expect(case, len(calls) > len(seconds), f"{kernel} ran {len(calls)} times for {len(seconds)} timings: no warm-up")
    g.expect(
        case, sum(seconds) <= wall, f"the seconds add up to {sum(seconds):.3g} s, more than the call's {wall:.3g} s"
    )
    if len(calls) >= len(seconds):
        ratio, c = _timing_fit(list(seconds), [r.seconds for r in calls])
        g.expect(
            case,
            0.7 <= ratio <= 1.5,
            f"your seconds are {ratio:.2g}x the grader's own timings of the same {kernel} calls (their "
            f"mean per call, in groups of {c}): "
            + (
                "each timing holds more than one read (two reads, or an allocation or a fill with it)"
                if ratio > 1.5
                else f"your timings do not time the {kernel} that reads the buffer"
            ),
        )
    if isinstance(counted, (int, float)) and counted == 2 * read:
        g.expect(case, False, f"got {counted:,} bytes per call, 2x the buffer: a read moves each byte once")
    if isinstance(counted, (int, float)) and counted != read and read != nbytes:
        g.expect(
            case,
            False,
            f"got {counted:,} bytes per call, but the timed {kernel} reads a buffer of {read:,} bytes "
            f"({read / nbytes:g}x the {nbytes:,} asked for): count the bytes of the tensor, numel() * element_size()",
        )
    g.compare(f"{case}: bytes per call (what the timed {kernel} reads)", counted, read, rtol=1e-12)
    return g.result()


# -- the prediction: how much of the buggy probe's gap each fault explains ----------------------------
_FAULTS = {  # fault: (the lines of the lesson's buggy_read_probe it may be named by, 1 = the def line)
    "the buffer never written": (2,),
    "no warm-up": (3, 4, 5, 6, 7),  # a missing line: anywhere in the timing loop
    "the bytes counted twice": (8,),
}


def _zero_page_factor(nbytes: int) -> float:
    """The buggy probe's timing (median of 5 sums after one) on a written buffer over an untouched one."""

    def median_sum(x: torch.Tensor) -> float:
        x.sum()
        seconds = []
        for _ in range(5):
            start = time.perf_counter()
            x.sum()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)

    return median_sum(torch.ones(nbytes // 4)) / median_sum(torch.empty(nbytes // 4))


def check_gap_prediction(gap, nbytes: int | None = None, *, zero_page: float | None = None) -> CheckResult:
    """``gap``: {line of the lesson's ``buggy_read_probe``: the factor of its gap the fault on that line explains}.

    One line per fault, all three; the factors, as fixing one fault at a time shows them: the double count
    exactly 2 (same seconds, twice the bytes); the untouched buffer within 2x of the grader's own measurement
    on ``nbytes`` (``zero_page``, measured when None); the missing warm-up about 1 (0.67-1.5), since the probe
    quotes a median, which one slow first call does not move.
    """
    g = Grader("check_gap_prediction")
    numbers = isinstance(gap, dict) and all(
        isinstance(k, int) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for k, v in gap.items()
    )
    if not g.expect("your answer", numbers and bool(gap), f"expected {{line: factor > 0}}, got {gap!r:.80}"):
        return g.result()
    for line in gap:
        g.expect(f"line {line}", any(line in lines for lines in _FAULTS.values()), "it holds none of the faults")
    named = {fault: [line for line in gap if line in lines] for fault, lines in _FAULTS.items()}
    g.expect("your lines", all(len(lines) <= 1 for lines in named.values()), f"two lines name one fault: {named}")
    g.expect("your lines", all(named.values()), f"the probe has 3 faults; you named {len(gap)}")
    if g.failure is not None:
        return g.result()
    factor = {fault: gap[lines[0]] for fault, lines in named.items()}
    g.compare("the bytes counted twice: the factor", factor["the bytes counted twice"], 2.0, rtol=0.1)
    if nbytes is None:
        nbytes = max(4 * (probe.last_level_cache_bytes() or 0), 64 * 2**20)
    if zero_page is None and g.failure is None:
        zero_page = _zero_page_factor(nbytes)
    got = factor["the buffer never written"]
    g.expect(
        "the buffer never written: the factor",
        zero_page is not None and zero_page / 2 <= got <= 2 * zero_page,
        f"got {got:.3g}; the grader measures {zero_page or 0:.3g} on {nbytes / 2**20:g} MiB (median sums of a "
        "written and an untouched buffer): yours should be within 2x of it",
    )
    got = factor["no warm-up"]
    g.expect(
        "no warm-up: the factor",
        0.67 <= got <= 1.5,
        f"got {got:.3g}; the probe quotes the median of its 5 timings, and one slow first call does not move a median",
    )
    return g.result()
