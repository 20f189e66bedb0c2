"""AdamW from scratch: Adam with *decoupled* weight decay.

Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization" (ICLR), Algorithm 2, on top of
Adam with its bias correction (Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization",
Algorithm 1). For every parameter tensor p with gradient g, at step t = 1, 2, ...:

    p <- p - lr * wd * p                      decoupled decay: it never enters the moments
    m <- beta1 * m + (1 - beta1) * g          first moment (mean of the gradient)
    v <- beta2 * v + (1 - beta2) * g^2        second moment (mean of its square), element-wise
    m_hat = m / (1 - beta1^t)                 bias correction: m and v start at 0, so early
    v_hat = v / (1 - beta2^t)                 averages are too small by exactly these factors
    p <- p - lr * m_hat / (sqrt(v_hat) + eps)

Adam with L2 regularisation instead adds ``wd * p`` to g: the decay then goes through m and v and
is divided by sqrt(v_hat), so weights with large gradients are decayed *less*. Decoupling it is
the whole point of AdamW (the paper's Section 2).

Two conventions, both PyTorch's. With them we match ``torch.optim.AdamW`` bit for bit in fp32 on
the CPU, where torch also steps one tensor at a time (on a GPU it defaults to its multi-tensor
kernels: the same algebra; not compared here).

* The decay is multiplied by ``lr``. The paper's Algorithm 2 writes ``eta_t * lambda * p`` with
  ``eta_t`` the schedule multiplier *without* the base rate alpha; PyTorch's ``weight_decay`` is
  therefore the paper's lambda divided by alpha. The decay uses p *before* this step's update.
* The order of floating-point operations. Rounding differs between algebraically equal forms,
  and training amplifies it: a one-ulp change in any single line (the decay as ``p - lr*wd*p``,
  m as ``beta1*m + (1-beta1)*g``, v with ``g*g`` formed first, or ``lr * m_hat / (sqrt(v_hat)+eps)``)
  moves the parameters of a 2-layer transformer (lr 3e-3) by up to 1e-7 after 1 step, 3-5e-6
  after 10 and 5-7e-5 after 100 (measured). ``adamw_update_`` below therefore does the same algebra in
  PyTorch's order: ``p * (1 - lr*wd)``; ``m.lerp_(g, 1 - beta1)``; ``v * beta2 + (1-beta2) * g*g``
  fused (``addcmul_``); the scalars ``lr / (1 - beta1^t)`` and ``(1 - beta2^t) ** 0.5`` as Python
  floats (float64); ``denom = sqrt(v) / sqrt(1 - beta2^t) + eps``; ``p += -step_size * m / denom``.

Left out: AMSGrad, ``maximize``, complex parameters, the fused and multi-tensor (foreach) kernels
(one tensor at a time: the same algebra, slower on a GPU), tensor-valued learning rates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["AdamW", "adamw_update_", "check_hyperparameters"]


def check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Raise ``ValueError`` with the reason for a learning rate, betas, eps or decay AdamW cannot use."""
    if not lr >= 0.0:  # `not >=` also rejects NaN
        raise ValueError(f"learning rate must be >= 0, got lr={lr!r}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta{i + 1} must be in [0, 1) (1 would never forget the first gradient), got {beta!r}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0 (it keeps the division by sqrt(v) finite), got eps={eps!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got weight_decay={weight_decay!r}")


@torch.no_grad()
def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step of one tensor, in place: updates ``param``, ``exp_avg`` (m) and ``exp_avg_sq`` (v).

    ``step`` is t, counted from 1 and already including this step. All tensors have p's shape.
    """
    param.mul_(1 - lr * weight_decay)  # p <- p - lr*wd*p            (Alg. 2, line 12, decoupled decay)
    exp_avg.lerp_(grad, 1 - beta1)  # m <- m + (1-beta1)(g - m) = beta1*m + (1-beta1)*g      (line 7)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # v <- beta2*v + (1-beta2)*g*g  (line 8)
    bias_correction1 = 1 - beta1**step  # m_hat = m / bias_correction1                        (line 9)
    bias_correction2 = 1 - beta2**step  # v_hat = v / bias_correction2                        (line 10)
    step_size = lr / bias_correction1  # a Python float: the scalar algebra is done in float64
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)  # sqrt(v_hat) + eps
    param.addcdiv_(exp_avg, denom, value=-step_size)  # p <- p - lr * m_hat / (sqrt(v_hat) + eps)  (line 12)


class AdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019) with per-parameter state ``step``, ``exp_avg``, ``exp_avg_sq``.

    A drop-in for ``torch.optim.AdamW(params, lr, betas, eps, weight_decay)``: same defaults, same
    state names (its ``state_dict`` loads into ours and back), the same numbers in fp32. Parameter
    groups may set their own ``lr``, ``betas``, ``eps`` and ``weight_decay``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        check_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:  # a group may override the defaults: check its values too
            check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Update every parameter that has a gradient; ``closure`` (optional) recomputes and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():  # the closure runs forward and backward
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue  # frozen, or unused in this forward pass: no update, no decay
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients (nn.Embedding(sparse=True))")
                state = self.state[p]
                if not state:  # the first step: the moments start at zero (hence the bias correction)
                    state["step"] = torch.tensor(0.0)  # a tensor, as in torch, so state_dicts interchange
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)  # m, p's shape
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)  # v
                state["step"] += 1
                adamw_update_(
                    p,
                    p.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    int(state["step"].item()),
                    group["lr"],
                    beta1,
                    beta2,
                    group["eps"],
                    group["weight_decay"],
                )
        return loss
