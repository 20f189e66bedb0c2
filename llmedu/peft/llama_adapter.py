"""LLaMA-Adapter: learnable prompts with zero-initialised gated attention in the top layers
(Zhang et al. 2023, "LLaMA-Adapter: Efficient Fine-tuning of Language Models with Zero-init
Attention", eq. 6-8).

In each of the top L layers, P learnable vectors (an "adaption prompt", (P, d)) are projected by
the layer's own frozen key and value projections. Every token's query attends to them with a
softmax of its own, and the result enters the layer scaled by a learned gate g that starts at 0:

    out = attention(q, K, V) + g * softmax(q K_p^T / sqrt(D)) V_p        K_p = W_k p, V_p = W_v p

With g = 0 the model is exactly the pretrained one, so the prompts cannot disturb it early in
training (prefix tuning, which mixes its keys into the main softmax, has no such guarantee).
The prompt keys carry no position (no rotary embedding), the query keeps its own, as in the
official code and ``peft``. Parameters: L * (P * d + 1).

The attention module is adapted by wrapping it: the wrapper recomputes the query from the
hidden states it is handed. Two layouts are understood:

    q_proj, k_proj, v_proj, o_proj   Llama (Hugging Face) and our models: the wrapped module ends
                                     with o_proj, so the prompt's output goes through it too (its
                                     bias is subtracted: the base output already has it once)
    query, key, value                Hugging Face BERT's ``attention.self``: the output projection
                                     comes after the wrapped module, and o(a + b) = o(a) + W_o b

Left out: the multi-modal branch and the per-head gates of later versions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from ..nn.positions import rotate_half
from .inject import ensure_not_applied, find_modules, freeze_base, model_dims, replace_module

__all__ = ["AdaptionPromptAttention", "apply_llama_adapter"]

_LAYOUTS = {"llama": ("q_proj", "k_proj", "v_proj", "o_proj"), "bert": ("query", "key", "value", None)}


def _layout(attention: nn.Module) -> tuple[str, str, str, str | None]:
    for names in _LAYOUTS.values():
        if all(hasattr(attention, n) for n in names if n):
            return names
    raise TypeError(
        f"{type(attention).__name__} has neither q_proj/k_proj/v_proj/o_proj nor query/key/value: "
        "point the targets at the self-attention modules"
    )


class AdaptionPromptAttention(nn.Module):
    """An attention module plus a gated adaption prompt (see the module docstring)."""

    peft_method = "llama_adapter"

    def __init__(self, base: nn.Module, n_prompt: int, heads: int, kv_heads: int, head_dim: int, d_model: int):
        super().__init__()
        if not isinstance(n_prompt, int) or n_prompt <= 0:
            raise ValueError(f"n_prompt must be a positive int, got {n_prompt!r}")
        self.q, self.k, self.v, self.o = _layout(base)
        self.base = base
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        w = getattr(base, self.q).weight
        self.adaption_prompt = nn.Parameter(torch.randn(n_prompt, d_model, device=w.device, dtype=w.dtype))  # (P, d)
        self.adaption_gate = nn.Parameter(torch.zeros(1, device=w.device, dtype=w.dtype))  # zero-init: no effect yet
        self.enabled = True

    def forward(self, *args, **kwargs):
        out = self.base(*args, **kwargs)
        if not self.enabled:
            return out
        hidden = (
            kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else kwargs["x"])
        )  # (B, T, d)
        B, T, _ = hidden.shape
        H, D, P = self.heads, self.head_dim, self.adaption_prompt.shape[0]
        q = getattr(self.base, self.q)(hidden).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        q = _rotate(q, args, kwargs)
        k = getattr(self.base, self.k)(self.adaption_prompt).view(P, self.kv_heads, D).transpose(0, 1)  # (H_kv, P, D)
        v = getattr(self.base, self.v)(self.adaption_prompt).view(P, self.kv_heads, D).transpose(0, 1)  # (H_kv, P, D)
        k = k.repeat_interleave(H // self.kv_heads, dim=0)  # (H, P, D): grouped-query heads share a prompt key
        v = v.repeat_interleave(H // self.kv_heads, dim=0)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, T, P)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # its own softmax, over the prompt only
        extra = (self.adaption_gate * probs) @ v  # (B, H, T, D)
        extra = extra.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        if self.o is not None:
            extra = getattr(self.base, self.o)(extra) - _bias(
                getattr(self.base, self.o)
            )  # o_proj is linear: no second bias
        if isinstance(out, tuple):  # Hugging Face returns (output, attention weights)
            return (out[0] + extra, *out[1:])
        return out + extra


def _bias(linear: nn.Linear) -> torch.Tensor | float:
    return linear.bias if linear.bias is not None else 0.0


def _rotate(q: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """Apply the rotary embedding the attention module was handed, if any, to q (B, H, T, D)."""
    if kwargs.get("position_embeddings") is not None:  # Hugging Face: cos, sin of shape (B, T, D)
        cos, sin = (t.unsqueeze(1) for t in kwargs["position_embeddings"])
    elif kwargs.get("rope") is not None:  # ours: cos, sin of shape (T, D)
        cos, sin = kwargs["rope"]
    else:
        return q
    return (q * cos + rotate_half(q) * sin).to(q.dtype)


def apply_llama_adapter(model: nn.Module, targets: str | Iterable[str], n_layers: int, n_prompt: int = 10) -> list[str]:
    """Wrap the last ``n_layers`` attention modules matching ``targets``; freeze the rest.

    ``targets``: ``"self_attn"`` for Hugging Face Llama, ``"attn"`` for our models,
    ``"attention.self"`` for Hugging Face BERT.
    """
    ensure_not_applied(model, "llama_adapter")
    found = find_modules(model, targets)
    if not isinstance(n_layers, int) or not 0 < n_layers <= len(found):
        raise ValueError(f"n_layers must be between 1 and the {len(found)} attention modules found, got {n_layers!r}")
    dims = model_dims(model)
    for name, attention in found[-n_layers:]:
        wrapper = AdaptionPromptAttention(
            attention, n_prompt, dims["heads"], dims["kv_heads"], dims["head_dim"], dims["d_model"]
        )
        replace_module(model, name, wrapper)
    freeze_base(model)
    return [name for name, _ in found[-n_layers:]]
