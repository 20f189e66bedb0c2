"""Graders for the small numerical pieces: a stable log-softmax, cross-entropy, global-norm clipping.

check_log_softmax(fn)       fn(x (..., V)) -> log softmax over the last dimension; must survive logits
                            around +-1000, where exp overflows (or underflows) in float32
check_cross_entropy(fn)     fn(logits (N, V), targets (N,)) -> the mean of -log softmax(logits)[target] over
                            the targets that are not -100 (PyTorch's ignore_index), differentiable
check_clip_grad_norm(fn)    fn(params, max_norm) -> the global gradient norm before clipping; scales every
                            .grad in place by min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_)

The references are ``llmedu.nn.functional`` and ``llmedu.train.clipping``. When an answer is wrong in a
way that is common (the max not subtracted, ignored targets counted in the mean, each tensor clipped
by its own norm), the message names that mistake.
"""

from __future__ import annotations

import torch

from ..nn.functional import cross_entropy, log_softmax
from ..train.clipping import clip_grad_norm
from .core import FAILED, CheckResult, Grader

__all__ = ["check_log_softmax", "check_cross_entropy", "check_clip_grad_norm"]

TOL = 1e-5  # float32 sums in another order agree to ~1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a.float(), b.float(), TOL, TOL)


def _overflow_hint(got, expected: torch.Tensor) -> str:
    """A sentence about inf/nan where the answer is finite: exp overflowed or underflowed."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return ""
    bad = ~got.detach().isfinite() & expected.isfinite()
    if not bad.any():
        return ""
    at = tuple(int(i) for i in bad.nonzero()[0])
    n = int(bad.sum())
    return (
        f"{n} {'entry is' if n == 1 else 'entries are'} inf or nan where the answer is finite (the first at index "
        f"{at}, got {got[at].item()}). In float32, exp(x) overflows to inf for x > 88.7 and underflows to 0 for "
        "x < -104: large logits give inf / inf = nan, very negative ones log(0) = -inf. Subtract each row's max m "
        "first: log sum_j exp(x_j) = m + log sum_j exp(x_j - m) (the log-sum-exp trick)"
    )


def check_log_softmax(fn) -> CheckResult:
    """``fn(x)`` must equal log softmax over the last dimension, also for logits far from 0."""
    g = Grader("check_log_softmax")
    cases = [
        ("x of shape (3, 5)", torch.randn(3, 5, generator=_gen(0))),
        ("x of shape (2, 4, 10)", torch.randn(2, 4, 10, generator=_gen(1)) * 3),
        ("logits around +1000, shape (4, 8)", 1000 + torch.randn(4, 8, generator=_gen(2)) * 5),
        ("logits around -1000, shape (4, 8)", -1000 + torch.randn(4, 8, generator=_gen(3)) * 5),
        ("a row holding -inf (a masked entry)", torch.tensor([[0.5, float("-inf"), 2.0, -1.0]])),
    ]
    for description, x in cases:
        expected = log_softmax(x)
        got = g.call(fn, x.clone())
        hint = _overflow_hint(got, expected)
        if not g.expect(description, not hint, hint):
            break
        g.compare(description, got, expected, rtol=TOL, atol=TOL)
    return g.result()


def _mean_over_all_hint(got, logits: torch.Tensor, targets: torch.Tensor) -> str:
    keep = targets != -100
    summed = cross_entropy(logits.detach(), targets, reduction="sum")
    if keep.all() or not isinstance(got, (torch.Tensor, float)) or not _close(torch.as_tensor(got), summed / len(keep)):
        return ""
    return (
        f"you divided by all {len(keep)} targets, but {int((~keep).sum())} of them are -100 (ignored): "
        f"the mean is over the {int(keep.sum())} that are not ignored"
    )


def check_cross_entropy(fn) -> CheckResult:
    """``fn(logits, targets)``: the mean cross-entropy over the targets that are not -100, and its gradient."""
    g = Grader("check_cross_entropy")
    cases = []
    for n, v, scale, n_ignored, seed in (
        (8, 10, 1.0, 0, 0),
        (8, 10, 2.0, 3, 1),
        (16, 50, 1.0, 5, 2),
        (6, 12, 300.0, 2, 3),
    ):
        logits = torch.randn(n, v, generator=_gen(seed)) * scale
        targets = torch.randint(0, v, (n,), generator=_gen(seed + 10))
        targets[torch.randperm(n, generator=_gen(seed + 20))[:n_ignored]] = -100
        what = f"logits ({n}, {v}) of scale {scale:g}, {n_ignored} of {n} targets ignored (-100)"
        cases.append((what, logits, targets))
    for description, logits, targets in cases:
        x = logits.clone().requires_grad_(True)
        got = g.call(fn, x, targets.clone())
        if got is FAILED and "out of bounds" in (g.failure or ""):  # it indexed with -100
            g.failure += "; targets equal to -100 are ignored: leave those rows out before picking the target's entry"
        hint = _overflow_hint(got, cross_entropy(logits, targets)) or _mean_over_all_hint(got, logits, targets)
        if not g.expect(description, not hint, hint):
            break
        ref = logits.clone().requires_grad_(True)
        expected = cross_entropy(ref, targets)
        if not g.compare(description + ": the loss", got, expected, rtol=TOL, atol=TOL):
            break
        expected.backward()
        differentiable = isinstance(got, torch.Tensor) and got.requires_grad
        g.expect(description, differentiable, "the loss has no gradient: build it from torch operations on the logits")
        if differentiable:
            g.call(got.backward)
            g.compare(description + ": the gradient of the logits", x.grad, ref.grad, rtol=TOL, atol=TOL)
    return g.result()


def _parameters(seed: int, scale: float) -> list[torch.nn.Parameter]:
    """Five parameters of different shapes; the third has no gradient (as a frozen or unused one)."""
    params = []
    for i, shape in enumerate([(4, 3), (3,), (2, 2), (5, 1, 2), (1,)]):
        p = torch.nn.Parameter(torch.randn(shape, generator=_gen(seed + i)))
        if i != 2:
            p.grad = torch.randn(shape, generator=_gen(seed + 100 + i)) * scale
        params.append(p)
    return params


def _clipped_alone(params: list[torch.nn.Parameter], max_norm: float) -> list[torch.Tensor]:
    """The mistake: every gradient clipped by its own norm."""
    return [p.grad * (max_norm / (p.grad.norm() + 1e-6)).clamp(max=1.0) for p in params if p.grad is not None]


def check_clip_grad_norm(fn) -> CheckResult:
    """``fn(params, max_norm)`` must return the global norm before clipping and clip every .grad in place."""
    g = Grader("check_clip_grad_norm")
    for seed, scale, max_norm in ((0, 3.0, 1.0), (1, 0.1, 5.0), (2, 10.0, 0.5)):
        ours, theirs = _parameters(seed, scale), _parameters(seed, scale)
        mistake = _clipped_alone(theirs, max_norm)
        norm = clip_grad_norm(ours, max_norm)
        what = f"gradients of global norm {norm.item():.3g}, max_norm={max_norm}"
        got_norm = g.call(fn, theirs, max_norm)
        if got_norm is FAILED and "NoneType" in (g.failure or ""):
            g.failure += "; skip the parameters whose .grad is None (frozen or unused ones)"
        got = [p.grad for p in theirs if p.grad is not None]
        alone = all(_close(a, b) for a, b in zip(got, mistake)) and len(got) == len(mistake)
        per_parameter = alone and norm.item() > max_norm and not _close(mistake[0], ours[0].grad)
        g.expect(
            what,
            not per_parameter,
            "each gradient was scaled by its own norm; clip by the norm of all gradients as one vector, "
            "sqrt(sum over tensors of ||g_i||^2), and scale every gradient by the same factor",
        )
        if isinstance(got_norm, (torch.Tensor, float)) and torch.as_tensor(got_norm).numel() == 1 and norm > max_norm:
            after = abs(float(got_norm) - max_norm) < TOL * max_norm
            g.expect(what, not after, "you returned the norm after clipping (= max_norm); return the one before")
        g.compare(what + ": the returned norm", got_norm, norm.item(), rtol=TOL, atol=TOL)
        if not g.compare(what + ": the clipped gradients", got, [p.grad for p in ours if p.grad is not None], atol=TOL):
            break  # the first failure is the message
    return g.result()
