"""Ring attention with FlashAttention's tiles inside each step, with the K/V transfer overlapped or not, over a
``Link``; the timing model and its summary; the bytes sequence parallelism's collectives send.

Correctness: against SDPA on the full sequence (1e-5 in fp32, as ``test_parallel_context_parallel.py``), with
tiles that do not divide the chunks, the transfer posted after the compute, and every message over a ``Link``
(the K/V and dK/dV messages then carry no tag and are matched by their order). Timing: a lower bound that a
loaded machine cannot break: posted after the compute, a step lasts at least the link's transfer beyond it.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmedu.parallel import launch
from llmedu.parallel.context_parallel import attention_peak_memory, ring_attention, ring_step_times
from llmedu.parallel.link import Link
from llmedu.parallel.long_sequence_study import collective_volumes, overlap_study, step_model, summarise_steps
from llmedu.parallel.sequence_layout import split_sequence

ATOL = 1e-5
VARIANTS = [
    dict(block_size=5),  # 5 does not divide the chunks: short last tiles, diagonal tiles cut unevenly
    dict(block_size=4, overlap=False),
    dict(block_size=3, link=True),
    dict(overlap=False, link=True),
]
SLOW = (2e-3, 2e6)  # alpha 2 ms, 2 MB/s: a K/V message of 8 KiB takes about 6 ms


def _errors(causal: bool, layout: str, variant: dict) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, 48, 8, generator=g) for _ in range(4))  # (B, H, T, D)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal)
    ref.backward(grad)
    kwargs = dict(variant, link=Link(1e-5, 1e10)) if variant.get("link") else variant
    mine = [split_sequence(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, causal=causal, layout=layout, **kwargs)
    out.backward(split_sequence(grad, rank, world, layout))
    errors = [(out - split_sequence(ref, rank, world, layout)).abs().max().item()]
    errors += [(m.grad - split_sequence(f.grad, rank, world, layout)).abs().max().item() for m, f in zip(mine, full)]
    return max(errors)


def _first_step(overlap: bool) -> dict:
    q = split_sequence(torch.randn(1, 2, 64, 8), dist.get_rank(), dist.get_world_size(), "zigzag")
    link = Link(*SLOW)
    with torch.no_grad(), ring_step_times() as log:
        ring_attention(q, q, q, True, "zigzag", block_size=8, overlap=overlap, link=link)
    return dict(log[0], comm_s=link.message_time(2 * q.numel() * q.element_size()))


def _worker() -> dict:
    torch.set_num_threads(1)
    result = {
        (causal, layout, i): _errors(causal, layout, variant)
        for causal in (False, True)
        for layout in ("contiguous", "zigzag")
        for i, variant in enumerate(VARIANTS)
    }
    result["blocking"], result["overlapped"] = _first_step(False), _first_step(True)
    result["volumes"] = collective_volumes(16, 2, 8)
    return result


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, launch(_worker, request.param, echo=False)


def test_flash_tiles_overlap_and_link_equal_sdpa(ranks):
    world, results = ranks
    for rank, result in enumerate(results):
        for (causal, layout, i), err in ((k, v) for k, v in result.items() if isinstance(k, tuple)):
            assert err < ATOL, f"N={world} rank {rank} causal={causal} {layout} {VARIANTS[i]}: off by {err:.2e}"


def test_a_blocking_step_waits_for_the_transfer_after_its_compute(ranks):
    _, results = ranks
    for result in results:
        blocking, overlapped = result["blocking"], result["overlapped"]
        assert blocking["step_s"] - blocking["compute_s"] >= blocking["comm_s"] * 0.99  # the transfer came after
        assert overlapped["step_s"] >= overlapped["comm_s"] * 0.99  # posted first: at least the transfer


def test_sequence_parallel_collectives_send_what_an_all_reduce_sends(ranks):
    world, results = ranks
    for result in results:
        v = result["volumes"]
        assert v["reduce-scatter"] + v["all-gather"] == v["all-reduce"] == 2 * (world - 1) * v["activation"] // world
        assert v["reduce-scatter"] == v["all-gather"] > 0


def test_flash_tiles_keep_a_ranks_peak_linear_in_the_length():
    """One process: the one-tile ring holds a (T, T) score tile, the tiled one a (32, 32) tile at a time."""
    tile, tiled = {}, {}
    for n in (128, 256):
        q = torch.randn(1, 1, n, 4)
        tile[n], tiled[n] = attention_peak_memory(q), attention_peak_memory(q, block_size=32)
    assert tiled[256] < tile[256] / 4
    assert tile[256] / tile[128] > 3  # quadratic
    assert tiled[256] / tiled[128] < 2.3  # linear, plus the fixed tile


def test_summary_reads_the_slowest_rank_and_the_model():
    c, C = 0.010, 0.020  # seconds
    blocking = [[(c, c + C), (c, c)]] * 4
    overlapped = [[(c, max(c, C)), (c, c)]] * 4
    # rank 0 computes half as long; its steps wait for rank 1's block, so they last as long as rank 1's
    fast = {False: [[(c / 2, c + C), (c / 2, c)]] * 4, True: [[(c / 2, max(c, C)), (c / 2, c)]] * 4}
    study = [
        {(1.0, o): dict(steps=fast[o], comm_s=C, overruns=0) for o in (False, True)},
        {
            (1.0, False): dict(steps=blocking, comm_s=C, overruns=0),
            (1.0, True): dict(steps=overlapped, comm_s=C, overruns=1),
        },
    ]
    first, last = summarise_steps(study, 1.0)
    assert first["blocking"][1] == pytest.approx(c + C) and first["overlapped"][1] == pytest.approx(C)
    assert first["saved_model"] == pytest.approx(min(c, C)) and first["consistent"] and first["overruns"] == 1
    assert last["comm_s"] == 0 and last["saved_model"] == 0  # the last step sends nothing
    study[1][1.0, True]["steps"] = blocking  # "overlapped" that hid nothing: the model's saving is not inside
    assert not summarise_steps(study, 1.0)[0]["consistent"]
    assert step_model(c, C, True) == C and step_model(c, C, False) == pytest.approx(c + C)


def test_bad_options_are_refused_with_their_names():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="block_size must be None .* got 0"):
        ring_attention(q, q, q, block_size=0)
    with pytest.raises(TypeError, match="overlap must be True or False, got 'yes'"):
        ring_attention(q, q, q, overlap="yes")
    with pytest.raises(TypeError, match="link must be None or an llmedu.parallel.link.Link, got tuple"):
        ring_attention(q, q, q, link=SLOW)
    with pytest.raises(ValueError, match="repeats must be >= 3"):
        overlap_study(64, 1, 8, 1e-3, [1.0], 2)
