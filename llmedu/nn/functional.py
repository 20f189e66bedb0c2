"""Softmax, log-softmax, log-sum-exp and cross-entropy, written out and numerically stable.

The textbook formulas

    softmax(x)_i     = exp(x_i) / sum_j exp(x_j)
    log_softmax(x)_i = x_i - log sum_j exp(x_j)
    cross_entropy    = -log_softmax(z)_y = logsumexp(z) - z_y     (one row of logits z, target class y)

break as soon as a logit is large. exp overflows to inf above ln(largest float):

    float32, bfloat16   ln(3.4e38) = 88.7    exp(89) = inf
    float16             ln(65504)  = 11.09   exp(12) = inf     (fp16 has 5 exponent bits, bf16 has fp32's 8)
    float64             ln(1.8e308) = 709.8

and then inf / inf = nan. Logits of a few tens are ordinary in a trained language model, and in
fp16 even exp(12) is too much. Very negative logits fail the other way: exp(-104) = 0 in float32, so a
row of them gives log(0) = -inf.

The log-sum-exp trick: for any constant m, log sum_j exp(x_j) = m + log sum_j exp(x_j - m). With
m = max_j x_j every exponent is <= 0, so no exp overflows, and the largest term is exp(0) = 1, so the
sum lies in [1, V] and its log cannot be -inf. The shift changes nothing mathematically, so ``m`` is
detached: no gradient needs to flow through the max (autograd would otherwise route 1 - sum(softmax),
zero up to rounding, to whichever entry was the largest).

Half-precision inputs (fp16, bf16) are computed in float32 and rounded to their dtype once, at the end:
summing thousands of exponentials in a format with 8 (bf16) or 11 (fp16) significant bits loses most of
the sum. torch's kernels accumulate in float32 too.

``cross_entropy`` matches ``torch.nn.functional.cross_entropy`` for class-index targets: targets equal to
``ignore_index`` (-100, as in PyTorch) add nothing, and ``reduction="mean"`` divides by the number of
targets that are *not* ignored, so a batch whose targets are all ignored gives 0 / 0 = nan, as torch does.

Left out: class weights, label smoothing, probability targets, logits with extra dimensions
(N, V, d1, ...), and fused kernels that never materialise the (N, V) probabilities (Liger, Apple's
"Cut Your Losses"); the models of this course keep torch's fused loss for speed.
"""

from __future__ import annotations

import torch

__all__ = ["softmax", "log_softmax", "logsumexp", "cross_entropy"]

_HALF = (torch.float16, torch.bfloat16)  # computed in float32, rounded once at the end


def _upcast(x: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(x):
        raise TypeError(f"expected floating-point logits, got dtype {x.dtype}")
    return x.float() if x.dtype in _HALF else x


def _shifted(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x - max(x) along ``dim``: every entry <= 0, so exp cannot overflow. The max is a constant (detached)."""
    return x - x.amax(dim, keepdim=True).detach()


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(x_i - m) / sum_j exp(x_j - m) with m = max(x): equal to exp(x_i) / sum_j exp(x_j), without overflow."""
    e = _shifted(_upcast(x), dim).exp()  # in (0, 1], and exactly 1 at the max
    return (e / e.sum(dim, keepdim=True)).to(x.dtype)


def _log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    s = _shifted(x, dim)
    return s - s.exp().sum(dim, keepdim=True).log()  # the sum is in [1, V]: its log is finite


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x_i - logsumexp(x), computed as (x_i - m) - log sum_j exp(x_j - m)."""
    return _log_softmax(_upcast(x), dim).to(x.dtype)


def logsumexp(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """log sum_j exp(x_j) = m + log sum_j exp(x_j - m), with m = max(x).

    A row whose max is infinite is shifted by 0 instead (as ``torch.logsumexp`` does): -inf - (-inf) would
    be nan, and the true answers are -inf for a row of -inf and +inf for a row holding +inf.
    """
    x32 = _upcast(x)
    m = x32.amax(dim, keepdim=True).detach()
    m = m.masked_fill(m.isinf(), 0.0)
    out = (x32 - m).exp().sum(dim, keepdim=True).log() + m
    return (out if keepdim else out.squeeze(dim)).to(x.dtype)


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """-log softmax(logits)[target] per row; the mean (or sum) over the rows whose target is not ignored.

    logits (N, V) floating point; targets (N,) integer class ids in [0, V), or ``ignore_index``.
    Returns a scalar for "mean" and "sum", a (N,) tensor for "none" (0 at ignored rows).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be (N, V), got shape {tuple(logits.shape)}; flatten the batch and time axes")
    if not torch.is_floating_point(logits):
        raise TypeError(f"logits must be floating point, got dtype {logits.dtype}")
    if targets.dtype == torch.bool or torch.is_floating_point(targets) or torch.is_complex(targets):
        raise TypeError(f"targets must be integer class ids, got dtype {targets.dtype}")
    n, vocab = logits.shape
    if targets.shape != (n,):
        raise ValueError(f"targets must be (N,) = ({n},) for logits {tuple(logits.shape)}, got {tuple(targets.shape)}")
    keep = targets != ignore_index  # (N,) the rows that count
    bad = keep & ((targets < 0) | (targets >= vocab))
    if bad.any():  # a GPU->CPU sync: the price of a clear error instead of a wrong gather
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"target {int(targets[i])} at row {i} is outside the classes [0, {vocab}) "
            f"and is not ignore_index={ignore_index}"
        )

    rows = _upcast(logits[keep])  # (K, V), K = number of kept rows; ignored rows get no gradient at all
    picked = targets[keep].long()[:, None]  # (K, 1)
    nll = -_log_softmax(rows, dim=-1).gather(-1, picked).squeeze(-1)  # (K,)  = logsumexp(z) - z_y

    if reduction == "mean":
        loss = nll.sum() / keep.sum()  # over the kept targets; K = 0 gives 0 / 0 = nan, like torch
    elif reduction == "sum":
        loss = nll.sum()
    else:
        loss = nll.new_zeros(n).masked_scatter(keep, nll)  # (N,) with 0 at ignored rows
    return loss.to(logits.dtype)
