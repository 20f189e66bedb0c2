"""Our softmax, log-softmax, log-sum-exp and cross-entropy against torch's, forward and backward.

Tolerances. float32: 1e-6 relative (plus 1e-6 absolute for entries near 0): both sides round the same
sums in a different order, ~1e-7 relative. bfloat16: both sides are compared with a float64 reference
computed from the same bf16 inputs, and our error may be at most twice torch's own (plus 1e-6 for the
cases where torch's is exactly 0): we accumulate in float32 and round once, as torch does.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmedu.nn.functional import cross_entropy, log_softmax, logsumexp, softmax

RTOL, ATOL = 1e-6, 1e-6
INF = math.inf


def _logits(n=32, v=200, scale=4.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)


def _targets(n=32, v=200, ignored=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.randperm(n, generator=g)[:ignored]] = -100
    return t


@pytest.mark.parametrize("shape, dim", [((32, 200), -1), ((4, 7, 50), 1), ((3, 5), 0), ((10,), 0)])
def test_softmax_log_softmax_logsumexp_match_torch_fp32(shape, dim):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 5
    torch.testing.assert_close(softmax(x, dim), F.softmax(x, dim), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(log_softmax(x, dim), F.log_softmax(x, dim), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(logsumexp(x, dim), torch.logsumexp(x, dim), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(
        logsumexp(x, dim, keepdim=True), torch.logsumexp(x, dim, keepdim=True), rtol=RTOL, atol=ATOL
    )


def _grad(fn, x, *args, weight=None):
    x = x.clone().requires_grad_(True)
    out = fn(x, *args)
    (out * weight).sum().backward() if weight is not None else out.sum().backward()
    return out.detach(), x.grad


def test_log_softmax_and_softmax_gradients_match_torch():
    x = _logits()
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))  # a generic upstream gradient
    # log_softmax's input gradient is w - softmax * sum(w): a difference of terms as large as |sum(w)| (~15
    # here), so float32 rounding is 1e-6 *of that*, not of the (possibly small) result
    atol = ATOL * w.sum(-1).abs().max().item()
    for ours, theirs in ((log_softmax, F.log_softmax), (softmax, F.softmax)):
        out, grad = _grad(ours, x, -1, weight=w)
        ref_out, ref_grad = _grad(theirs, x, -1, weight=w)
        torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=atol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_cross_entropy_matches_torch_forward_and_backward(reduction, ignore_index):
    x, t = _logits(), _targets(ignored=0)
    t[::6] = ignore_index  # some rows ignored under either convention
    loss, grad = _grad(cross_entropy, x, t, ignore_index, reduction)
    ref_loss, ref_grad = _grad(F.cross_entropy, x, t, None, None, ignore_index, None, reduction)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)


def test_an_all_ignored_batch_is_nan_for_mean_and_zero_otherwise_like_torch():
    x, t = _logits(n=4), torch.full((4,), -100)
    for reduction in ("mean", "sum", "none"):
        ours, theirs = cross_entropy(x, t, reduction=reduction), F.cross_entropy(x, t, reduction=reduction)
        torch.testing.assert_close(ours, theirs, equal_nan=True)
    assert math.isnan(cross_entropy(x, t).item())


def _bf16_errors(ours, theirs, x, *args):
    """Max |error| vs float64 of the outputs and of the input gradients: ours, then torch's."""
    w = torch.randn(ours(x, *args).shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ref, ref_grad = _grad(theirs, x.double(), *args, weight=w)
    errors = []
    for fn in (ours, theirs):
        out, grad = _grad(fn, x, *args, weight=w.to(x.dtype))
        errors.append(((out.double() - ref).abs().max().item(), (grad.double() - ref_grad).abs().max().item()))
    return errors


@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_bf16_errors_are_at_most_twice_torchs(scale):
    x, t = _logits(n=64, v=1000, scale=scale, dtype=torch.bfloat16), _targets(n=64, v=1000)
    cases = [
        (log_softmax, F.log_softmax, (-1,)),
        (softmax, F.softmax, (-1,)),
        (logsumexp, torch.logsumexp, (-1,)),
        (cross_entropy, F.cross_entropy, (t,)),
    ]
    for ours, theirs, args in cases:
        (out, grad), (ref_out, ref_grad) = _bf16_errors(ours, theirs, x, *args)
        assert out <= 2 * ref_out + 1e-6, (ours.__name__, "forward", out, ref_out)
        assert grad <= 2 * ref_grad + 1e-6, (ours.__name__, "backward", grad, ref_grad)
        out_dtype = ours(x, *args).dtype
        assert out_dtype == theirs(x, *args).dtype == torch.bfloat16


def test_exp_overflows_where_the_docstring_says():
    for dtype, fine, overflows in (
        (torch.float32, 88.0, 89.0),
        (torch.bfloat16, 88.0, 89.0),
        (torch.float16, 11.0, 12.0),
    ):
        assert torch.exp(torch.tensor(fine, dtype=dtype)).isfinite()
        assert torch.exp(torch.tensor(overflows, dtype=dtype)).isinf()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_extreme_logits_stay_finite_where_torchs_do(dtype):
    big = 1e4 if dtype != torch.float16 else 6e4  # fp16's largest is 65504
    x = torch.tensor(
        [[big, 0.0, -big, 1.0], [-big, -big, -big + 1, -big], [-INF, 2.0, 1.0, -INF], [big, big, -INF, 0.0]],
        dtype=dtype,
    )
    naive = (x.exp() / x.exp().sum(-1, keepdim=True)).float()
    assert not naive.isfinite().all()  # the textbook formula breaks on these rows
    t = torch.tensor([0, 2, 1, 1])
    for ours, theirs, args in (
        (log_softmax, F.log_softmax, (-1,)),
        (softmax, F.softmax, (-1,)),
        (logsumexp, torch.logsumexp, (-1,)),
        (cross_entropy, F.cross_entropy, (t,)),
    ):
        name = ours.__name__
        out, grad = _grad(ours, x.float(), *args)
        ref_out, ref_grad = _grad(theirs, x.float(), *args)
        exact_out, exact_grad = _grad(theirs, x.double(), *args)
        assert torch.equal(out.isfinite(), ref_out.isfinite()), name  # -inf at -inf entries, like torch
        assert grad.isfinite().all() and ref_grad.isfinite().all(), name  # 0 at the -inf entries
        # against float64, 1e-6 relative. (Not against torch's float32: torch.logsumexp's gradient is
        # exp(x - result) with the result rounded at 1e4, 2e-4 off; ours is exp(x - m) / sum.)
        finite = exact_out.isfinite()
        torch.testing.assert_close(out.double()[finite], exact_out[finite], rtol=RTOL, atol=ATOL, msg=name)
        torch.testing.assert_close(grad.double(), exact_grad, rtol=RTOL, atol=ATOL, msg=name)
        low = ours(x, *args)  # and in the input's own dtype
        assert torch.equal(low.isfinite(), theirs(x, *args).isfinite()), (name, dtype)


def test_rows_without_a_finite_logit_are_nan_like_torch_and_an_ignored_one_harms_nothing():
    x = torch.tensor([[-INF, -INF, -INF], [1.0, 2.0, 3.0]])
    torch.testing.assert_close(log_softmax(x), F.log_softmax(x, -1), equal_nan=True)
    torch.testing.assert_close(softmax(x), F.softmax(x, -1), equal_nan=True)
    torch.testing.assert_close(logsumexp(x), torch.logsumexp(x, -1))  # -inf, not nan
    t = torch.tensor([-100, 2])
    loss, grad = _grad(cross_entropy, x, t)
    torch.testing.assert_close(loss, F.cross_entropy(x, t))
    assert torch.equal(grad[0], torch.zeros(3))  # torch's gradient is nan there; an ignored row gets none
    assert cross_entropy(x, torch.tensor([0, 2]), reduction="none")[0].isnan()


def test_bad_shapes_dtypes_and_targets_are_clear_errors():
    x, t = _logits(n=4, v=10), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"logits must be \(N, V\), got shape \(2, 2, 10\)"):
        cross_entropy(x.view(2, 2, 10), t)
    with pytest.raises(ValueError, match=r"targets must be \(N,\) = \(4,\).*got \(3,\)"):
        cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match=r"targets must be \(N,\)"):
        cross_entropy(x, t[:, None])
    with pytest.raises(TypeError, match="targets must be integer class ids, got dtype torch.float32"):
        cross_entropy(x, t.float())
    with pytest.raises(TypeError, match="integer class ids, got dtype torch.bool"):
        cross_entropy(x, t > 2)
    with pytest.raises(TypeError, match="logits must be floating point, got dtype torch.int64"):
        cross_entropy(t.view(4, 1).repeat(1, 10), t)
    with pytest.raises(TypeError, match="floating-point logits"):
        log_softmax(torch.arange(5))
    with pytest.raises(ValueError, match=r"target 10 at row 2 is outside the classes \[0, 10\)"):
        cross_entropy(x, torch.tensor([1, 2, 10, 4]))
    with pytest.raises(ValueError, match=r"target -1 at row 0 is outside .* not ignore_index=-100"):
        cross_entropy(x, torch.tensor([-1, 2, 3, 4]))
    with pytest.raises(ValueError, match="reduction must be"):
        cross_entropy(x, t, reduction="avg")
    assert cross_entropy(x, torch.tensor([1, 2, -1, 4]), ignore_index=-1).isfinite()  # -1 is the ignored id here
    assert cross_entropy(x, t.int()).isfinite()  # any integer dtype (torch wants int64 or uint8)
