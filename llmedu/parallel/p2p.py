"""Point-to-point: the one primitive every collective of ``collectives.py`` is made of, and a counter
of what it sends.

``torch.distributed`` moves a tensor between two ranks with ``isend`` (post "send this buffer to rank
j") and ``irecv`` (post "receive a buffer from rank i"); each returns a handle to ``wait()`` on. All
the collectives here go through ``_exchange``, which posts one receive and one send and waits for both:
a rank of a ring talks to both its neighbours at once, and a tree's ``_send`` and ``_recv`` are its two
halves.

Several messages between the same two ranks are matched by the order they are posted in, not by their
``tag``: NCCL ignores tags (pytorch/pytorch#94819; documented since pytorch/pytorch#125278), the n-th send
from i to j meets the n-th receive on j from i, and each rank's sends and receives run one after the
other in the order it posted them (a send waits until its receive runs). ``post`` puts a rank's sends
and receives of one moment in one batch (``batch_isend_irecv``), so that two ranks that send to each
other at once do not each wait for the other's receive; ``Mailbox`` posts a pipeline's many messages
in an order given to it (``pipeline_schedules.message_order``), receives as early as that order allows.
That order keeps each direction between two ranks in one order on both sides, which is what gloo
matches on; it posts a rank's receive before its send at a tie, so under NCCL's rule (one queue per
rank) it would need a queue per direction (see ``message_order``).

``with traffic() as t:`` counts the payload bytes and the messages this rank sends inside the block,
so that what an algorithm really sends can be compared with its cost model (``ring_all_reduce_bytes``).
Messages that only check the arguments (``count=False``) are left out of the count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Traffic", "traffic", "count_sent", "post", "Mailbox"]


@dataclass
class Traffic:
    """Payload sent by this rank while the ``traffic()`` block ran."""

    bytes_sent: int = 0
    messages_sent: int = 0


_active: list[Traffic] = []  # the counters of the traffic() blocks this rank is inside


@contextmanager
def traffic() -> Iterator[Traffic]:
    """Count the bytes and messages this rank sends inside the block (shape checks excluded)."""
    counter = Traffic()
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)


def count_sent(nbytes: int, messages: int) -> None:
    """Add what a collective sent outside ``exchange`` (an all-to-all, say) to the open ``traffic()`` counters."""
    for counter in _active:
        counter.bytes_sent += nbytes
        counter.messages_sent += messages


def _exchange(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int, count: bool = True) -> None:
    """Send ``send`` to ``dst`` while receiving into ``recv`` from ``src``; wait for both.

    Posting both before waiting is what lets a whole ring move at once: with a blocking send
    first, every rank would wait for a neighbour that is itself waiting to send. Both go in one
    batch (``post``): on a ring of two, NCCL would otherwise run each rank's receive before its
    send, each waiting for the other's send. Empty buffers are skipped (both ends know the sizes,
    so both skip).
    """
    recvs = [(recv, src)] if recv is not None and recv.numel() > 0 else []
    sends = [(send, dst)] if send is not None and send.numel() > 0 else []
    if sends and count:
        count_sent(send.numel() * send.element_size(), 1)
    for work in post(sends, recvs):
        work.wait()


def _send(tensor: torch.Tensor, dst: int) -> None:
    _exchange(tensor, dst, None, -1)


def _recv(buffer: torch.Tensor, src: int) -> None:
    _exchange(None, -1, buffer, src)


def post(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
    """Post receives into ``recvs`` [(buffer, src)] and ``sends`` [(tensor, dst)] as one batch; returns a
    handle to ``wait()`` on for each receive, then for each send. Nothing to post: no handles."""
    ops = [dist.P2POp(dist.irecv, buffer, src) for buffer, src in recvs]
    ops += [dist.P2POp(dist.isend, tensor, dst) for tensor, dst in sends]
    if not ops:
        return []
    works = dist.batch_isend_irecv(ops)
    return works if len(works) == len(ops) else works * len(ops)  # NCCL: one handle for the whole batch


class Mailbox:
    """A rank's messages of one step, posted in an agreed order.

    ``order`` lists this rank's messages as ("send" or "recv", peer, key) in the order it must post them
    (the messages from one rank to another in the same order on both). ``send(key, tensor)``
    posts the send together with the receives that come before it; ``recv(key)`` posts the receives up
    to ``key`` (if not posted yet) and waits for ``key``'s; both then post the receives that follow, up
    to the next send, so that messages can arrive while the rank computes. A receive posted early lands
    in its own buffer (``new_buffer(key)``) and stays there until asked for. ``post``: a ``Link``'s
    (default: this module's ``post``); ``blocking_sends`` makes ``send`` wait until its message has
    left (no overlap). Sends must come in the agreed order: that the rank computes them in that order is
    for whoever makes the order to guarantee. ``posts`` lists what was posted, in order: (direction,
    peer, key), one entry per handle, as a ``Link`` lists them in its ``records``.
    """

    def __init__(
        self,
        order: list[tuple],
        new_buffer: Callable[[Hashable], torch.Tensor],
        log=None,
        post: Callable | None = None,
        blocking_sends: bool = False,
    ):
        self.queue = deque(order)  # not yet posted
        self.new_buffer, self.log, self.post, self.blocking_sends = new_buffer, log, post, blocking_sends
        self.posted: dict = {}  # key -> (buffer, handle): receives posted, perhaps not yet arrived
        self.sending: list = []  # handles of the sends posted
        self.posts: list = []  # (direction, peer, key) of every operation posted, in the order posted

    def send(self, key: Hashable, tensor: torch.Tensor) -> None:
        self._post_through(key, tensor)
        if self.blocking_sends:  # like dist.send: the rank waits until the message has left
            with self.log.span("comm", f"send {key}") if self.log else nullcontext():
                self.sending[-1].wait()

    def recv(self, key: Hashable) -> torch.Tensor:
        if key not in self.posted:
            self._post_through(key)
        buffer, handle = self.posted.pop(key)
        with self.log.span("comm", f"recv {key}") if self.log else nullcontext():
            handle.wait()
        return buffer

    def wait_for_sends(self) -> None:
        """Wait until every send has left; refuse a step that left messages unposted or unread."""
        for handle in self.sending:
            handle.wait()
        if self.queue or self.posted:
            left = [str(key) for *_, key in self.queue] + [str(key) for key in self.posted]
            raise RuntimeError(f"messages of the step never sent or read: {left}")

    def _post_through(self, key: Hashable, tensor: torch.Tensor | None = None) -> None:
        """Post, as one batch, the messages up to ``key`` in the order: receives, then ``key`` itself."""
        sends, recvs, kind = [], [], "recv" if tensor is None else "send"
        while True:
            if not self.queue:
                raise RuntimeError(f"{key} is not among this rank's messages still to {kind}")
            direction, peer, next_key = self.queue.popleft()
            if next_key == key and direction != kind:
                raise RuntimeError(f"{key} is a message this rank must {direction}, not {kind}")
            if next_key != key and direction == "send":  # a send of ours comes first: it was computed too late
                raise RuntimeError(f"{key} was posted before {next_key}, which comes first in the order")
            if direction == "send":
                sends.append((tensor, peer))
            else:
                recvs.append((self.new_buffer(next_key), peer, next_key))
            if next_key == key:
                break
        handles = (self.post or post)(sends, [(buffer, peer) for buffer, peer, _ in recvs])
        self.posts += [("recv", peer, k) for _, peer, k in recvs] + [("send", peer, key) for _, peer in sends]
        for (buffer, _, k), handle in zip(recvs, handles):
            self.posted[k] = (buffer, handle)
        self.sending += handles[len(recvs) :]
        self._post_ahead()

    def _post_ahead(self) -> None:
        """Post the receives that come next in the order, up to this rank's next send, as their own batch:
        a message can then arrive while the rank computes (a receive posted late would start its
        transfer late). Posting in the agreed order keeps every pair of ranks matched."""
        recvs = []
        while self.queue and self.queue[0][0] == "recv":
            _, peer, k = self.queue.popleft()
            recvs.append((self.new_buffer(k), peer, k))
        handles = (self.post or post)([], [(buffer, peer) for buffer, peer, _ in recvs])
        self.posts += [("recv", peer, k) for _, peer, k in recvs]
        for (buffer, _, k), handle in zip(recvs, handles):
            self.posted[k] = (buffer, handle)
