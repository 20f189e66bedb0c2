"""Our send/recv collectives against torch.distributed's own, on 2, 3 and 4 gloo processes.

One launch per world size runs every check, all-to-all's too (starting processes costs seconds); the
worker returns a list of failures, empty when all agree.

Tolerances: broadcast, gather, scatter, all-gather, max and min move or pick values, so they
must be bit-exact. Sums of float32 differ from gloo's only by the order of the additions: with
N <= 4 terms of size |x| <= ~5 the rounding error is below N * |x| * 2**-24 ~ 1.2e-6, so
atol=1e-5 can only be exceeded by a real mistake (a chunk missed or added twice is off by ~1).
"""

import pytest
import torch
import torch.distributed as dist
from raised import raised

from llmedu.parallel import (
    all_gather,
    broadcast,
    gather,
    launch,
    reduce,
    reduce_scatter,
    ring_all_reduce,
    scatter,
    traffic,
)
from llmedu.parallel.collectives import all_to_all, all_to_all_bytes, ring_all_reduce_bytes, tree_schedule

SHAPES = [(1,), (2,), (7,), (1000,), (1001,), (3, 5), (5, 3, 2)]  # sizes below N, uneven, 2-D, 3-D
ROOTED_SHAPES = [(1,), (7,), (5, 3, 2)]  # broadcast, reduce, gather, scatter: every root, fewer shapes
ATOL_SUM = 1e-5


def _data(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    """Rank ``rank``'s input: every rank can rebuild every other rank's (for references torch lacks)."""
    g = torch.Generator().manual_seed(1000 * rank + sum(shape))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=dtype)


def _compare(failures, what, got, expected, atol=0.0):
    if got.shape != expected.shape or got.dtype != expected.dtype:
        failures.append(
            f"{what}: got {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
        )
    elif not torch.allclose(got, expected, rtol=0, atol=atol):
        failures.append(f"{what}: max |difference| {(got - expected).abs().max().item():.3g} > {atol}")


def _every_collective() -> list[str]:
    rank, n = dist.get_rank(), dist.get_world_size()
    failures: list[str] = []
    for shape in SHAPES:
        for dtype in (torch.float32, torch.int64):
            x = _data(rank, shape, dtype)
            tol = ATOL_SUM if dtype.is_floating_point else 0.0
            tag = f"N={n} {shape} {dtype}"
            for op, torch_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
                ref = x.clone()
                dist.all_reduce(ref, torch_op)
                _compare(
                    failures, f"ring_all_reduce {op} {tag}", ring_all_reduce(x, op), ref, tol if op == "sum" else 0.0
                )
                _compare(
                    failures,
                    f"reduce_scatter {op} {tag}",
                    reduce_scatter(x, op),
                    ref.tensor_split(n)[rank],
                    tol if op == "sum" else 0.0,
                )
            for root in range(n) if shape in ROOTED_SHAPES else ():
                ref = x.clone()
                dist.broadcast(ref, root)
                _compare(failures, f"broadcast src={root} {tag}", broadcast(x, root), ref)
                ref = x.clone()
                dist.reduce(ref, root)
                ours = reduce(x, root)
                if rank == root:
                    _compare(failures, f"reduce dst={root} {tag}", ours, ref, tol)
                elif ours is not None:
                    failures.append(f"reduce dst={root}: rank {rank} should get None")
                refs = [torch.empty_like(x) for _ in range(n)] if rank == root else None
                dist.gather(x, refs, dst=root)
                ours = gather(x, root)
                if rank == root:
                    for i in range(n):
                        _compare(failures, f"gather dst={root} piece {i} {tag}", ours[i], refs[i])
                # scatter: torch's needs equal pieces, ours splits like tensor_split
                full = _data(root, shape, dtype)
                _compare(
                    failures,
                    f"scatter src={root} {tag}",
                    scatter(full if rank == root else torch.zeros_like(full), root),
                    full.tensor_split(n)[rank],
                )
                if shape[0] % n == 0:
                    ref = torch.empty_like(full.tensor_split(n)[rank])
                    dist.scatter(ref, list(full.tensor_split(n)) if rank == root else None, src=root)
                    _compare(failures, f"scatter vs dist.scatter src={root} {tag}", scatter(full, root), ref)
            refs = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(refs, x)
            _compare(failures, f"all_gather {tag}", all_gather(x), torch.cat(refs))
            # uneven all-gather (gloo's refuses different sizes): rank r contributes r + 1 rows
            mine = _data(rank, (rank + 1, 3), dtype)
            expected = torch.cat([_data(r, (r + 1, 3), dtype) for r in range(n)])
            _compare(failures, f"all_gather uneven {tag}", all_gather(mine), expected)
    return failures


def _traffic_and_bad_input() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    x = torch.ones(120 * n, dtype=torch.float32)  # divisible by N: exact 2 (N - 1) / N
    with traffic() as t:
        ring_all_reduce(x)
    out["ring_bytes"], out["ring_messages"] = t.bytes_sent, t.messages_sent
    uneven = []
    for numel in (1, 3, 1001):  # chunks of unequal sizes, some empty
        with traffic() as t:
            ring_all_reduce(torch.ones(numel, dtype=torch.float64))
        uneven.append(t.bytes_sent)
    out["uneven_ring_bytes"] = uneven
    with traffic() as t:
        broadcast(x, 0)
    out["broadcast_bytes"] = t.bytes_sent
    errors = []
    for name, call in [
        ("ring_all_reduce", lambda: ring_all_reduce(torch.ones(3 + rank))),
        ("broadcast", lambda: broadcast(torch.ones(2, 2) if rank else torch.ones(4))),
        ("reduce dtype", lambda: reduce(torch.ones(3, dtype=torch.float64 if rank else torch.float32))),
        ("all_gather trailing dims", lambda: all_gather(torch.ones(2, 2 + rank))),
        ("reduce op", lambda: reduce(torch.ones(3), op="mean")),
        ("scatter root", lambda: scatter(torch.ones(3), src=n)),
    ]:
        try:
            call()
            errors.append(f"{name}: no error")
        except (ValueError, TypeError) as err:
            errors.append(f"{name}: {err}")
    out["errors"] = errors
    out["after_errors"] = ring_all_reduce(torch.ones(5)).tolist()  # the group still works
    return out


# -- all-to-all (moved here from its own file, so that it shares these launches) ---------------------------
# Every rank can rebuild every other rank's input (seeded by rank), so the oracle is the plain transpose:
# rank r's result is piece r of every rank's tensor, in rank order. all-to-all only moves values, so the
# comparison is bit-exact (tolerance 0).
A2A_SHAPES = [(1,), (2,), (7,), (6, 3), (5, 2, 2), (12,)]  # fewer rows than ranks, uneven, 2-D, 3-D, even


def _a2a_data(rank, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + sum(shape)))


def _all_to_all_check():
    rank, n = dist.get_rank(), dist.get_world_size()
    failures, sent = [], {}
    for shape in A2A_SHAPES:
        x = _a2a_data(rank, shape)
        with traffic() as t:
            got = all_to_all(x)
        sent[shape] = t.bytes_sent
        expected = torch.cat([_a2a_data(q, shape).tensor_split(n, dim=0)[rank] for q in range(n)])
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


def _every_check() -> dict:
    return {"failures": _every_collective(), **_traffic_and_bad_input(), "all_to_all": _all_to_all_check()}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N={n}")
def ranks(request):
    return request.param, launch(_every_check, request.param, echo=False, timeout=30)  # one start-up per size


def test_all_to_all_is_a_transpose_across_ranks(ranks):
    world_size, results = ranks
    for rank, result in enumerate(results):
        failures, sent, errors = result["all_to_all"]
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


def test_collectives_equal_torch_distributed_count_bytes_and_fail_clearly(ranks):
    n, results = ranks
    failures = [f for res in results for f in res["failures"]]
    assert not failures, "\n".join(failures[:20])

    tensor_bytes = 120 * n * 4
    for rank, res in enumerate(results):
        assert res["ring_bytes"] == 2 * (n - 1) * tensor_bytes // n  # the ring's 2 (N - 1) / N
        assert res["ring_messages"] == 2 * (n - 1)
        assert res["uneven_ring_bytes"] == [ring_all_reduce_bytes(m, n, 8)[rank] for m in (1, 3, 1001)]
        sends = sum(s == rank for pairs in tree_schedule(n, 0) for s, _ in pairs)
        assert res["broadcast_bytes"] == sends * tensor_bytes
        assert res["after_errors"] == [float(n)] * 5  # the group still works after the errors
        errors = dict(e.split(": ", 1) for e in res["errors"])
        assert "rank 0 has (3,) float32, rank 1 has (4,) float32" in errors["ring_all_reduce"]
        assert "same shape and dtype" in errors["broadcast"]
        assert "rank 1 has (3,) float64" in errors["reduce dtype"]
        assert "except along dim 0" in errors["all_gather trailing dims"]
        assert "op must be one of" in errors["reduce op"]
        assert f"root rank must be in 0..{n - 1}" in errors["scatter root"]
    if n == 4:  # binomial tree from rank 0: rank 0 sends twice, rank 1 once, ranks 2 and 3 never
        assert [r["broadcast_bytes"] // tensor_bytes for r in results] == [2, 1, 0, 0]


def test_tree_schedule_reaches_everyone_in_log2_rounds():
    assert tree_schedule(4, 0) == [[(0, 1)], [(0, 2), (1, 3)]]
    assert tree_schedule(5, 3) == [[(3, 4)], [(3, 0), (4, 1)], [(3, 2)]]
    assert tree_schedule(1, 0) == []
    for n in range(1, 17):
        for root in range(n):
            have = {root}
            for pairs in tree_schedule(n, root):
                assert all(s in have and r not in have for s, r in pairs)
                have |= {r for _, r in pairs}
            assert have == set(range(n)) and len(tree_schedule(n, root)) == (n - 1).bit_length()


def test_ring_cost_model():
    assert ring_all_reduce_bytes(12, 4, 4) == [72] * 4  # 2 (N - 1) / N * 48 bytes
    assert ring_all_reduce_bytes(5, 1) == [0]
    assert sum(ring_all_reduce_bytes(1001, 4, 1)) == 2 * 3 * 1001  # every chunk crosses N - 1 links twice
