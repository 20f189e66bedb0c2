"""Point-to-point: the one primitive every collective of ``collectives.py`` is made of, and a counter
of what it sends.

``torch.distributed`` moves a tensor between two ranks with ``isend`` (post "send this buffer to rank
j") and ``irecv`` (post "receive a buffer from rank i"); each returns a handle to ``wait()`` on. All
the collectives here go through ``_exchange``, which posts one receive and one send and waits for both:
a rank of a ring talks to both its neighbours at once, and a tree's ``_send`` and ``_recv`` are its two
halves.

``with traffic() as t:`` counts the payload bytes and the messages this rank sends inside the block,
so that what an algorithm really sends can be compared with its cost model (``ring_all_reduce_bytes``).
Messages that only check the arguments (``count=False``) are left out of the count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Traffic", "traffic", "count_sent"]


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
    first, every rank would wait for a neighbour that is itself waiting to send. Empty buffers
    are skipped (both ends know the sizes, so both skip).
    """
    works = []
    if recv is not None and recv.numel() > 0:
        works.append(dist.irecv(recv, src))
    if send is not None and send.numel() > 0:
        if count:
            count_sent(send.numel() * send.element_size(), 1)
        works.append(dist.isend(send, dst))
    for work in works:
        work.wait()


def _send(tensor: torch.Tensor, dst: int) -> None:
    _exchange(tensor, dst, None, -1)


def _recv(buffer: torch.Tensor, src: int) -> None:
    _exchange(None, -1, buffer, src)
