"""Lesson 06's new grader (the micro-batch at which activations outweigh Adam's states) and the CUDA caching
allocator's rounding rules that the lesson applies to its tensors."""

import pytest

from llmedu.checks.anatomy import check_activation_batch
from llmedu.memory.cuda_allocator import allocate, block_bytes, segment_bytes
from llmedu.memory.estimate import activation_bytes_per_layer


def by_hand(psi, layers, h, a, s):
    per_sequence = layers * (34 * s * h + 5 * a * s * s)  # 16-bit with dropout, all layers, one sequence
    return max(1, -(-16 * psi // per_sequence))


def test_right_answer_passes():
    assert check_activation_batch(by_hand)


def test_plausible_wrong_values_fail():
    assert not check_activation_batch(lambda psi, L, h, a, s: 16 * psi // (L * (34 * s * h + 5 * a * s * s)))  # floor
    assert not check_activation_batch(lambda psi, L, h, a, s: by_hand(psi, 1, h, a, s))  # one layer
    assert not check_activation_batch(lambda psi, L, h, a, s: by_hand(psi // 4, L, h, a, s))  # 4Ψ: weights alone
    assert not check_activation_batch(lambda psi, L, h, a, s: 16 * psi / (L * (34 * s * h + 5 * a * s * s)))  # real


def test_right_values_computed_the_wrong_way_fail():
    def library_search(psi, L, h, a, s):  # right values, but the library does the arithmetic
        b = 1
        while L * activation_bytes_per_layer(s, b, h, a) < 16 * psi:
            b += 1
        return b

    assert not check_activation_batch(library_search)

    def capped_search(psi, L, h, a, s):  # right on the first four cases, gives up at 1,024 sequences
        for b in range(1, 1025):
            if L * (34 * s * h + 5 * a * s * s) * b >= 16 * psi:
                return b
        return 1024

    assert not check_activation_batch(capped_search)


def test_blocks_round_up_to_512_bytes():
    assert [block_bytes(n) for n in (0, 1, 512, 513, 1024, 3 * 2**20 + 1)] == [
        512,
        512,
        512,
        1024,
        1024,
        3 * 2**20 + 512,
    ]
    with pytest.raises(ValueError, match="-1"):
        block_bytes(-1)
    with pytest.raises(ValueError, match="1.5"):
        block_bytes(1.5)


def test_segments_follow_the_pools():
    assert segment_bytes(512) == segment_bytes(2**20) == 2 * 2**20  # small pool: 2 MiB segments
    assert segment_bytes(2**20 + 512) == segment_bytes(10 * 2**20 - 512) == 20 * 2**20  # large, under 10 MiB
    assert segment_bytes(10 * 2**20) == 10 * 2**20 and segment_bytes(11 * 2**20 + 1) == 12 * 2**20  # rounded to 2 MiB


def test_allocate_packs_small_blocks_into_one_segment_and_splits_large_ones():
    pools = allocate([4] * 100)  # 100 scalars: 100 blocks of 512 B, one 2 MiB segment
    assert (pools.requested, pools.allocated, pools.reserved, pools.segments) == (400, 51_200, 2 * 2**20, 1)
    pools = allocate([3 * 2**20, 3 * 2**20, 3 * 2**20])  # 20 MiB segment: 3 + 3 + 3, the rest (11 MiB) cached
    assert (pools.allocated, pools.reserved, pools.segments, pools.free_blocks) == (
        9 * 2**20,
        20 * 2**20,
        1,
        [11 * 2**20],
    )
    pools = allocate([2**20 + 512, 19 * 2**20])  # the rest of the first segment is just too small for the second
    assert pools.segments == 2 and pools.reserved == 20 * 2**20 + 20 * 2**20  # 19 MiB >= 10 MiB: rounded to 2 MiB
    pools = allocate([10 * 2**20 - 512])  # the rest, 10 MiB + 512 B, is split off
    assert pools.free_blocks == [10 * 2**20 + 512]
    pools = allocate([2**20 * 19 + 2**19])  # 19.5 MiB -> 20 MiB segment, rest 0.5 MiB is not split: allocated 20 MiB
    assert pools.allocated == pools.reserved == 20 * 2**20
