"""The controlled link: its cost model, its timing (never faster than the model, async handles included),
and that DDP over it computes exactly what DDP over plain gloo does.

One two-rank launch covers the timing and the equality; the lower bounds come from the link's sleeps,
so they hold on a loaded machine (nothing here asserts that anything is fast).
"""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llmedu.parallel import launch
from llmedu.parallel.data_parallel import DDP
from llmedu.parallel.link import Link

ALPHA, BETA = 0.1, 1e6  # 100 ms per message, 1 MB/s: 4,000 bytes take 104 ms
SKEW = 0.3  # seconds by which rank 1 launches a collective after rank 0


def test_cost_model():
    link = Link(ALPHA, BETA)
    assert link.message_time(4000) == pytest.approx(0.104)
    assert link.op_time("send", 4000, 2) == pytest.approx(0.104)
    assert link.op_time("all_reduce", 4000, 4) == pytest.approx(6 * (0.1 + 1000 / 1e6))  # 2(N-1) of S/N
    assert link.op_time("all_gather_single", 4000, 4) == pytest.approx(3 * 0.104)  # N-1 of this rank's S
    assert link.op_time("reduce_scatter_single", 4000, 4) == pytest.approx(3 * 0.101)
    assert link.op_time("all_reduce", 4000, 1) == 0.0  # nothing to send


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="bandwidth beta must be > 0 .* got 0"):
        Link(1e-3, 0)
    with pytest.raises(ValueError, match="latency alpha must be >= 0 .* got -1"):
        Link(-1, 1e9)
    with pytest.raises(ValueError, match="no cost for 'broadcast'"):
        Link(0, 1e9).op_time("broadcast", 10, 2)


def _timed_ops() -> dict:
    rank, out = dist.get_rank(), {}
    link = Link(ALPHA, BETA)
    x = torch.full((1000,), float(rank + 1))  # 4,000 bytes
    dist.barrier()
    start = time.perf_counter()
    link.all_reduce(x)
    out["sync"] = (time.perf_counter() - start, x[0].item())
    a, b = torch.ones(1000), torch.ones(1000)
    dist.barrier()
    start = time.perf_counter()
    first, second = link.all_reduce(a, async_op=True), link.all_reduce(b, async_op=True)
    out["launch"] = time.perf_counter() - start
    second.get_future().wait()
    out["queued"] = time.perf_counter() - start  # the second waits for the first: one at a time
    first.wait()
    out["first_done"] = first.is_completed()
    buffer = torch.zeros(1000)
    dist.barrier()
    start = time.perf_counter()
    works = link.post([(torch.full((1000,), 7.0), 1 - rank)], [(buffer, 1 - rank)])
    for w in works:
        w.wait()
    out["p2p"] = (time.perf_counter() - start, buffer[0].item())
    out["records"] = [r["op"] for r in link.records]
    # a collective cannot start before its last rank launched it: rank 1 comes SKEW seconds late
    skewed = Link(ALPHA, BETA)
    dist.barrier()
    if rank == 1:
        time.sleep(SKEW)
    skewed.all_reduce(torch.ones(1000))
    out["skewed"] = {k: skewed.records[0][k] for k in ("launched", "ready", "start", "end")}
    # DDP over the link and over plain gloo: the same buckets, the same sums, the same bits
    grads = {}
    ddp_link = Link(1e-3, 1e8)
    for name, kwargs in (("gloo", {}), ("link", {"link": ddp_link})):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)), bucket_mb=200 / 2**20, **kwargs)
        g = torch.Generator().manual_seed(rank)
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        model.finish_gradient_sync()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        out["buckets"] = len(model.buckets)
    out["ddp_sent"] = [r["op"] for r in ddp_link.records]
    out["equal"] = all(torch.equal(a, b) for a, b in zip(grads["gloo"], grads["link"]))
    return out


@pytest.mark.alone  # times sends against the link model
def test_link_timing_and_ddp_equality():
    results = launch(_timed_ops, 2)
    per_op = 2 * (ALPHA + 2000 / BETA)  # all-reduce of 4,000 bytes on 2 ranks: 2 messages of 2,000 bytes
    for r in results:
        seconds, value = r["sync"]
        assert value == 3.0  # 1 + 2: gloo's real sum
        assert seconds >= per_op
        assert r["launch"] < per_op  # async: the call returns before the modelled time
        assert r["queued"] >= 2 * per_op
        assert r["first_done"]
        seconds, value = r["p2p"]
        assert value == 7.0 and seconds >= ALPHA + 4000 / BETA
        assert r["records"] == ["all_reduce", "all_reduce", "all_reduce", "recv", "send"]
        assert r["buckets"] > 1  # several all-reduces launched during backward
        assert r["ddp_sent"] == ["all_reduce"] * r["buckets"]  # ... and all of them over the link
        assert r["equal"]
    # perf_counter is one clock for every process on a host, so the ranks' times compare
    last_launch = max(r["skewed"]["launched"] for r in results)
    assert results[1]["skewed"]["launched"] - results[0]["skewed"]["launched"] >= SKEW
    for r in results:
        assert r["skewed"]["ready"] == last_launch  # both ranks see the late rank's launch
        assert r["skewed"]["start"] >= last_launch  # rank 0's all-reduce is not drawn before rank 1 joined
        assert r["skewed"]["end"] - r["skewed"]["start"] == pytest.approx(per_op)
