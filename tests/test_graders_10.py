"""Lesson 10's graders fail a wrong value and a right value reached the wrong way, and pass a right answer."""

import torch
import torch.distributed as dist

from llmedu.checks.collectives import (
    check_halving_doubling_all_reduce,
    check_ring_all_reduce,
    check_ring_all_reduce_bytes,
)
from llmedu.parallel.collectives import ring_all_reduce, ring_all_reduce_bytes


def _swap(send, recv, peer, to=None):
    """Post the receive (from ``peer``) and the send (to ``to``, default ``peer``), then wait for both; skip empties."""
    works = [dist.irecv(recv, peer)] if recv.numel() else []
    works += [dist.isend(send.contiguous(), peer if to is None else to)] if send.numel() else []
    for work in works:
        work.wait()


def hand_ring(x, gather_from=0, library_gather=False):
    """The lesson's ring, sending left as gloo's does. ``gather_from=1`` is its buggy starter (the all-gather takes
    the reduce-scatter's indices, one chunk ahead); ``library_gather`` pastes in the all-gather indices of
    ``ring_all_reduce``'s listing, which sends right: neither is the fix."""
    rank, n = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % n, (rank + 1) % n
    chunks = list(x.clone().view(-1).tensor_split(n))
    for step in range(n - 1):  # reduce-scatter: afterwards chunk `rank` is complete here
        send, into = chunks[(rank + step + 1) % n], chunks[(rank + step + 2) % n]
        incoming = torch.empty_like(into)
        _swap(send, incoming, right, to=left)
        into += incoming
    for step in range(n - 1):  # all-gather, starting from the complete chunk
        if library_gather:
            sent, got = rank - step, rank - step - 1
        else:
            sent, got = rank + gather_from + step, rank + gather_from + step + 1
        _swap(chunks[sent % n], chunks[got % n], right, to=left)
    return torch.cat(chunks).view_as(x)


def halving_doubling(x):
    """Recursive halving (reduce-scatter) then recursive doubling (all-gather), N a power of two."""
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = x.clone().reshape(-1)
    lo, hi, spans, mask = 0, flat.numel(), [], n // 2
    while mask >= 1:
        peer, mid = rank ^ mask, (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if rank < peer else ((mid, hi), (lo, mid))
        incoming = torch.empty(keep[1] - keep[0])
        _swap(flat[give[0] : give[1]], incoming, peer)
        flat[keep[0] : keep[1]] += incoming
        spans.append((lo, hi, peer))
        (lo, hi), mask = keep, mask // 2
    for outer_lo, outer_hi, peer in reversed(spans):
        other = (outer_lo, lo) if lo > outer_lo else (hi, outer_hi)
        incoming = torch.empty(other[1] - other[0])
        _swap(flat[lo:hi], incoming, peer)
        flat[other[0] : other[1]] = incoming
        lo, hi = outer_lo, outer_hi
    return flat.view_as(x)


def gather_and_sum(x):  # right values, isend/irecv only: rank 0 collects, adds, and sends the sum back
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        total = x.clone()
        for peer in range(1, n):
            incoming = torch.empty_like(x)
            dist.recv(incoming, peer)
            total += incoming
        for work in [dist.isend(total, peer) for peer in range(1, n)]:
            work.wait()
        return total
    dist.send(x.contiguous(), 0)
    dist.recv(x, 0)
    return x


def direct_reduce_scatter_all_gather(x):  # right values and bytes, but every rank talks to every rank
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(x.clone().view(-1).tensor_split(n))
    for peer in range(n):
        if peer != rank:
            incoming = torch.empty_like(chunks[rank])
            _swap(chunks[peer], incoming, peer)
            chunks[rank] += incoming
    for peer in range(n):
        if peer != rank:
            _swap(chunks[rank], chunks[peer], peer)
    return torch.cat(chunks).view_as(x)


def with_all_reduce(x):
    dist.all_reduce(x)
    return x


def test_ring_grader_passes_rings_and_fails_a_wrong_sum():
    assert check_ring_all_reduce(ring_all_reduce)
    assert check_ring_all_reduce(hand_ring)
    buggy = check_ring_all_reduce(lambda x: hand_ring(x, gather_from=1))
    assert not buggy and "tensor of shape" in buggy.failure, buggy.failure
    # the listing's all-gather indices in a ring that sends left: wrong chunks meet (wrong sums, or sizes gloo rejects)
    assert not check_ring_all_reduce(lambda x: hand_ring(x, library_gather=True))


def test_ring_grader_fails_the_right_sum_reached_without_a_ring():
    for wrong, why in [
        (with_all_reduce, "isend/irecv only"),
        (gather_and_sum, "of the tensor"),
        (direct_reduce_scatter_all_gather, "one neighbour"),
    ]:
        result = check_ring_all_reduce(wrong)
        assert not result, wrong.__name__
        assert why in result.failure, (wrong.__name__, result.failure)


def test_halving_doubling_grader_passes_it_and_fails_a_ring_a_collective_and_a_wrong_sum():
    assert check_halving_doubling_all_reduce(halving_doubling)
    for wrong, why in [
        (ring_all_reduce, "messages"),  # right sum, right bytes, 2(N-1) = 6 messages
        (with_all_reduce, "isend/irecv only"),
        (lambda x: halving_doubling(x) * 1.5, "tensor of shape"),
    ]:
        result = check_halving_doubling_all_reduce(wrong)
        assert not result and why in result.failure, result.failure


def test_ring_bytes_grader_fails_the_library_and_the_even_split():
    def by_hand(numel, n, size):
        chunk = [numel // n + (r < numel % n) for r in range(n)]  # torch.tensor_split's sizes
        return [size * (2 * numel - chunk[r] - chunk[(r + 1) % n]) for r in range(n)] if n > 1 else [0]

    assert check_ring_all_reduce_bytes(by_hand)
    asking = check_ring_all_reduce_bytes(ring_all_reduce_bytes)
    assert not asking and "llmedu.parallel" in asking.failure, asking.failure
    even = check_ring_all_reduce_bytes(lambda numel, n, size: [2 * (n - 1) * numel * size // n] * n)
    assert not even
