"""Our DDP and naive DP against the single-process oracle and torch's DistributedDataParallel.

Every rank also trains a single-process copy on the full batch, in the same process, so the
comparison is made after every step without shipping parameters around. Tolerance: the ranks'
gradients are averaged in a different order from the full-batch gradient (float32 sums of N
shard means instead of one mean), a relative rounding of ~1e-7 per step; over a few SGD steps
with lr 0.1 on weights of size ~0.3 that stays below 1e-6, while a missing 1/N or a skipped
bucket changes parameters by ~1e-2.
"""

import pytest
import torch
import torch.distributed as dist
from raised import raised
from torch import nn

from llmedu.parallel import launch
from llmedu.parallel.data_parallel import DDP, NaiveDataParallel, assign_buckets

BATCH, STEPS, ATOL = 24, 4, 1e-6


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _compare_with_oracles() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    # each rank initialises differently on purpose: the wrappers must broadcast rank 0's weights,
    # which are the single-process model's (seed 0)
    single = _mlp(0)
    start = [p.detach().clone() for p in single.parameters()]
    ours = DDP(_mlp(rank), bucket_mb=1500 / 2**20)  # ~1.5 KB buckets: several per backward
    naive = NaiveDataParallel(_mlp(rank))
    theirs = nn.parallel.DistributedDataParallel(_mlp(rank))
    accum = DDP(_mlp(rank), bucket_mb=1500 / 2**20)  # two micro-batches, the first under no_sync
    optims = {
        name: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for name, m in dict(single=single, ours=ours, naive=naive, theirs=theirs, accum=accum).items()
    }
    loss_fn = nn.MSELoss()
    diffs = {"ours-single": [], "ours-theirs": [], "naive-single": [], "accum-single": []}
    for x, y in _batches():
        xs, ys = x.chunk(n)[rank], y.chunk(n)[rank]  # (BATCH / N, 8): this rank's shard
        for name, model in dict(single=single, ours=ours, naive=naive, theirs=theirs).items():
            optims[name].zero_grad()
            inputs, targets = (x, y) if name == "single" else (xs, ys)
            loss_fn(model(inputs), targets).backward()
            if name == "ours":
                model.finish_gradient_sync()
            if name == "naive":
                model.step(optims[name])
            else:
                optims[name].step()
        optims["accum"].zero_grad()
        halves = list(zip(xs.chunk(2), ys.chunk(2)))
        with accum.no_sync():
            (loss_fn(accum(halves[0][0]), halves[0][1]) / 2).backward()
        (loss_fn(accum(halves[1][0]), halves[1][1]) / 2).backward()
        accum.finish_gradient_sync()
        optims["accum"].step()
        diffs["ours-single"].append(_max_diff(ours, single))
        diffs["ours-theirs"].append(_max_diff(ours, theirs))
        diffs["naive-single"].append(_max_diff(naive, single))
        diffs["accum-single"].append(_max_diff(accum, single))
    diffs["moved"] = max((p - q).abs().max().item() for p, q in zip(single.parameters(), start))
    diffs["buckets"] = len(ours.buckets)
    diffs["events"] = ours.log.events
    diffs["accum_comm"] = sum(e["lane"] == "comm" for e in accum.log.events)
    return diffs


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_and_naive_dp_equal_one_process_and_torch_ddp_after_every_step(world_size):
    results = launch(_compare_with_oracles, world_size, echo=False)
    for rank, res in enumerate(results):
        assert res["moved"] > 1e-2  # the steps did something, so equality means something
        assert res["buckets"] >= 3
        for key in ("ours-single", "ours-theirs", "naive-single", "accum-single"):
            assert len(res[key]) == STEPS and max(res[key]) < ATOL, (rank, key, res[key])
        comm = [e for e in res["events"] if e["lane"] == "comm"]
        assert len(comm) == res["buckets"] * STEPS  # one all-reduce per bucket per step
        assert res["accum_comm"] == res["buckets"] * STEPS  # nothing sent under no_sync
        assert all(e["rank"] == rank and e["end"] >= e["start"] for e in res["events"])


def _unused_parameter() -> str:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ddp = DDP(model, bucket_mb=1.0)
    ddp.module[0](torch.ones(2, 3)).sum().backward()  # the second layer is never used
    try:
        ddp.finish_gradient_sync()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_ddp_names_parameters_that_got_no_gradient():
    for message in launch(_unused_parameter, 2, echo=False):
        assert "no gradient for 1.weight, 1.bias;" in message


def test_buckets_fill_last_parameter_first():
    assert assign_buckets([4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert assign_buckets([4, 100, 4], 8) == [[2], [1], [0]]  # a big one gets a bucket of its own
    assert assign_buckets([1, 2, 3], 1000) == [[2, 1, 0]]
    with pytest.raises(ValueError, match="positive"):
        assign_buckets([1], 0)


def _mismatched_models() -> list[str]:
    rank = dist.get_rank()
    models = [
        nn.Linear(4, 2) if rank == 0 else nn.Linear(6, 2),  # another shape
        nn.Sequential(nn.Linear(2, 2), *([nn.Linear(2, 2)] if rank == 1 else [])),  # a layer more
        nn.Linear(2, 2) if rank == 0 else nn.Linear(2, 2).double(),  # another dtype
    ]
    return raised(*(lambda model=model: DDP(model) for model in models), kind=RuntimeError)


def test_ranks_with_different_models_raise_naming_the_first_difference():
    # every rank sees every signature, so all raise together and none waits in a broadcast
    for messages in launch(_mismatched_models, 2, echo=False):
        assert len(messages) == 3, messages
        shape, count, dtype = messages
        assert "the ranks hold different models" in shape
        assert (
            "tensor #0 is parameter 'weight' of shape (2, 4), float32 on rank 0 "
            "but parameter 'weight' of shape (2, 6), float32 on rank 1" in shape
        )
        assert "tensor #2 is missing on rank 0 but parameter '1.weight' of shape (2, 2), float32 on rank 1" in count
        assert "float32 on rank 0 but parameter 'weight' of shape (2, 2), float64 on rank 1" in dtype


def _bucket_views() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(_mlp(0), bucket_mb=1500 / 2**20)  # several buckets
    optim = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = _batches()[0]
    out = {"shared": [], "copies_in_place": []}
    for set_to_none in (True, False):  # autograd's fresh tensor copied in once / accumulated in place
        optim.zero_grad(set_to_none=set_to_none)
        nn.MSELoss()(ddp(x.chunk(n)[rank]), y.chunk(n)[rank]).backward()
        ddp.finish_gradient_sync()
        for flat, bucket in zip(ddp.flat, ddp.buckets):
            offset = 0
            for p in bucket:
                # the same memory: .grad starts at its offset in the bucket's buffer
                same = p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                at = p.grad.data_ptr() == flat.data_ptr() + offset * flat.element_size()
                out["shared"].append(same and at)
                offset += p.numel()
        out["flat_numel"] = sum(f.numel() for f in ddp.flat)
        # the averaged gradient, read through the buffer, is what the .grad views hold
        out["copies_in_place"].append(
            max(
                (flat - torch.cat([p.grad.reshape(-1) for p in b])).abs().max().item()
                for flat, b in zip(ddp.flat, ddp.buckets)
            )
        )
    single = _mlp(0)
    nn.MSELoss()(single(x), y).backward()
    out["vs_single"] = max(
        (p.grad - q.grad).abs().max().item() for p, q in zip(ddp.module.parameters(), single.parameters())
    )
    out["n_params"] = sum(p.numel() for p in single.parameters())
    return out


def test_gradients_are_views_into_the_buckets_and_averaged_in_place():
    for res in launch(_bucket_views, 2, echo=False):
        assert res["shared"] and all(res["shared"])  # every .grad lives in its bucket, at its offset
        assert res["flat_numel"] == res["n_params"]  # the buckets hold the gradients once, no second copy
        assert res["copies_in_place"] == [0.0, 0.0]
        assert res["vs_single"] < ATOL  # and they are the full-batch gradient (rounding, see the top)


def _mixed_dtypes() -> str:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    try:
        DDP(model)
    except ValueError as err:
        return str(err)
    return "no error"


def test_ddp_refuses_gradients_of_two_dtypes():
    for message in launch(_mixed_dtypes, 2, echo=False):
        assert "one gradient dtype" in message and "torch.float64" in message


def _timed_and_untimed() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    models = {
        "ddp": DDP(_mlp(0), bucket_mb=1500 / 2**20),
        "ddp untimed": DDP(_mlp(0), bucket_mb=1500 / 2**20, timed=False),
        "naive": NaiveDataParallel(_mlp(0)),
        "naive untimed": NaiveDataParallel(_mlp(0), timed=False),
    }
    optims = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}
    for x, y in _batches()[:2]:
        for name, model in models.items():
            optims[name].zero_grad()
            nn.MSELoss()(model(x.chunk(n)[rank]), y.chunk(n)[rank]).backward()
            if name.startswith("ddp"):
                model.finish_gradient_sync()
                optims[name].step()
            else:
                model.step(optims[name])
    return {
        "labels": {name: [e["label"] for e in m.log.events] for name, m in models.items()},
        "ddp timed = untimed": _max_diff(models["ddp"], models["ddp untimed"]),
        "naive timed = untimed": _max_diff(models["naive"], models["naive untimed"]),
        "buckets": len(models["ddp"].buckets),
    }


def test_timing_is_optional_and_changes_nothing_it_times():
    """The spans are recorded by hooks beside the algorithm: timed=False records none and trains the same."""
    for rank, res in enumerate(launch(_timed_and_untimed, 2, echo=False)):
        assert res["ddp timed = untimed"] == 0.0 and res["naive timed = untimed"] == 0.0
        assert res["labels"]["ddp untimed"] == [] and res["labels"]["naive untimed"] == []
        ddp, naive = res["labels"]["ddp"], res["labels"]["naive"]
        b = res["buckets"]
        step = ["forward"] + [f"{kind}: bucket {i}" for i in range(b) for kind in ("backward", "all-reduce")]
        assert sorted(ddp) == sorted(step * 2)  # (an all-reduce's span is logged when it completes)
        naive_step = ["forward", "backward", "gather gradients"]
        naive_step += ["optimizer step"] if rank == 0 else []
        assert naive == (naive_step + ["broadcast parameters"]) * 2


def test_the_algorithm_methods_do_no_timing():
    """What a student reads in lesson 11 (llmedu.show) is the algorithm alone: no log calls inside it."""
    import inspect

    for method in (
        NaiveDataParallel.step,
        NaiveDataParallel._gather_gradients,
        DDP._grad_ready,
        DDP._launch,
        DDP.finish_gradient_sync,
        DDP.forward,
    ):
        assert "log" not in inspect.getsource(method), method.__qualname__
