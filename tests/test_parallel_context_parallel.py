"""Ring attention on 2 and 4 gloo processes against SDPA on the full sequence.

Every rank builds the same full Q, K, V and output gradient (same seed), runs PyTorch's
``scaled_dot_product_attention`` on the whole sequence (the oracle), and runs ring attention on its
own part; its output and its dQ, dK, dV must equal its part of the oracle's.

Tolerance 1e-5 in fp32: the ring only changes the order of the sums (a softmax over N blocks
combined by rescaling instead of one softmax, dK and dV summed over the ranks' queries one block at
a time). With values of order 1 and at most 32 terms per sum, rounding stays below 1e-6 (we saw
at most 7.2e-7); a wrong mask, a block skipped or counted twice, a gradient sent to the wrong rank is off by
O(0.1).

One launch per world size runs every check (starting processes costs seconds).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from raised import raised

from llmedu.parallel import launch
from llmedu.parallel.context_parallel import (
    attention_peak_memory,
    merge_partial_attention,
    ring_attention,
    ring_bytes_sent,
    tiles_computed,
    work_per_rank,
)
from llmedu.parallel.sequence_layout import merge_sequence, split_sequence, zigzag_merge, zigzag_split

ATOL = 1e-5
B, H, T, D = 1, 2, 32, 8
CASES = [(causal, layout) for causal in (False, True) for layout in ("contiguous", "zigzag")]
MEMORY_SEQ_LENS = (64, 128, 256)
ODD_T = 40


def _full_inputs(seq_len: int = T) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, seq_len, D, generator=g) for _ in range(4)]  # q, k, v, grad of the output


def _errors(causal: bool, layout: str, rank: int, world: int, seq_len: int = T) -> tuple[dict, tuple[int, int, int]]:
    """Largest differences from SDPA on the full sequence, and the tiles counted (forward, backward, size)."""
    q, k, v, grad = _full_inputs(seq_len)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal)
    ref.backward(grad)
    part = [split_sequence(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
    with tiles_computed() as tiles:
        out = ring_attention(*part, causal=causal, layout=layout)
        out.backward(split_sequence(grad, rank, world, layout))
    errors = {"out": (out - split_sequence(ref, rank, world, layout)).abs().max().item()}
    for name, mine, theirs in zip(("dq", "dk", "dv"), part, full):
        errors[name] = (mine.grad - split_sequence(theirs.grad, rank, world, layout)).abs().max().item()
    pieces = [torch.empty_like(out) for _ in range(world)]  # the whole output, put back together
    dist.all_gather(pieces, out.detach().contiguous())
    errors["merged out"] = (merge_sequence(pieces, layout) - ref).abs().max().item()
    return errors, (tiles.forward, tiles.backward, tiles.tile_len)


def _bad_input_messages(rank: int) -> list[str]:
    q = torch.randn(B, H, 4 if rank == 0 else 6, D)  # rank 0 holds fewer tokens than the others
    return raised(
        lambda: ring_attention(q, q, q),
        lambda: ring_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], layout="zigzag"),  # odd: no two chunks
    )


def _forward_bytes_sent(rank: int, world: int) -> int:
    """Bytes this rank hands to isend during one forward (no shape check): the count ring_bytes_sent predicts."""
    sent, original = [0], dist.isend

    def counting(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.isend = counting
    try:
        q = split_sequence(_full_inputs()[0], rank, world)
        ring_attention(q, q, q, causal=True, check=False)
    finally:
        dist.isend = original
    return sent[0]


def _worker() -> dict:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {case: _errors(*case, rank, world) for case in CASES}
    # 40 tokens: chunks of 10 (N = 2) or of 5 (N = 4, zig-zag): odd sizes, and blocks of unequal work
    result["odd"] = {case: _errors(*case, rank, world, seq_len=ODD_T)[0] for case in CASES}
    result["sent"] = _forward_bytes_sent(rank, world)
    result["memory"] = {
        (layout, n): attention_peak_memory(split_sequence(torch.randn(B, H, n, D), rank, world, layout), True, layout)
        for layout in ("contiguous", "zigzag")
        for n in MEMORY_SEQ_LENS
    }
    result["bad"] = _bad_input_messages(rank)
    return result


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, launch(_worker, request.param, echo=False)


def test_equals_sdpa_on_the_full_sequence(ranks):
    world, results = ranks
    for rank, result in enumerate(results):
        for (causal, layout), (errors, _) in ((case, result[case]) for case in CASES):
            for what, err in errors.items():
                assert err < ATOL, f"N={world} rank {rank} causal={causal} {layout}: {what} differs by {err:.2e}"


def test_equals_sdpa_when_chunks_have_odd_lengths(ranks):
    world, results = ranks
    for rank, result in enumerate(results):
        for (causal, layout), errors in result["odd"].items():
            for what, err in errors.items():
                assert err < ATOL, f"T={ODD_T} N={world} rank {rank} causal={causal} {layout}: {what} off by {err:.2e}"


def test_tiles_counted_match_the_schedule_and_zigzag_balances(ranks):
    world, results = ranks
    for causal, layout in CASES:
        counted = [result[(causal, layout)][1] for result in results]  # (forward, backward, tile_len) per rank
        expected = work_per_rank(T, world, layout, causal)
        tile_len = T // world if layout == "contiguous" else T // (2 * world)
        assert counted == [(n, n, tile_len) for n in expected], (causal, layout)
        print(f"N={world} causal={causal} {layout}: tiles per rank {expected} of {tile_len}x{tile_len} scores")
    assert work_per_rank(T, world, "contiguous", True) == list(range(1, world + 1))  # rank r: blocks 0..r
    assert work_per_rank(T, world, "zigzag", True) == [2 * world + 1] * world  # the same on every rank
    assert work_per_rank(T, world, "zigzag", False) == [4 * world] * world


def test_peak_memory_per_rank_shrinks_with_more_ranks(ranks):
    world, results = ranks
    single = {n: attention_peak_memory(torch.randn(B, H, n, D)) for n in MEMORY_SEQ_LENS}  # one rank, no ring
    for layout in ("contiguous", "zigzag"):
        peaks = {n: max(result["memory"][(layout, n)] for result in results) for n in MEMORY_SEQ_LENS}
        print(f"{layout} N={world}: peak bytes per rank {peaks}, one rank {single}")
        for n in MEMORY_SEQ_LENS:
            assert peaks[n] < single[n]
        assert peaks[256] > peaks[128] > peaks[64]


def test_bad_input_raises_the_same_error_on_every_rank(ranks):
    _, results = ranks
    for result in results:
        mismatch, odd = result["bad"]
        assert "every rank must pass the same shape" in mismatch
        assert "rank 0 has (1, 2, 4, 8)" in mismatch and "rank 1 has (1, 2, 6, 8)" in mismatch
        assert "even number" in odd


def test_forward_sends_what_ring_bytes_sent_predicts(ranks):
    world, results = ranks
    assert [result["sent"] for result in results] == [ring_bytes_sent(B, H, T, D, world)] * world


def test_merge_partial_attention_equals_one_softmax():
    """Two key blocks merged by their logsumexps = softmax over all keys (fp64, so 1e-12)."""
    g = torch.Generator().manual_seed(3)
    s, v = torch.randn(2, 3, 5, 11, generator=g, dtype=torch.float64), torch.randn(2, 3, 11, 4, dtype=torch.float64)
    parts = [
        (torch.softmax(s[..., c], -1) @ v[..., c, :], torch.logsumexp(s[..., c], -1))
        for c in (slice(0, 4), slice(4, 11))
    ]
    o, lse = merge_partial_attention(*parts[0], *parts[1])
    assert (o - torch.softmax(s, -1) @ v).abs().max() < 1e-12
    assert (lse - torch.logsumexp(s, -1)).abs().max() < 1e-12
    o, lse = merge_partial_attention(*parts[0], torch.zeros_like(parts[0][0]), torch.full_like(parts[0][1], -torch.inf))
    assert torch.equal(o, parts[0][0]) and torch.equal(lse, parts[0][1])  # a block no query could see adds nothing
    with pytest.raises(ValueError, match="not divisible by 3"):
        ring_bytes_sent(1, 1, 8, 4, 3)


def test_one_rank_without_torch_distributed_is_plain_attention():
    q, k, v, grad = _full_inputs(16)
    for causal in (False, True):
        for layout in ("contiguous", "zigzag"):
            ours = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            out = ring_attention(*ours, causal=causal, layout=layout)
            expected = F.scaled_dot_product_attention(*ref, is_causal=causal)
            out.backward(grad)
            expected.backward(grad)
            assert (out - expected).abs().max() < ATOL
            for a, b in zip(ours, ref):
                assert (a.grad - b.grad).abs().max() < ATOL


def test_split_and_merge_round_trip_and_bad_lengths():
    x = torch.arange(2 * 24).view(2, 24)
    for world in (1, 2, 3, 4):
        pieces = [zigzag_split(x, r, world, dim=1) for r in range(world)]
        assert torch.equal(zigzag_merge(pieces, world, dim=1), x)
        assert torch.equal(merge_sequence([split_sequence(x, r, world, dim=1) for r in range(world)], dim=1), x)
    assert zigzag_split(torch.arange(8), 1, 2, dim=0).tolist() == [2, 3, 4, 5]  # chunks 1 and 2 of 4
    with pytest.raises(ValueError, match="not divisible by 5"):
        split_sequence(x, 0, 5, dim=1)
    with pytest.raises(ValueError, match="not divisible by 16"):
        zigzag_split(x, 0, 8, dim=1)
    with pytest.raises(ValueError, match="layout must be one of"):
        split_sequence(x, 0, 2, layout="striped", dim=1)
    with pytest.raises(ValueError, match="not divisible by 10"):
        work_per_rank(12, 5, "zigzag")
    with pytest.raises(ValueError, match="one shape"):
        ring_attention(torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))
