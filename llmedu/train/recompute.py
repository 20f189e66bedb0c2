"""Activation recomputation (gradient checkpointing): trade compute for activation memory.

Backward needs the tensors the forward pass saved (layer inputs, attention probabilities, GELU
inputs...). For a transformer they dominate memory: s*b*h*(34 + 5*a*s/h) bytes per layer in 16 bits
(Korthikanti et al. 2022, sec. 4.1). Checkpointing keeps only the *input* of a segment; the
segment's forward runs without saving anything, and backward runs it again, with grad enabled, just
before it is needed (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

    policy     kept for backward                                extra compute
    none       every activation of every block                  none
    blocks     each block's input; in backward, one block's     one more forward of every block
               activations at a time                            (about +33% of a step)
    sqrt       every k-th block's input, k = sqrt(L); in        the same
               backward, k blocks' activations at a time
    attention  all but the insides of each attention sub-layer  one more forward of each attention
               (its T x T scores, the part that grows as T^2)   sub-layer (Korthikanti et al.'s
                                                                *selective* recomputation, sec. 5,
                                                                recomputes the core only)

``Recompute`` is the whole mechanism, an ``autograd.Function``: forward runs the segment under
``no_grad`` and saves its inputs; backward restores the random-number generator state of the
forward (so that dropout draws the same mask), re-runs the segment with grad enabled, and
backpropagates through the fresh graph. The autocast state of the forward is restored as well.

``recompute_modules`` and ``recompute_segments`` install it on modules of a model without
changing their parameters or their state-dict names (the module's ``forward`` attribute is replaced
on the instance; ``restore`` removes it). ``apply_policy`` does it for our ``Transformer``.

Left out: the non-reentrant variant built on saved-tensor hooks (``torch.utils.checkpoint`` with
``use_reentrant=False``), which also handles inputs that do not require grad and early stopping of
the recomputation; offloading saved activations to CPU memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

__all__ = ["POLICIES", "Recompute", "checkpoint", "recompute_modules", "recompute_segments", "restore", "apply_policy"]

POLICIES = ("none", "blocks", "sqrt", "attention")


class Recompute(torch.autograd.Function):
    """``Recompute.apply(fn, *args)``: ``fn(*args)`` whose internals are recomputed in backward."""

    @staticmethod
    def forward(ctx, fn: Callable, *args):
        ctx.fn = fn
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.device_type = tensors[0].device.type
        # the random state *before* the segment, so that backward replays the same dropout masks
        ctx.cpu_rng = torch.get_rng_state()
        ctx.device = tensors[0].device
        ctx.cuda_rng = torch.cuda.get_rng_state(ctx.device) if ctx.device_type == "cuda" else None
        ctx.autocast = (torch.is_autocast_enabled(ctx.device_type), torch.get_autocast_dtype(ctx.device_type))
        ctx.tensor_index = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*tensors)  # only the inputs are kept
        with torch.no_grad():  # nothing inside is saved for backward
            return fn(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_index, ctx.saved_tensors):  # detached copies: a fresh graph
            args[i] = t.detach().requires_grad_(t.requires_grad)
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):  # the caller's RNG stream is left untouched
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
                outputs = ctx.fn(*args)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        # gradients flow to the segment's parameters (accumulated into .grad) and to its inputs
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *(a.grad if isinstance(a, torch.Tensor) else None for a in args))


def checkpoint(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, keeping only the inputs for backward and recomputing the rest.

    Tensors among ``kwargs`` are inputs too (an attention mask, RoPE tables): gradients reach them.
    At least one tensor input must require grad when grad is enabled: otherwise the output would
    not require grad and the parameters inside ``fn`` would silently get no gradient.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # inference: nothing would be saved anyway
    names = list(kwargs)
    flat = [*args, *kwargs.values()]
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat):
        raise ValueError(
            "checkpoint() needs at least one tensor input that requires grad; otherwise the output "
            "does not require grad and the parameters inside get no gradient"
        )

    def run(*flat_args):
        positional, keyword = flat_args[: len(args)], flat_args[len(args) :]
        return fn(*positional, **dict(zip(names, keyword)))

    return Recompute.apply(run, *flat)


# -- installing it on modules -------------------------------------------------------------------
def _install(module: nn.Module, forward: Callable) -> None:
    if "forward" in module.__dict__:
        raise RuntimeError(f"{type(module).__name__} already has recomputation installed; call restore() first")
    module.forward = forward  # an instance attribute: found before the class's forward


def recompute_modules(modules: Iterable[nn.Module]) -> None:
    """Run each module's forward under ``checkpoint`` (its input is kept, its insides recomputed)."""
    for module in modules:
        original = type(module).forward.__get__(module)
        _install(module, lambda *args, _f=original, **kwargs: checkpoint(_f, *args, **kwargs))


def recompute_segments(blocks: Sequence[nn.Module], segment: int) -> None:
    """Checkpoint ``blocks`` in segments of ``segment`` consecutive blocks (Chen et al.'s scheme).

    For a model that calls its blocks one after the other, each with the same keyword arguments,
    ``x = block(x, **kw)``: the first block of a segment runs the whole segment under one
    checkpoint, and the others pass their input through unchanged. Only every ``segment``-th hidden
    state is then kept; in backward a whole segment is recomputed at once.
    """
    if segment < 1 or segment > len(blocks):
        raise ValueError(f"segment must be between 1 and the number of blocks ({len(blocks)}), got {segment}")
    for start in range(0, len(blocks), segment):
        members = [type(b).forward.__get__(b) for b in blocks[start : start + segment]]

        def run_segment(x, *args, _members=members, **kwargs):
            for forward in _members:
                x = forward(x, *args, **kwargs)
            return x

        _install(blocks[start], lambda x, *args, _run=run_segment, **kwargs: checkpoint(_run, x, *args, **kwargs))
        for follower in blocks[start + 1 : start + segment]:
            _install(follower, lambda x, *args, **kwargs: x)  # already computed by the segment's head


def restore(model: nn.Module) -> int:
    """Remove every installed recomputation from ``model``; returns how many modules had one."""
    count = 0
    for module in model.modules():
        if "forward" in module.__dict__:
            del module.forward
            count += 1
    return count


def apply_policy(model: nn.Module, policy: str) -> None:
    """Install a recomputation policy (see the module docstring) on our ``Transformer``.

    ``model`` is a ``Transformer`` or a model with one as its ``.transformer`` (``CausalLM``,
    ``MaskedLM``); any installed policy is removed first.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown recomputation policy {policy!r}; choose one of {POLICIES}")
    stack = getattr(model, "transformer", model)
    blocks = getattr(stack, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"apply_policy needs our Transformer (a .blocks ModuleList); got {type(model).__name__}")
    restore(model)
    if policy == "blocks":
        recompute_modules(blocks)
    elif policy == "sqrt":
        recompute_segments(blocks, max(1, round(math.sqrt(len(blocks)))))
    elif policy == "attention":
        recompute_modules(block.attn for block in blocks)
