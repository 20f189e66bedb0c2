"""The exercises of lesson 14 (ZeRO): each grader passes a right answer, and fails a plausible wrong value
and a right value computed the wrong way."""

import torch
import torch.nn.functional as F

from llmedu.checks.zero import (
    _CHOICE_CASES,
    check_gradient_shards,
    check_stage_choice,
    check_unit_bytes,
)


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


# -- exercise 3: choose a stage -------------------------------------------------------------------------
def states(n, w, s):
    return 2 * n / (w if s >= 3 else 1) + 2 * n / (w if s >= 2 else 1) + 12 * n / (w if s >= 1 else 1)


def choice(n, unit, gpus, card, act):
    extra = {0: 0, 1: 0, 2: 2 * unit, 3: 4 * unit}
    return next((s for s in range(4) if states(n, gpus, s) + act + extra[s] <= card), None)


def test_stage_choice_passes_the_right_choice():
    assert check_stage_choice(choice)


def test_stage_choice_fails_reasoning_that_leaves_a_term_out():
    no_transients = lambda n, unit, gpus, card, act: next(  # noqa: E731
        (s for s in range(4) if states(n, gpus, s) + act <= card), None
    )
    states_only = lambda n, unit, gpus, card, act: next(  # noqa: E731  (the old lesson's exercise)
        (s for s in range(4) if states(n, gpus, s) <= card), None
    )
    assert not check_stage_choice(no_transients)
    assert not check_stage_choice(states_only)
    assert not check_stage_choice(lambda *args: 3)  # "ZeRO-3 always"


def test_stage_choice_fails_a_table_of_the_fixed_answers():
    """The right answers to the fixed scenarios, looked up: the random clusters of each call fail it."""
    table = {case: choice(*case) for case in _CHOICE_CASES}
    assert not check_stage_choice(lambda *case: table.get(case, 0))


def test_the_fixed_scenarios_each_need_one_term():
    assert [choice(*case) for case in _CHOICE_CASES] == [0, 1, 2, 3, None]
