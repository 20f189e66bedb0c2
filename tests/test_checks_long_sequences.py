"""The graders of lesson 20 (llmedu.checks.long_sequences) pass our answers and fail plausible wrong ones."""

import numpy as np
import torch

from llmedu.checks.long_sequences import (
    check_merge_attention,
    check_ring_bytes,
    check_sp_activation_bytes,
    check_zigzag_chunks,
)
from llmedu.parallel.context_parallel import merge_partial_attention, ring_bytes_sent
from llmedu.parallel.sequence_layout import chunk_ids
from llmedu.parallel.sequence_parallel_attention import paper_block_activation_bytes


def test_sp_activation_bytes():
    assert check_sp_activation_bytes(lambda s, b, h, a, t: paper_block_activation_bytes(s, b, h, a, t, "sp"))
    assert not check_sp_activation_bytes(lambda s, b, h, a, t: paper_block_activation_bytes(s, b, h, a, t, "tp"))
    assert not check_sp_activation_bytes(lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h) / t / 2)  # halved


def test_zigzag_chunks():
    assert check_zigzag_chunks(lambda r, n: chunk_ids(r, n, "zigzag"))
    # the same right answer as an array, a tensor or a tuple is still right
    assert check_zigzag_chunks(lambda r, n: np.array([r, 2 * n - 1 - r]))
    assert check_zigzag_chunks(lambda r, n: torch.tensor([r, 2 * n - 1 - r]))
    assert check_zigzag_chunks(lambda r, n: (r, 2 * n - 1 - r))
    assert not check_zigzag_chunks(lambda r, n: [2 * r, 2 * r + 1])  # contiguous pairs: unbalanced
    assert not check_zigzag_chunks(lambda r, n: [r, 2 * n - r])  # off by one at the far end


def test_merge_attention():
    assert check_merge_attention(merge_partial_attention)
    assert not check_merge_attention(lambda o1, l1, o2, l2: ((o1 + o2) / 2, torch.logaddexp(l1, l2)))  # plain mean

    def max_weighted(o1, l1, o2, l2):  # weights from the maxima, forgetting each block's mass
        w1 = (l1 >= l2).to(o1.dtype)[..., None]
        return w1 * o1 + (1 - w1) * o2, torch.maximum(l1, l2)

    assert not check_merge_attention(max_weighted)

    def without_nan_guard(o1, l1, o2, l2):  # nan only if both blocks saw no key, which the grader never asks
        lse = torch.logaddexp(l1, l2)
        return torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2, lse

    assert check_merge_attention(without_nan_guard)  # also right: the grader does not demand our nan_to_num


def test_ring_bytes():
    assert check_ring_bytes(ring_bytes_sent)
    assert not check_ring_bytes(lambda b, h, t, d, n, size: n * 2 * b * h * (t // n) * d * size)  # N steps, not N-1
    assert not check_ring_bytes(lambda b, h, t, d, n, size: (n - 1) * b * h * (t // n) * d * size)  # K only
