"""Our global-norm clipping against ``torch.nn.utils``: the norm, the clipped gradients, the edge cases.

float32 throughout. The norm is computed as torch computes it (the norm of the per-tensor norms), so it
agrees to 1e-6 relative (measured: bit for bit on CPU); the clipped gradients likewise.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmedu.train.clipping import clip_grad_norm, clip_grads_with_norm, global_grad_norm

RTOL = 1e-6
SHAPES = [(7,), (3, 5), (2, 3, 4), (1,), (64, 33)]


def _params(scale: float = 1.0, with_none: bool = True, seed: int = 0) -> list[torch.nn.Parameter]:
    """Parameters of several shapes with random gradients; every other one without a gradient."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for i, shape in enumerate(SHAPES + SHAPES[:2]):
        p = torch.nn.Parameter(torch.randn(shape, generator=g))
        if not (with_none and i % 3 == 2):
            p.grad = torch.randn(shape, generator=g) * scale
        params.append(p)
    return params


def _copy(params):
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 3.0])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_global_norm_matches_torch(norm_type, scale):
    params = _params(scale)
    ours = global_grad_norm(params, norm_type)
    theirs = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=0.0)
    flat = torch.cat([p.grad.flatten() for p in params if p.grad is not None]).double()  # the one-vector view
    # float32 against float64 here, not ours against torch: sums of ~3,000 float32 terms, 1e-5
    assert ours.item() == pytest.approx(torch.linalg.vector_norm(flat, norm_type).item(), rel=1e-5)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.1, 1.0, 5.0, 1e6])  # clipping hard, mildly, and not at all
def test_clip_grad_norm_matches_torch(norm_type, max_norm):
    ours, theirs = _params(), _params()
    norm = clip_grad_norm(ours, max_norm, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=0.0)  # the norm *before* clipping
    for p, q in zip(ours, theirs):
        assert (p.grad is None) == (q.grad is None)  # a missing gradient stays missing
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=0.0)
    after = global_grad_norm(ours, norm_type).item()
    assert after == pytest.approx(min(norm.item(), max_norm), rel=1e-5)  # clipped to max_norm, or untouched


def test_clipping_keeps_the_direction_and_is_not_per_parameter():
    params = _params(with_none=False)
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, 1.0).item()
    factor = 1.0 / (norm + 1e-6)
    for p, g in zip(params, before):  # one factor for every tensor
        torch.testing.assert_close(p.grad, g * factor, rtol=RTOL, atol=0.0)


def test_clip_grads_with_a_given_norm_is_torchs_second_half():
    ours, theirs = _params(), _params()
    total = global_grad_norm(ours)
    clip_grads_with_norm(ours, 0.5, total)
    torch.nn.utils.clip_grads_with_norm_(theirs, 0.5, total)
    for p, q in zip(ours, theirs):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=0.0)
    clip_grads_with_norm(ours, 0.5, float(total))  # a Python number works too


def test_a_generator_a_single_tensor_no_gradients_and_zero_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(clip_grad_norm(model.parameters(), 1e9), expected, rtol=RTOL, atol=0.0)  # a generator
    w = torch.nn.Parameter(torch.ones(3, 4))
    w.grad = torch.full((3, 4), 2.0)
    assert clip_grad_norm(w, 1.0).item() == pytest.approx(math.sqrt(12 * 4))  # one tensor, not its rows
    assert w.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    empty = global_grad_norm([])
    assert empty.item() == 0.0 and torch.nn.utils.get_total_norm([]).item() == 0.0
    assert clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0  # no .grad at all: nothing to do
    zero = torch.nn.Parameter(torch.ones(2))
    zero.grad = torch.zeros(2)
    assert clip_grad_norm([zero], 1.0).item() == 0.0 and torch.equal(zero.grad, torch.zeros(2))  # the 1e-6: no 0/0


def test_non_finite_gradients_give_the_same_norm_as_torch():
    params = _params(with_none=False)
    params[1].grad[0, 0] = math.inf
    assert global_grad_norm(params).isinf() and torch.nn.utils.get_total_norm([p.grad for p in params]).isinf()
    params[1].grad[0, 0] = math.nan
    assert global_grad_norm(params).isnan() and torch.nn.utils.get_total_norm([p.grad for p in params]).isnan()


def test_bad_arguments_are_clear_errors():
    params = _params()
    before = [None if p.grad is None else p.grad.clone() for p in params]
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="max_norm must be positive"):
            clip_grad_norm(params, bad)
        with pytest.raises(ValueError, match="max_norm must be positive"):
            clip_grads_with_norm(params, bad, torch.tensor(1.0))
    for p, g in zip(params, before):  # nothing was touched
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)
    for bad in (0.0, 0.5, -math.inf, math.nan):
        with pytest.raises(ValueError, match="norm_type must be >= 1"):
            global_grad_norm(params, bad)
