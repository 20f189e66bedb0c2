"""Graders of lesson 13's planner half: each passes the right answer and fails a plausible wrong one."""

import math

import pytest

from llmedu.checks.planner import (
    SCENARIOS,
    check_micro_batches_for_bubble,
    check_pick,
    check_ring_all_reduce_time,
)
from llmedu.planner.clusters import cluster
from llmedu.planner.memory import Batch, Layout
from llmedu.planner.search import plan


def test_ring_all_reduce_time_grader():
    assert check_ring_all_reduce_time(lambda n, p, beta, alpha: 2 * (p - 1) * (alpha + n / (p * beta)))
    # the bandwidth term without the 1/p chunking: what a naive "everyone sends everything" would cost
    assert not check_ring_all_reduce_time(lambda n, p, beta, alpha: 2 * (p - 1) * (alpha + n / beta))
    # latency once instead of once per step
    assert not check_ring_all_reduce_time(lambda n, p, beta, alpha: alpha + 2 * (p - 1) * n / (p * beta))


def test_micro_batches_for_bubble_grader():
    assert check_micro_batches_for_bubble(lambda p, v, target: math.ceil((p - 1) / (v * target) - 1e-9))
    # GPipe's (p-1)/(m+p-1) read as the interleaved target, ignoring v
    assert not check_micro_batches_for_bubble(lambda p, v, target: max(1, math.ceil((p - 1) / target - (p - 1) - 1e-9)))
    assert not check_micro_batches_for_bubble(lambda p, v, target: math.ceil((p - 1) / target))  # forgets v


@pytest.mark.slow
def test_pick_grader_accepts_the_planner_and_refuses_what_does_not_fit():
    def planner(name):
        model, preset, nodes, sequences, seq_len = SCENARIOS[name]
        return plan(model, cluster(preset, nodes=nodes), Batch(sequences, seq_len), top=1)[0].layout

    assert check_pick(planner)

    def plain_ddp(name):  # "data parallel is always first": the 70B model's states do not fit that way
        model, preset, nodes, *_ = SCENARIOS[name]
        return Layout(dp=8 * nodes)

    assert not check_pick(plain_ddp)
    assert not check_pick(lambda name: (8, 1, 1))  # a tuple, not a Layout


def test_pick_grader_names_a_degree_that_does_not_divide():
    """A layout whose micro-batches do not divide the batch (8 x 3 into 256 sequences) fails with the reason,
    before the cost model is asked (it would have floored the micro-batches and graded the layout)."""
    result = check_pick(lambda name: Layout(dp=8, micro_batch=3))
    assert not result
    assert "dp=8 x micro_batch=3 must divide the batch of 256 sequences" in result.failure
