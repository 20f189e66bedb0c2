"""The graders of the numerical pieces pass correct answers and fail the usual mistakes, saying which."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmedu.checks.numerics import check_clip_grad_norm, check_cross_entropy, check_log_softmax
from llmedu.nn.functional import cross_entropy, log_softmax
from llmedu.train.clipping import clip_grad_norm, global_grad_norm


def _failure(result) -> str:
    assert not result, "the grader passed a wrong answer"
    return result.failure


def test_graders_pass_ours_and_torchs():
    assert check_log_softmax(log_softmax)
    assert check_log_softmax(lambda x: F.log_softmax(x, dim=-1))
    assert check_cross_entropy(cross_entropy)
    assert check_cross_entropy(F.cross_entropy)
    assert check_clip_grad_norm(clip_grad_norm)
    assert check_clip_grad_norm(torch.nn.utils.clip_grad_norm_)


def test_log_softmax_without_the_max_fails_on_large_logits_and_says_why():
    naive = lambda x: x - x.exp().sum(-1, keepdim=True).log()
    message = _failure(check_log_softmax(naive))
    assert "logits around +1000" in message and "inf or nan where the answer is finite" in message
    assert "exp(x) overflows to inf for x > 88.7" in message and "log-sum-exp trick" in message
    also_naive = lambda x: (x.exp() / x.exp().sum(-1, keepdim=True)).log()
    assert "logits around +1000" in _failure(check_log_softmax(also_naive))
    wrong_dim = lambda x: F.log_softmax(x, dim=0)
    assert "values differ" in _failure(check_log_softmax(wrong_dim))


def _mean_over_all(logits, targets):
    keep = targets != -100
    return cross_entropy(logits, targets, reduction="sum") / len(keep)  # counts the ignored targets too


def test_cross_entropy_mistakes_are_named():
    message = _failure(check_cross_entropy(_mean_over_all))
    assert "you divided by all 8 targets, but 3 of them are -100" in message
    assert "the mean is over the 5 that are not ignored" in message

    def no_ignoring(logits, targets):  # indexes with -100
        picked = logits.log_softmax(-1)[torch.arange(len(targets)), targets]
        return -picked.mean()

    message = _failure(check_cross_entropy(no_ignoring))
    assert "raised IndexError" in message and "leave those rows out" in message

    def naive(logits, targets):  # ignores correctly, but exp overflows: only the scale-300 case catches it
        keep = targets != -100
        z, t = logits[keep], targets[keep]
        return (z.exp().sum(-1).log() - z[torch.arange(len(t)), t]).mean()

    message = _failure(check_cross_entropy(naive))
    assert "scale 300" in message and "inf or nan" in message

    detached = lambda logits, targets: cross_entropy(logits.detach(), targets)
    assert "the loss has no gradient" in _failure(check_cross_entropy(detached))
    summed = lambda logits, targets: cross_entropy(logits, targets, reduction="sum")
    assert "the loss" in _failure(check_cross_entropy(summed))


def test_clipping_mistakes_are_named():
    def per_parameter(params, max_norm):
        norm = global_grad_norm(params)
        for p in params:
            if p.grad is not None:
                p.grad *= (max_norm / (p.grad.norm() + 1e-6)).clamp(max=1.0)
        return norm

    message = _failure(check_clip_grad_norm(per_parameter))
    assert "each gradient was scaled by its own norm" in message and "same factor" in message

    def norm_after(params, max_norm):
        clip_grad_norm(params, max_norm)
        return global_grad_norm(params)

    assert "you returned the norm after clipping" in _failure(check_clip_grad_norm(norm_after))

    def breaks_on_none(params, max_norm):
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
        for p in params:
            p.grad *= min(1.0, max_norm / (norm.item() + 1e-6))
        return norm

    assert "skip the parameters whose .grad is None" in _failure(check_clip_grad_norm(breaks_on_none))

    def no_clip(params, max_norm):
        return global_grad_norm(params)

    assert "the clipped gradients" in _failure(check_clip_grad_norm(no_clip))
