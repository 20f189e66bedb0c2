"""Graders for the optimizer lesson: one AdamW step written by hand.

check_adamw_step(fn)    fn(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay)
                        -> (new_param, new_exp_avg, new_exp_avg_sq), one step of AdamW
                        (Loshchilov & Hutter 2019, Algorithm 2, with Adam's bias correction)

The cases include a large learning rate and decay (lr 0.1, weight decay 0.5), so that decaying
after the update instead of before (a difference of lr^2 * wd * update) shows, and a first step
with gradients of the size of eps (v << eps^2 is where eps's place matters), so that Kingma & Ba's
"efficient" form, eps added to sqrt(v) *before* the bias correction (an effective eps larger by
1 / sqrt(1 - beta2^t), 32x at step 1 with beta2 = 0.999), fails; when an answer is wrong, the
grader also tries the usual mistakes and names the one that matches.
"""

from __future__ import annotations

import torch

from llmedu.checks.core import CheckResult, Grader
from llmedu.optim.adamw import adamw_update_

__all__ = ["check_adamw_step"]

OUTPUTS = ("new_param", "new_exp_avg", "new_exp_avg_sq")


def _reference(param, grad, m, v, step, lr, beta1, beta2, eps, wd, mistake: str = ""):
    """Our step on copies, or the step with one typical ``mistake``: the three new tensors."""
    p, m, v, g = param.clone(), m.clone(), v.clone(), grad.clone()
    if mistake == "":
        adamw_update_(p, g, m, v, step, lr, beta1, beta2, eps, wd)
        return p, m, v
    if mistake == "coupled":
        g = g + wd * p  # Adam + L2: the decay goes through the moments
    if mistake in ("coupled", "after"):
        wd_now = 0.0 if mistake == "coupled" else wd
        adamw_update_(p, g, m, v, step, lr, beta1, beta2, eps, 0.0)
        return p.mul_(1 - lr * wd_now), m, v
    p.mul_(1 - lr * wd)
    m.mul_(beta1).add_((1 - beta1) * g)
    v.mul_(beta2).add_((1 - beta2) * g * g)
    if mistake == "eps before bias correction":  # Kingma & Ba, end of Section 2: alpha_t and eps-hat
        step_size = lr * (1 - beta2**step) ** 0.5 / (1 - beta1**step)
        return p - step_size * m / (v.sqrt() + eps), m, v
    # "no bias correction": the step with m and v as they are
    return p - lr * m / (v.sqrt() + eps), m, v


MISTAKES = {
    "no bias correction": "m and v start at 0: divide them by (1 - beta1**step) and (1 - beta2**step)",
    "coupled": "this is Adam with L2 regularisation: the decay must not be added to the gradient (it would "
    "go through m and v); shrink the parameter directly, p <- p - lr * weight_decay * p",
    "after": "the decay is applied after the Adam update: decay the parameter as it was *before* this step",
    "eps before bias correction": "eps is added to sqrt(v) before the bias correction (Kingma & Ba's "
    "'efficient' form): add it to sqrt(v_hat), after correcting v, as torch.optim.AdamW does",
}


def _diagnose(got, args) -> str:
    """A hint naming the typical mistake whose result ``got`` matches, or ''."""
    if not (isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
        return ""
    for mistake, hint in MISTAKES.items():
        wrong = _reference(*args, mistake=mistake)
        if all(t.shape == w.shape and torch.allclose(t.float(), w, rtol=1e-5, atol=1e-7) for t, w in zip(got, wrong)):
            return f" Hint: your answer matches the mistake '{mistake}': {hint}."
    return ""


def _cases():
    """(description, args): shapes, early and late steps, with and without decay, large and small rates."""
    gen = torch.Generator().manual_seed(0)
    for shape, step, lr, betas, eps, wd in [
        ((5,), 1, 1e-3, (0.9, 0.999), 1e-8, 0.0),  # the first step: bias correction matters most
        ((4, 3), 1, 0.1, (0.9, 0.999), 1e-8, 0.5),  # large rate and decay: decay-before vs after shows
        ((4, 3), 10, 1e-2, (0.9, 0.95), 1e-6, 0.1),
        ((2, 3, 4), 1000, 3e-4, (0.8, 0.99), 1e-8, 0.01),  # late: bias correction nearly 1
        ((6,), 1, 1e-3, (0.9, 0.999), 1e-8, 0.0),  # gradients ~ eps: where eps is added matters
    ]:
        param = torch.randn(shape, generator=gen)
        grad = torch.randn(shape, generator=gen)
        if shape == (6,):
            grad = grad * eps  # v = (1 - beta2) g^2 << eps^2: sqrt(v_hat) = |g| is of eps's size
        if step == 1:  # the state of a fresh optimizer
            m, v = torch.zeros(shape), torch.zeros(shape)
        else:
            m = 0.1 * torch.randn(shape, generator=gen)
            v = 0.01 * torch.rand(shape, generator=gen)
        description = f"shape {shape}, step={step}, lr={lr:g}, betas={betas}, eps={eps:g}, weight_decay={wd:g}"
        yield description, (param, grad, m, v, step, lr, *betas, eps, wd)


def check_adamw_step(fn) -> CheckResult:
    """Grade ``fn``'s AdamW step against ``llmedu.optim.adamw.adamw_update_`` (fp32, tolerance 1e-6 + 1e-5 relative)."""
    g = Grader("check_adamw_step")
    for description, args in _cases():
        inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # fn may work in place
        got = g.call(fn, *inputs)
        expected = _reference(*args)
        if not g.expect(
            f"{description}: the answer",
            isinstance(got, (tuple, list)) and len(got) == 3,
            f"return a tuple {OUTPUTS}, got {type(got).__name__}",
        ):
            break
        for name, got_t, exp_t in zip(OUTPUTS, got, expected):
            # fp32 rounding of an equal formula written another way: a few ulps of values of size ~1
            if not g.compare(f"{description}: {name}", got_t, exp_t, rtol=1e-5, atol=1e-6):
                g.failure += _diagnose(got, args)
                break
        if g.failure is not None:
            break
    return g.result()
