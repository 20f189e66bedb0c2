"""Graders of lesson 13's planner half: each passes the right answer and fails a plausible wrong one."""

import math

import pytest

from llmedu.checks.planner import (
    SCENARIOS,
    check_micro_batches_for_bubble,
    check_pick,
    check_ring_all_reduce_time,
)
from llmedu.parallel.cost_model import cluster
from llmedu.parallel.layout_memory import Batch, Layout
from llmedu.parallel.planner import plan


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
