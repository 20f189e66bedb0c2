"""Lesson 03's grader on training dynamics (its norm graders are in ``llmedu.checks.nn``).

    check_adam_first_update(fn)   fn(grad, weight, lr, eps) -> ||dW|| / ||W|| after Adam's first step

Adam (Kingma & Ba 2015, algorithm 1) divides the bias-corrected first moment by the square root of the
bias-corrected second moment. At step 1 both are the gradient itself (m_hat = g, v_hat = g^2), so every
entry moves by lr * g / (|g| + eps): about lr, whatever the size of g, unless |g| is near eps.

The weight is drawn as the lesson's training grid draws its last W_down: ``CausalLM.reset_parameters`` scales
the projections into the residual stream (``o_proj``, ``down_proj``) by 1/sqrt(2L), GPT-2's scheme, so at
L = 8 layers their standard deviation is 0.02 / sqrt(16) = 0.005, not 0.02.
"""

from __future__ import annotations

import math

import torch

from .core import CheckResult, Grader

__all__ = ["check_adam_first_update", "adam_first_update", "GRID_DOWN_STD"]

GRID_DOWN_STD = 0.02 / math.sqrt(2 * 8)  # the 8-layer grid model's W_down: init_std / sqrt(2L)


def adam_first_update(grad: torch.Tensor, weight: torch.Tensor, lr: float, eps: float) -> float:
    """The reference: ||lr * g / (|g| + eps)|| / ||W|| (Frobenius norms), torch.optim.Adam's step 1."""
    g = grad.double()
    return (lr * g / (g.abs() + eps)).norm().item() / weight.double().norm().item()


def check_adam_first_update(fn) -> CheckResult:
    """``fn(grad, weight, lr, eps)``: the relative size of Adam's first update of ``weight``.

    The cases change the gradient's scale by 10^4 (an answer that scales with ||g||, as SGD's would, fails),
    give it entries far below ``eps`` and exact zeros (an answer of lr * sqrt(numel) / ||W||, which is
    right for most gradients, fails there).
    """
    g = Grader("check_adam_first_update")
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 256, generator=gen) * GRID_DOWN_STD  # the grid's last W_down, (d, 4d)
    direction = torch.randn(64, 256, generator=gen)
    zeros = direction * (torch.rand(64, 256, generator=gen) > 0.5)  # half the entries get no gradient
    cases = [
        ("a gradient of scale 1e-1", direction * 1e-1, 3e-3, 1e-8),
        ("the same gradient at scale 1e-5", direction * 1e-5, 3e-3, 1e-8),
        ("a gradient of scale 1e-9, below eps", direction * 1e-9, 3e-3, 1e-8),
        ("half the entries without gradient", zeros * 1e-2, 1e-3, 1e-8),
        ("a gradient of scale 1e-6 with eps = 1e-6", direction * 1e-6, 3e-3, 1e-6),
    ]
    for description, grad, lr, eps in cases:
        got = g.call(fn, grad.clone(), weight.clone(), lr, eps)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if got is not None and not isinstance(got, float | int) and g.failure is None:
            g.expect(description, False, f"expected a number, got {type(got).__name__}")
        g.compare(f"{description}, lr={lr:g}, eps={eps:g}", got, adam_first_update(grad, weight, lr, eps), rtol=1e-4)
    return g.result()
