"""The ring forward with one fused CPU kernel per tile (``fused_ring.py``), which lesson 20 times, equals SDPA;
the overlap study's verdicts and the link's delays read what they say.

A verdict that cannot fail is no verdict: each is fed a case where it must say no.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmedu.parallel import launch
from llmedu.parallel.fused_ring import fused_ring_forward, fused_tile
from llmedu.parallel.long_sequence_study import _StampedLink, fused_ring_check, link_delays, summarise_steps
from llmedu.parallel.sequence_layout import split_sequence


def _worker() -> dict:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    errors = {}
    for causal in (True, False):
        for layout in ("contiguous", "zigzag"):
            for overlap in (True, False):
                g = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(1, 2, 48, 8, generator=g) for _ in range(3))  # (B, H, T, D)
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                mine = [split_sequence(t, rank, world, layout) for t in (q, k, v)]
                link = _StampedLink(1e-4, 1e9)
                out = fused_ring_forward(*mine, causal=causal, layout=layout, overlap=overlap, link=link)
                errors[causal, layout, overlap] = (out - split_sequence(ref, rank, world, layout)).abs().max().item()
    delays = link_delays(link.records)
    return dict(errors=errors, check=fused_ring_check(48), delays=delays, records=len(link.records))


@pytest.mark.parametrize("world", [2, 3])
def test_fused_ring_equals_sdpa_and_its_link_stamps_every_handle(world):
    for result in launch(_worker, world, echo=False):
        assert max(result["errors"].values()) < 1e-5, result["errors"]
        assert result["check"]["out vs SDPA"] < 1e-5
        delays = result["delays"]
        assert result["records"] == 2 * (world - 1)  # a receive and a send per sending step
        assert len(delays["late"]) == len(delays["delivery"]) == world - 1  # every receive, stamped when waited on
        assert min(delays["delivery"]) >= 0
        assert min(delays["late"]) >= -1e-3  # a wait returns at the modelled end, not before


def test_fused_tile_returns_the_logsumexp():
    q, k, v = torch.randn(3, 1, 2, 16, 8).unbind(0)
    out, lse = fused_tile(q, k, v, causal=True)
    s = (q @ k.transpose(-2, -1)) / 8**0.5
    s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse, s.logsumexp(-1), atol=1e-5)
    assert torch.allclose(out, s.softmax(-1) @ v, atol=1e-5)


def test_fused_ring_refuses_what_it_cannot_run():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="layout must be one of"):
        fused_ring_forward(q, q, q, layout="striped")
    with pytest.raises(ValueError, match=r"one 4-D shape, got \(1, 8, 4\)"):
        fused_ring_forward(q[0], q[0], q[0])


def _study(blocking: float, overlapped: float, compute: float = 0.010, comm: float = 0.020) -> list[dict]:
    """Two ranks' results at ratio 1.0: every repeat's first step takes the given seconds, the second ``compute``."""
    runs = {
        False: [[(compute, blocking), (compute, compute)]] * 4,
        True: [[(compute, overlapped), (compute, compute)]] * 4,
    }
    extra = dict(comm_s=comm, overruns=0, delivery=[0.002, 0.004], late=[0.001])
    return [{(1.0, o): dict(steps=runs[o], **extra) for o in (False, True)} for _ in range(2)]


def test_verdicts_say_no_when_the_measurement_says_no():
    good = summarise_steps(_study(0.030, 0.020), 1.0)[0]
    assert good["resolved"] and good["overlapped_inside"] and good["consistent"]
    assert good["delivery"] == pytest.approx(0.003) and good["late"] == pytest.approx(0.001)
    none_saved = summarise_steps(_study(0.030, 0.030), 1.0)[0]  # overlap hid nothing
    assert not none_saved["resolved"] and not none_saved["overlapped_inside"] and not none_saved["consistent"]
    slow = summarise_steps(_study(0.045, 0.025), 1.0)[0]  # saving resolved, overlapped step above max(c, C)
    assert slow["resolved"] and not slow["overlapped_inside"]
