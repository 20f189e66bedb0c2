"""Our learning-rate schedules against torch.optim.lr_scheduler, step by step.

Tolerance 1e-12 relative: both sides compute the same closed forms in float64 (torch's recursive
schedulers accumulate a few ulps of rounding, nowhere near 1e-12 of the rate).
"""

import math

import pytest
import torch
from torch.optim import lr_scheduler as S

from llmedu.train import schedules

BASE = 0.1


def torch_rates(make, steps, base=BASE):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = make(opt)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def ours(schedule, steps, base=BASE):
    return [base * schedule(i) for i in range(steps)]


def test_cosine_matches_torch():
    total, floor = 50, 0.1
    expected = torch_rates(lambda o: S.CosineAnnealingLR(o, T_max=total, eta_min=BASE * floor), total + 1)
    assert ours(schedules.warmup_cosine(0, total, final=floor), total + 1) == pytest.approx(expected, rel=1e-12)


def test_warmup_then_cosine_matches_torch():
    warm, total = 10, 60
    expected = torch_rates(
        lambda o: S.SequentialLR(
            o, [S.LambdaLR(o, lambda i: i / warm), S.CosineAnnealingLR(o, T_max=total - warm)], milestones=[warm]
        ),
        total,
    )
    assert ours(schedules.warmup_cosine(warm, total), total) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_linear_matches_torch():
    warm, total = 5, 40
    expected = torch_rates(
        lambda o: S.SequentialLR(
            o, [S.LambdaLR(o, lambda i: i / warm), S.LinearLR(o, 1.0, 0.2, total_iters=total - warm)], milestones=[warm]
        ),
        total + 3,
    )
    assert ours(schedules.warmup_linear(warm, total, final=0.2), total + 3) == pytest.approx(
        expected, rel=1e-12, abs=1e-15
    )


def test_one_cycle_matches_torch():
    total = 100
    expected = torch_rates(
        lambda o: S.OneCycleLR(o, max_lr=BASE, total_steps=total, pct_start=0.25, cycle_momentum=False), total
    )
    assert ours(schedules.one_cycle(total, pct_start=0.25), total) == pytest.approx(expected, rel=1e-12)


def test_triangular_matches_torch():
    low = 0.01
    expected = torch_rates(
        lambda o: S.CyclicLR(o, base_lr=low * BASE, max_lr=BASE, step_size_up=7, cycle_momentum=False), 50
    )
    assert ours(schedules.triangular(7, low), 50) == pytest.approx(expected, rel=1e-12)


def test_shapes_and_bad_input():
    f = schedules.warmup_cosine(10, 100, final=0.1)
    assert f(0) == 0 and f(10) == 1 and math.isclose(f(100), 0.1) and math.isclose(f(1000), 0.1)
    assert schedules.constant()(12345) == 1
    with pytest.raises(ValueError, match="larger than warmup"):
        schedules.warmup_cosine(100, 100)
    with pytest.raises(ValueError, match="non-negative int"):
        schedules.warmup_linear(-1, 10)
    with pytest.raises(ValueError, match="step_size"):
        schedules.triangular(0, 0.1)
