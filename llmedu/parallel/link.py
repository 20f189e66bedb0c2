"""A link of known latency and bandwidth: communication you can time on a machine whose own link is not the point.

On one host, gloo moves tensors through memory, and on 2 shared CPU cores its copies compete with the
computation they should overlap. A ``Link`` keeps the data path real and makes the time a model: every
operation runs over gloo as usual (its results are gloo's results), and its handle completes when the
alpha-beta model (lesson 10) says the transfer would have ended. The waiting is a sleep in a helper
thread, which uses no CPU, so it overlaps with the rank's computation as a network card or a GPU's
copy engine would, even on 2 cores.

A message of ``n`` bytes takes ``alpha + n / beta`` seconds (``message_time``). With ``S`` the bytes of
the tensor passed and ``N`` the ranks of the group, the ring algorithms of ``collectives.py`` cost
(``op_time``)::

    all_reduce             2(N-1) messages of S/N   = 2(N-1) alpha + 2(N-1)/N S/beta
    all_gather_single      N-1 messages of S        (S: this rank's input)
    reduce_scatter_single  N-1 messages of S/N      (S: this rank's input, N pieces)
    all_to_all_single      N-1 messages of S/N
    post(sends, recvs)     one message per tensor

When each operation ends: the link carries one operation at a time per direction, in the order they
were launched, like a network card's queue. An operation starts when it is ready and the link is free,
whichever is later, and ends ``op_time`` after it starts; collectives use both directions, a send the
outgoing one, a receive the incoming one. A send is ready when it is launched. A collective is ready
when the last of its ranks has launched it (a ring cannot move before every rank has joined): beside
each collective the ranks exchange their launch times (a MAX all-reduce of one number), so a rank that
launches early waits for the late one, as it would on a real network. A receive cannot start before its
message exists, so it is ready at gloo's delivery. The handle completes at the modelled end, or when
gloo finishes if gloo is slower: each entry of ``records`` says which (``overrun``), so the student can
see the model held.

Left out: contention between links (every rank has its own), topology (a ring on a torus, NVLink inside
a node and InfiniBand between nodes), and chunk pipelining within a collective.
"""

from __future__ import annotations

import threading
import time
from functools import partial

import torch
import torch.distributed as dist

from .compat import all_gather_single, reduce_scatter_single

__all__ = ["Link", "LinkWork"]

_BOTH = ("send", "recv")  # a collective's ring sends and receives at once


class LinkWork:
    """The handle of one operation on a ``Link``: ``wait()`` returns once the modelled time has passed
    (and gloo has finished); ``get_future()`` gives a ``torch.futures.Future`` completed at that moment."""

    def __init__(self):
        self.future: torch.futures.Future = torch.futures.Future()

    def wait(self, timeout=None) -> bool:
        self.future.wait()  # raises what gloo raised
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def get_future(self) -> torch.futures.Future:
        return self.future


class Link:
    """This rank's link: ``alpha`` seconds of latency per message, ``beta`` bytes per second.

    Its methods take the arguments of the ``torch.distributed`` functions of the same names, so a
    wrapper can call ``(link or dist).all_reduce(x, async_op=True)``. ``records`` lists every
    operation: op, bytes, launched (here), ready (for a collective: the latest launch among its ranks),
    start, end (modelled), gloo_end, overrun, in ``time.perf_counter()`` seconds (one clock for every
    process on a host).
    """

    def __init__(self, alpha: float, beta: float):
        if not alpha >= 0:
            raise ValueError(f"a link's latency alpha must be >= 0 seconds, got {alpha!r}")
        if not beta > 0:
            raise ValueError(f"a link's bandwidth beta must be > 0 bytes per second, got {beta!r}")
        self.alpha, self.beta = float(alpha), float(beta)
        self.records: list[dict] = []
        self._free = {"send": 0.0, "recv": 0.0}  # when each direction finishes its last operation
        self._lock = threading.Lock()
        self._placed = threading.Event()  # set once the last launched send or collective has its slot
        self._placed.set()

    # -- the model ------------------------------------------------------------------------------------
    def message_time(self, nbytes: float) -> float:
        """Seconds for one message of ``nbytes`` bytes: alpha + nbytes / beta."""
        return self.alpha + nbytes / self.beta

    def op_time(self, op: str, nbytes: float, world_size: int) -> float:
        """Seconds for ``op`` on a tensor of ``nbytes`` bytes among ``world_size`` ranks (the table above)."""
        n = world_size
        if n < 1:
            raise ValueError(f"world_size must be >= 1, got {n}")
        messages = {
            "all_reduce": (2 * (n - 1), nbytes / n),
            "all_gather_single": (n - 1, nbytes),
            "reduce_scatter_single": (n - 1, nbytes / n),
            "all_to_all_single": (n - 1, nbytes / n),
            "send": (1, nbytes),
            "recv": (1, nbytes),
        }
        if op not in messages:
            raise ValueError(f"the link has no cost for {op!r}; it models {sorted(messages)}")
        count, size = messages[op]
        return count * self.message_time(size)

    # -- the operations ---------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        start = partial(dist.all_reduce, tensor, op=op, group=group, async_op=True)
        return self._collective("all_reduce", start, tensor, group, async_op)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
        start = partial(all_gather_single, output, input, group=group, async_op=True)
        return self._collective("all_gather_single", start, input, group, async_op)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
        start = partial(reduce_scatter_single, output, input, group=group, async_op=True)
        return self._collective("reduce_scatter_single", start, input, group, async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
        start = partial(dist.all_to_all_single, output, input, group=group, async_op=True)
        return self._collective("all_to_all_single", start, input, group, async_op)

    def post(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list[LinkWork]:
        """As ``p2p.post``: receives into ``recvs`` [(buffer, src)], sends of ``sends`` [(tensor, dst)], one
        batch; a handle for each receive, then for each send."""
        ops = [dist.P2POp(dist.irecv, buffer, src) for buffer, src in recvs]
        ops += [dist.P2POp(dist.isend, tensor, dst) for tensor, dst in sends]
        if not ops:
            return []
        reals = dist.batch_isend_irecv(ops)
        reals = reals if len(reals) == len(ops) else reals * len(ops)  # NCCL: one handle for the batch
        kinds = ["recv"] * len(recvs) + ["send"] * len(sends)
        tensors = [buffer for buffer, _ in recvs] + [tensor for tensor, _ in sends]
        return [self._launch(kind, real, t, 1, (kind,)) for kind, real, t in zip(kinds, reals, tensors)]

    # -- when each one ends -----------------------------------------------------------------------------
    def _collective(self, op: str, start, tensor: torch.Tensor, group, async_op: bool):
        launched = time.perf_counter()
        stamp = torch.tensor([launched], dtype=torch.float64)
        # every rank sends its launch time first (a few bytes); the operation is ready at the latest one
        latest = dist.all_reduce(stamp, op=dist.ReduceOp.MAX, group=group, async_op=True)
        real = start()
        work = self._launch(op, real, tensor, dist.get_world_size(group), _BOTH, launched, (latest, stamp))
        if async_op:
            return work
        work.wait()
        return None

    def _launch(self, op, real, tensor, world_size, lanes, launched=None, latest=None) -> LinkWork:
        nbytes = tensor.numel() * tensor.element_size()
        launched = time.perf_counter() if launched is None else launched
        record = dict(op=op, bytes=nbytes, launched=launched, seconds=self.op_time(op, nbytes, world_size))
        work, turn = LinkWork(), None
        with self._lock:
            self.records.append(record)
            if op != "recv":  # sends and collectives take their slots in launch order, like a NIC's queue
                turn = (self._placed, threading.Event())
                self._placed = turn[1]
        threading.Thread(target=self._deliver, args=(record, real, work, lanes, turn, latest), daemon=True).start()
        return work

    def _occupy(self, record: dict, lanes: tuple[str, ...], ready: float) -> None:
        """Give the operation its slot: from when it is ready and its lanes are free, for its modelled time."""
        record["ready"] = ready
        record["start"] = max(ready, *(self._free[lane] for lane in lanes))
        record["end"] = record["start"] + record["seconds"]
        for lane in lanes:
            self._free[lane] = record["end"]

    def _deliver(self, record: dict, real, work: LinkWork, lanes: tuple[str, ...], turn, latest) -> None:
        """In a helper thread: place the operation on the link, wait for gloo, sleep out the modelled rest."""
        try:
            if turn is not None:  # a send or a collective: after the one launched before it
                ready = record["launched"]
                if latest is not None:  # a collective: ready once its last rank launched it
                    latest[0].wait()
                    ready = latest[1].item()
                turn[0].wait()
                with self._lock:
                    self._occupy(record, lanes, ready)
                turn[1].set()
            real.wait()
        except Exception as error:  # a peer failed: the handle raises it, as gloo's would
            if turn is not None:
                turn[1].set()  # the operations behind it fail on their own; none waits forever
            work.future.set_exception(error)
            return
        record["gloo_end"] = time.perf_counter()
        if turn is None:  # a receive: its message exists once gloo delivered it
            with self._lock:
                self._occupy(record, lanes, ready=record["gloo_end"])
        record["overrun"] = record["gloo_end"] > record["end"]
        time.sleep(max(0.0, record["end"] - time.perf_counter()))  # no CPU used: compute goes on meanwhile
        work.future.set_result(None)
