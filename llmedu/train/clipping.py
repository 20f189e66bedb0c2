"""Global-norm gradient clipping (Pascanu, Mikolov & Bengio 2013, "On the difficulty of training RNNs", Alg. 1).

A rare batch can give a gradient many times larger than usual (a loss spike), and one SGD or Adam step
along it can undo hours of training. Clipping bounds the step: treat *all* gradients of the model as
one vector g and, if its norm exceeds ``max_norm``, scale it down to that norm:

    g <- g * min(1, max_norm / (||g|| + 1e-6))          (1e-6: no division by zero, as in torch)

The direction of the update is kept; only its length is bounded. Clipping each tensor by its own
norm instead would change the direction (every tensor shrinks by a different factor): that is a
different, rarely wanted, method.

The norm of the whole vector never needs the vector: for p = 2,
||g||_2 = sqrt(sum_i ||g_i||_2^2) = || (||g_1||, ..., ||g_n||) ||_2, and for p = inf,
||g||_inf = max_i ||g_i||_inf: the norm of the per-tensor norms, so nothing is concatenated.

Every gradient is multiplied even when the factor is 1 (exact in floating point): deciding *whether*
to clip would need the norm on the CPU, a GPU -> CPU synchronisation each step.

This is what ``torch.nn.utils.clip_grad_norm_`` does (it is ``get_total_norm`` then
``clip_grads_with_norm_``); the trainer in ``loop.py`` uses ours. Left out: ``error_if_nonfinite``
(the trainer checks the norm itself), torch's ``foreach`` kernels (one launch for all tensors), and
the sharded case, where each rank holds part of g and the squared norms must be summed across ranks
(ZeRO, FSDP: ``all_reduce`` of ||g_local||^2 before the square root).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["global_grad_norm", "clip_grads_with_norm", "clip_grad_norm"]

Params = torch.Tensor | Iterable[torch.Tensor]  # model.parameters(), a list, or a single tensor


def _as_list(params: Params) -> list[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else list(params)  # one tensor, or many (a generator too)


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]  # parameters without a gradient are skipped


def _check_max_norm(max_norm: float) -> float:
    if not (float(max_norm) > 0.0):  # also refuses nan
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    return float(max_norm)


def global_grad_norm(params: Params, norm_type: float = 2.0) -> torch.Tensor:
    """The p-norm of all the gradients of ``params`` as one vector (a 0-d tensor; 0.0 if there are none)."""
    norm_type = float(norm_type)
    if not (norm_type >= 1.0):  # also refuses nan
        raise ValueError(f"norm_type must be >= 1 (2.0 or inf, usually), got {norm_type}")
    grads = _grads(_as_list(params))
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).to(device) for g in grads])  # (n,)
    return torch.linalg.vector_norm(norms, norm_type)  # the norm of the per-tensor norms (module docstring)


def clip_grads_with_norm(params: Params, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / (total_norm + 1e-6)), in place; ``total_norm`` given."""
    max_norm = _check_max_norm(max_norm)
    grads = _grads(_as_list(params))
    if not grads:
        return
    scale = (max_norm / (torch.as_tensor(total_norm) + 1e-6)).clamp(max=1.0)  # a 0-d tensor: it stays on the device
    for g in grads:
        g.mul_(scale.to(g.device))


def clip_grad_norm(params: Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``params`` to a global ``norm_type``-norm of at most ``max_norm``, in place.

    Returns the norm *before* clipping (what is worth logging: a spike shows there, not after clipping).
    """
    max_norm = _check_max_norm(max_norm)  # before anything is computed
    params = _as_list(params)  # walked twice: once for the norm, once to scale
    total = global_grad_norm(params, norm_type)
    clip_grads_with_norm(params, max_norm, total)
    return total
