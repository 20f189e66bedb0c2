"""Graders of lesson 14 (ZeRO): each passes the right answer and fails a plausible wrong one."""

import math

from llmedu.checks.zero import check_comm_volume, check_lowest_stage, check_offload_traffic, check_shard


def test_shard_grader():
    assert check_shard(lambda n, w: (-(-n // w), -(-n // w) * w - n))
    assert not check_shard(lambda n, w: (n // w, n - (n // w) * w))  # floor: the last elements fall off


def test_comm_volume_grader():
    right = lambda n, w, s: (3 if s == 3 else 2) * n * (w - 1) / w
    assert check_comm_volume(right)
    assert not check_comm_volume(lambda n, w, s: (3 if s == 3 else 2) * n)  # forgets the (N-1)/N of a ring
    assert not check_comm_volume(lambda n, w, s: (1 if s in (1, 2) else 2) * n * (w - 1) / w)  # "ZeRO saves bytes"


def _states(n, w, s):
    return 2 * n / (w if s >= 3 else 1) + 2 * n / (w if s >= 2 else 1) + 12 * n / (w if s >= 1 else 1)


def test_lowest_stage_grader():
    right = lambda n, w, card: next((s for s in range(4) if _states(n, w, s) <= card), None)
    assert check_lowest_stage(right)
    # fp32 training's 16Ψ split as 4 + 4 + 8: the right total, the wrong share that stage 1 removes
    fp32 = lambda n, w, card: next(
        (
            s
            for s in range(4)
            if 4 * n / (w if s >= 3 else 1) + 4 * n / (w if s >= 2 else 1) + 8 * n / (w if s >= 1 else 1) <= card
        ),
        None,
    )
    assert not check_lowest_stage(fp32)
    assert not check_lowest_stage(lambda n, w, card: 3)  # "ZeRO-3 always": true only when nothing less fits


def test_offload_traffic_grader():
    assert check_offload_traffic(lambda n, w: (4 * math.ceil(n / w), 2 * math.ceil(n / w)))
    assert not check_offload_traffic(lambda n, w: (2 * math.ceil(n / w), 2 * math.ceil(n / w)))  # DeepSpeed's fp16 down
    assert not check_offload_traffic(lambda n, w: (4 * n, 2 * n))  # the whole model, not the shard
    assert not check_offload_traffic(lambda n, w: (4 * n / w, 2 * n / w))  # forgets the padding to N equal shards
