"""What a transformer block keeps for backward, and selective recomputation of the attention core.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") count
what one layer keeps for backward (sec. 4.1): in 16-bit, with dropout masks of one byte,

    s*b*h*34 bytes     every (s, b, h)-sized tensor a matmul, a norm or GELU needs again: the two
                       norm inputs, the QKV input, Q and K, V, the output projection's input, the FFN's
                       input, GELU's input and output (4h wide each), two residual dropout masks
    5*a*s^2*b bytes    the attention core: the (a, s, s) softmax output, its dropout mask, the dropout output

(s the sequence, b the batch, h the width, a the heads). The second term grows as s^2 but costs only
the core's 4*s*h FLOPs per token to recompute, against 72*h^2 + 12*s*h for a training step; so
"selective" recomputation (sec. 5) keeps the first term and recomputes the core in backward, while
"full" recomputation keeps only each layer's input and reruns the whole layer.

``recompute_core(model)`` does the selective kind for our ``Transformer``: each ``Attention`` runs its
attention function (the core: scores, softmax, P V) under ``recompute.checkpoint``, which keeps q, k
and v, as the projections need them anyway, and drops the (B, H, T, T) probabilities.

``saved_bytes(fn, *args)`` is the measurement to hold a count against: it runs ``fn(*args)`` and adds up
the storage of every tensor autograd saves for backward, each storage once, parameters left out.

Ours differs from the count above in two places: fp32 (4 bytes a number), and no dropout on the
attention probabilities (our attention has none), so the core keeps a*s^2*b numbers, not 5/2 of that.
Left out: the sequence-parallel sharding of the first term (sec. 4.2.2), and offloading to CPU memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..nn.attention import ATTENTION_FUNCTIONS, Attention, get_attention, register_attention
from .recompute import checkpoint

__all__ = ["recompute_core", "undo_recompute_core", "saved_bytes"]

SUFFIX = "+recompute-core"


def _core_recomputed(impl: str) -> str:
    """Register (once) the attention function ``impl`` run under a checkpoint; returns its name."""
    name = impl + SUFFIX
    if name not in ATTENTION_FUNCTIONS:
        inner = get_attention(impl)

        def core(q, k, v, causal, attn_mask):  # (B, H, T, D) -> (B, H, T, D), the probabilities recomputed
            return checkpoint(inner, q, k, v, causal, attn_mask)

        register_attention(name, core)
    return name


def recompute_core(model: nn.Module) -> int:
    """Recompute only the attention core of every ``Attention`` in ``model``; returns how many.

    Undo with ``undo_recompute_core``. A model with no ``Attention`` is refused: nothing would change.
    """
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    if not attentions:
        raise TypeError(f"recompute_core found no llmedu Attention inside {type(model).__name__}")
    for module in attentions:
        if not module.impl.endswith(SUFFIX):
            module.impl = _core_recomputed(module.impl)
    return len(attentions)


def undo_recompute_core(model: nn.Module) -> None:
    """Every ``Attention`` in ``model`` back to the function it ran before ``recompute_core``."""
    for module in model.modules():
        if isinstance(module, Attention) and module.impl.endswith(SUFFIX):
            module.impl = module.impl[: -len(SUFFIX)]


def saved_bytes(fn: Callable, *args, exclude: nn.Module | None = None, **kwargs) -> int:
    """Bytes of the storages autograd saves for backward while ``fn(*args, **kwargs)`` runs.

    Each storage counts once (a tensor saved by two ops, or a view of another, is one tensor in
    memory); the parameters of ``exclude`` (a weight a matmul saves) are not activations and are left out.
    """
    skip = {p.untyped_storage().data_ptr() for p in exclude.parameters()} if exclude is not None else set()
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return sum(seen.values())
