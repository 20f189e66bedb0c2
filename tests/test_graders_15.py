"""The exercises of lesson 15 (ZeRO): each grader passes a right answer, and fails a plausible wrong value
and a right value computed the wrong way."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmedu.checks.zero import (
    _CHOICE_CASES,
    Job,
    _unit_bytes,
    check_gradient_shards,
    check_stage_choice,
    check_unit_bytes,
)
from llmedu.parallel import launch


# -- exercise 1: predict the bytes our ZeRO keeps ---------------------------------------------------
def unit_bytes(sizes, world, stage, compute_bytes):
    s = sum(-(-n // world) for n in sizes)  # the shards: each unit padded to N·S
    if stage == 3:
        return {"parameters": 4 * s, "gradients": 4 * s, "optimizer": 8 * s}
    full = compute_bytes * world * s
    master = 0 if compute_bytes == 4 else 4 * s  # in fp32 the master shard is a slice of the full copy
    return {"parameters": full + master, "gradients": full if stage == 1 else 4 * s, "optimizer": 8 * s}


def test_unit_bytes_passes_the_prediction():
    assert check_unit_bytes(unit_bytes)


def test_unit_bytes_fails_the_papers_formula_and_padding_the_total_once():
    def formula(sizes, world, stage, c):  # exact Ψ/N, no padding, no fp32 master beside an fp32 copy
        n = sum(sizes)
        return {
            "parameters": c * n / (world if stage >= 3 else 1),
            "gradients": c * n / (world if stage >= 2 else 1),
            "optimizer": 8 * n / world,
        }

    assert not check_unit_bytes(formula)
    # the padding of one buffer for the whole model, not of each unit
    assert not check_unit_bytes(lambda sizes, w, stage, c: unit_bytes([sum(sizes)], w, stage, c))
    # a separate fp32 master shard even when the full copy is fp32
    assert not check_unit_bytes(
        lambda sizes, w, stage, c: {
            **unit_bytes(sizes, w, stage, c),
            "parameters": unit_bytes(sizes, w, stage, 2)["parameters"] * c // 2 + 4 * sum(-(-n // w) for n in sizes)
            if stage < 3
            else 4 * sum(-(-n // w) for n in sizes),
        }
    )


def test_unit_bytes_fails_building_the_buffers():
    """The right numbers, measured from real buffers instead of predicted: the grader sees the tensor ops."""

    def built(sizes, world, stage, c):
        dtype = torch.float32 if c == 4 else torch.bfloat16
        s = sum(-(-n // world) for n in sizes)
        shard = torch.zeros(s)
        if stage == 3:
            return {"parameters": shard.nbytes, "gradients": shard.nbytes, "optimizer": 2 * shard.nbytes}
        full = torch.zeros(world * s, dtype=dtype)
        params = full.nbytes + (0 if c == 4 else shard.nbytes)
        return {
            "parameters": params,
            "gradients": full.nbytes if stage == 1 else shard.nbytes,
            "optimizer": 2 * shard.nbytes,
        }

    assert not check_unit_bytes(built)


# -- exercise 2: the bug in a gradient sharding -------------------------------------------------------
def gradient_shards(grads, ranks):
    size = -(-len(grads[0]) // ranks.world)  # ceil, and pad with zeros: the tail is not dropped
    flats = [F.pad(g, (0, size * ranks.world - len(g))) for g in grads]
    return [s / ranks.world for s in ranks.reduce_scatter(flats)]  # the average, not the sum


def test_gradient_shards_passes_the_fix():
    assert check_gradient_shards(gradient_shards)


def test_gradient_shards_fails_half_fixes():
    def only_average(grads, ranks):  # still cuts the tail off
        size = len(grads[0]) // ranks.world
        return [s / ranks.world for s in ranks.reduce_scatter([g[: size * ranks.world] for g in grads])]

    def only_padding(grads, ranks):  # still the sum
        size = -(-len(grads[0]) // ranks.world)
        return ranks.reduce_scatter([F.pad(g, (0, size * ranks.world - len(g))) for g in grads])

    assert not check_gradient_shards(only_average)
    assert not check_gradient_shards(only_padding)


def test_gradient_shards_fails_right_values_by_all_reduce_or_by_reading_every_rank():
    def by_all_reduce(grads, ranks):  # right values, twice the bytes, and the full sum on every rank
        size = -(-len(grads[0]) // ranks.world)
        total = ranks.all_reduce([F.pad(g, (0, size * ranks.world - len(g))) for g in grads])
        return [total[r][r * size : (r + 1) * size] / ranks.world for r in range(ranks.world)]

    def by_reading(grads, ranks):  # right values, no communication: one rank cannot read the others' gradients
        size = -(-len(grads[0]) // ranks.world)
        mean = F.pad(torch.stack(grads).mean(0), (0, size * ranks.world - len(grads[0])))
        return list(mean.split(size))

    assert not check_gradient_shards(by_all_reduce)
    assert not check_gradient_shards(by_reading)


# -- exercise 3: choose a stage and the micro-batches --------------------------------------------------
def states(n, w, s):
    return 2 * n / (w if s >= 3 else 1) + 2 * n / (w if s >= 2 else 1) + 12 * n / (w if s >= 1 else 1)


def chooser(transients=True, per_micro_batch=True, ring=True, time_per_micro_batch=True, first_that_fits=False):
    """The right reasoning with all True; each False leaves one term out, ``first_that_fits`` takes the lowest stage."""

    def choose(job: Job):
        best = None
        for s in range(4):
            for g in (g for g in range(1, job.batch + 1) if job.batch % g == 0):
                extra = {0: 0, 1: 0, 2: 2 * job.largest_unit, 3: 4 * job.largest_unit}[s] if transients else 0
                if states(job.n_params, job.gpus, s) + extra + job.seq_bytes * job.batch / g > job.card_bytes:
                    continue  # more micro-batches take less activation memory and more time: the first that fits
                collectives = {0: 2, 1: 2, 2: g + 1, 3: 3 * g}[s] if per_micro_batch else {0: 2, 1: 2, 2: 2, 3: 3}[s]
                sent = collectives * job.n_params * ((job.gpus - 1) / job.gpus if ring else 1) * 2
                t = (g * job.micro_seconds if time_per_micro_batch else 0) + sent / job.bandwidth
                if first_that_fits:
                    return (s, g)
                if best is None or t < best[0]:
                    best = (t, s, g)
                break
        return None if best is None else best[1:]

    return choose


def test_stage_choice_passes_the_right_choice():
    assert check_stage_choice(chooser())


def test_stage_choice_fails_reasoning_that_leaves_a_term_out():
    assert not check_stage_choice(chooser(first_that_fits=True))  # "the lowest stage that fits", its fewest G
    assert not check_stage_choice(chooser(time_per_micro_batch=False))  # the fewest bytes: stage 1 whenever it fits
    assert not check_stage_choice(chooser(per_micro_batch=False))  # stage 2 as 2Ψ, stage 3 as 3Ψ, whatever G
    assert not check_stage_choice(chooser(transients=False))  # no gradient bucket, no gathered layer
    assert not check_stage_choice(chooser(ring=False))  # Ψ instead of Ψ(N-1)/N per collective
    assert not check_stage_choice(lambda job: (3, job.batch))  # "ZeRO-3 and the smallest micro-batches"


def test_stage_choice_fails_the_right_stage_with_the_wrong_micro_batches():
    """The right stage, with G from another stage's reasoning (the most micro-batches): the step is slower."""
    right = chooser()
    assert not check_stage_choice(lambda job: None if right(job) is None else (right(job)[0], job.batch))


def test_stage_choice_fails_a_table_of_the_fixed_answers():
    """The right answers to the fixed jobs, looked up: the random jobs of each call fail it."""
    table = {case: chooser()(case) for case in _CHOICE_CASES}
    assert not check_stage_choice(lambda job: table.get(job, (1, 1)))


def test_each_wrong_reasoning_fails_a_fixed_job():
    """The fixed jobs alone (not the random ones) catch every reasoning above, and cover stages 1, 2, 3 and None."""
    import llmedu.checks.zero as grader

    answers = [chooser()(job) for job in _CHOICE_CASES]
    assert {a and a[0] for a in answers} == {1, 2, 3, None}
    wrong = [chooser(first_that_fits=True), chooser(time_per_micro_batch=False), chooser(per_micro_batch=False),
             chooser(transients=False), chooser(ring=False)]  # fmt: skip
    for fn in wrong:
        assert any(
            fn(job) != right and (fn(job) is None or right is None or not grader._fits(job, *fn(job))
                                  or grader._step_seconds(job, *fn(job)) > grader._best_time(job) * (1 + 1e-9))
            for job, right in zip(_CHOICE_CASES, answers)
        )  # fmt: skip


# -- the reference of exercise 1 is what the real wrapper keeps -----------------------------------------
def _real_bytes_worker():
    from llmedu.parallel.zero import ZeRO
    from llmedu.parallel.zero_study import Tiny

    def nbytes(tensors):  # each storage once: in fp32 the master shard is a slice of the full copy
        seen = {}
        for t in tensors:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    out = []
    for stage in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            zero = ZeRO(Tiny(width=6, depth=3), stage, compute_dtype=dtype, lr=1e-3)
            x = torch.randn(4, 5, dtype=dtype)
            for _ in range(2):  # the second backward: AdamW's moments exist, the gradients too
                zero(x).float().pow(2).mean().backward()
                if _ == 0:
                    zero.step(), zero.zero_grad()
            grads = [u.flat.grad for u in zero.units] if stage == 1 else [u.shard.grad for u in zero.units]
            moments = [v for s in zero.optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg")]
            held = {
                "parameters": nbytes([u.shard for u in zero.units] + [u.flat for u in zero.units if stage < 3]),
                "gradients": nbytes(grads),
                "optimizer": nbytes(moments),
            }
            sizes = [u.numel for u in zero.units]
            out.append((stage, dtype.itemsize, held, _unit_bytes(sizes, dist.get_world_size(), stage, dtype.itemsize)))
    return out


def test_the_unit_bytes_reference_counts_what_our_zero_holds():
    for world in (2, 3):
        for stage, compute_bytes, held, reference in launch(_real_bytes_worker, world, echo=False, timeout=120)[0]:
            assert held == reference, (world, stage, compute_bytes, held, reference)
