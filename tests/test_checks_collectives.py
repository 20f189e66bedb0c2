"""The graders of lessons 09-10 (llmedu.checks.collectives) pass our answers and fail wrong ones."""

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
    assert check_ring_all_reduce_bytes(ring_all_reduce_bytes)
    assert not check_ring_all_reduce_bytes(lambda numel, n, size: [2 * (n - 1) * numel * size // n] * n)  # even only
    assert check_assign_buckets(assign_buckets)
    assert not check_assign_buckets(lambda sizes, cap: [list(range(len(sizes)))[::-1]])
    assert check_hidden_communication(hidden_communication)
    assert not check_hidden_communication(lambda events: 0.5)


def test_ring_all_reduce_grader_runs_processes_and_catches_a_wrong_sum():
    assert check_ring_all_reduce(ring_all_reduce)
    assert not check_ring_all_reduce(lambda x: x * 3)  # right only where all ranks hold the same values
