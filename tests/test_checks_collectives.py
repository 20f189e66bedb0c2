"""The graders of lessons 10-11 (llmedu.checks.collectives) pass our answers and fail wrong ones."""

import torch
import torch.distributed as dist

from llmedu.checks.collectives import (
    check_assign_buckets,
    check_hidden_communication,
    check_ring_all_reduce,
    check_ring_all_reduce_bytes,
    check_tree_schedule,
)
from llmedu.parallel.collectives import ring_all_reduce, ring_all_reduce_bytes, tree_schedule
from llmedu.parallel.data_parallel import assign_buckets, hidden_communication


def test_graders_pass_on_ours_and_fail_on_mistakes():
    assert check_tree_schedule(tree_schedule)
    assert not check_tree_schedule(lambda n, root: [[(root, r)] for r in range(n) if r != root])  # linear: N - 1 rounds
    # asking the library fails (test_graders_10 passes an answer worked out by hand)
    assert not check_ring_all_reduce_bytes(ring_all_reduce_bytes)
    assert not check_ring_all_reduce_bytes(lambda numel, n, size: [2 * (n - 1) * numel * size // n] * n)  # even only
    assert check_assign_buckets(assign_buckets)
    assert not check_assign_buckets(lambda sizes, cap: [list(range(len(sizes)))[::-1]])
    assert check_hidden_communication(hidden_communication)
    assert not check_hidden_communication(lambda events: 0.5)


def test_ring_all_reduce_grader_runs_processes_and_catches_a_wrong_sum():
    assert check_ring_all_reduce(ring_all_reduce)
    assert not check_ring_all_reduce(lambda x: x * 3)  # right only where all ranks hold the same values


def test_ring_all_reduce_grader_fails_the_right_sum_computed_without_a_ring():
    def with_all_reduce(x):  # torch's own collective
        dist.all_reduce(x)
        return x

    def all_gather_and_sum(x):  # every rank gets every tensor through a collective, then adds
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, x)
        return torch.stack(pieces).sum(0)

    def isend_everything_and_sum(x):  # isend/irecv only, but each rank sends its whole tensor to every other
        rank, n = dist.get_rank(), dist.get_world_size()
        inbox = {peer: torch.empty_like(x) for peer in range(n) if peer != rank}
        works = [dist.irecv(buffer, peer) for peer, buffer in inbox.items()]
        works += [dist.isend(x, peer) for peer in inbox]
        for work in works:
            work.wait()
        return x + sum(inbox.values())

    for wrong in (with_all_reduce, all_gather_and_sum, isend_everything_and_sum):
        result = check_ring_all_reduce(wrong)
        assert not result, wrong.__name__
        assert "isend/irecv only" in result.failure or "of the tensor" in result.failure, result.failure
