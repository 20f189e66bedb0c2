"""``all_to_all`` against a single-process oracle and gloo's ``all_to_all_single``, on 2 and 3 processes.

Every rank can rebuild every other rank's input (seeded by rank), so the oracle is the plain
transpose: rank r's result is piece r of every rank's tensor, in rank order. all-to-all only moves
values, so the comparison is bit-exact (tolerance 0).
"""

import pytest
import torch
import torch.distributed as dist
from raised import raised

from llmedu.parallel import launch
from llmedu.parallel.collectives import all_to_all, all_to_all_bytes, traffic

SHAPES = [(1,), (2,), (7,), (6, 3), (5, 2, 2), (12,)]  # fewer rows than ranks, uneven, 2-D, 3-D, even


def _data(rank, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + sum(shape)))


def _worker():
    rank, n = dist.get_rank(), dist.get_world_size()
    failures, sent = [], {}
    for shape in SHAPES:
        x = _data(rank, shape)
        with traffic() as t:
            got = all_to_all(x)
        sent[shape] = t.bytes_sent
        expected = torch.cat([_data(q, shape).tensor_split(n, dim=0)[rank] for q in range(n)])
        if got.shape != expected.shape or not torch.equal(got, expected):
            failures.append(f"N={n} {shape}: got {tuple(got.shape)}, expected {tuple(expected.shape)}")
        if shape[0] % n == 0:  # gloo's own, where the rows divide evenly
            theirs = torch.empty_like(x)
            dist.all_to_all_single(theirs, x)
            if not torch.equal(got, theirs):
                failures.append(f"N={n} {shape}: differs from dist.all_to_all_single")
    # shapes that differ by rank; a 0-d tensor
    errors = raised(lambda: all_to_all(torch.ones(3 + rank)), lambda: all_to_all(torch.tensor(1.0)))
    return failures, sent, errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_is_a_transpose_across_ranks(world_size):
    results = launch(_worker, world_size, echo=False, timeout=30)
    for rank, (failures, sent, errors) in enumerate(results):
        assert not failures, failures
        for shape, nbytes in sent.items():  # the cost model, to the byte: every piece but its own, once
            row = 1 if len(shape) == 1 else shape[1] * (shape[2] if len(shape) == 3 else 1)
            assert nbytes == all_to_all_bytes(shape[0], row, world_size)[rank]
        assert "every rank must pass the same shape and dtype" in errors[0]
        assert "at least one dimension" in errors[1]


def test_all_to_all_cost_model():
    assert all_to_all_bytes(12, 1, 4, 4) == [36] * 4  # (N - 1) / N of 48 bytes
    assert all_to_all_bytes(5, 2, 2, 1) == [4, 6]  # pieces of 3 and 2 rows of 2 elements
    assert all_to_all_bytes(7, 1, 1) == [0]
