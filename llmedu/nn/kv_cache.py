"""The KV cache: what attention asks of one, and the plain contiguous cache that decoding uses.

A decoder that generates one token at a time keeps every layer's keys and values of the tokens seen
so far, and each forward pass processes only the new tokens. The model does not care how the past
is stored; it asks three things of a cache, written down as the protocol ``KVCacheLike``:

    length          int: tokens already in the cache (T_past) when a forward pass begins
    first_position  int: the position of the first new token (usually ``length``)
    update(layer, k, v) -> (k_all, v_all)
                    store the new keys and values of ``layer``, k, v (B, H_kv, T_new, D), and return
                    all keys and values attention should see, each (B, H_kv, T_past + T_new, D)

``Transformer.forward`` reads ``length`` and ``first_position`` once, before the first layer (the
new tokens' positions, the width of the attention mask), and ``Attention.forward`` calls ``update``
once per layer, layer 0 first. Three classes implement the protocol:

    KVCache       (here) one contiguous tensor per keys and values, allocated for ``max_len`` tokens
    PagedBatch    (llmedu.inference.paged_attention) a batch of sequences of a paged cache (lesson 18)
    PrefixCache   (llmedu.peft.prompt) a learned prefix; ``first_position`` is 0 or P (lesson 19)

``first_position`` differs from ``length`` only for a past that is not text: a learned prefix may
keep the real tokens at positions 0..T-1. A ``typing.Protocol`` is structural: a class implements
it by having the members, without inheriting from it. ``@runtime_checkable`` lets ``isinstance``
check that the members are there (not their types or what they compute).

Left out: caches that evict tokens (sliding windows, attention sinks) and quantised caches.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["KVCacheLike", "KVCache"]


@runtime_checkable
class KVCacheLike(Protocol):
    """What the model asks of a KV cache (see the module docstring)."""

    @property
    def length(self) -> int:
        """Tokens already cached, T_past."""
        ...

    @property
    def first_position(self) -> int:
        """The position of the first new token."""
        ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take k, v (B, H_kv, T_new, D) of ``layer``; return all keys and values (B, H_kv, T_past + T_new, D)."""
        ...


class KVCache:
    """The keys and values of the tokens seen so far, for every layer; allocated once for ``max_len``.

    During decoding each step appends one token's keys/values per layer, so attention costs
    O(T) per new token instead of recomputing the whole prefix.
    """

    def __init__(
        self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, max_len: int, device=None, dtype=torch.float32
    ):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.lengths = [0] * n_layers  # tokens stored per layer

    @property
    def length(self) -> int:
        """Tokens that every layer holds (the position of the next token)."""
        return min(self.lengths)

    @property
    def first_position(self) -> int:
        """The new tokens follow the cached ones: their first position is ``length``."""
        return self.length

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, H_kv, T, D) to ``layer``; return all keys and values so far (B, H_kv, T_all, D)."""
        start = self.lengths[layer]
        end = start + k.shape[2]
        if k.shape[:2] != self.k.shape[1:3] or k.shape[-1] != self.k.shape[-1]:
            raise ValueError(f"keys of shape {tuple(k.shape)} do not fit a cache of shape {tuple(self.k.shape[1:])}")
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens; {end} would not fit")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        self.lengths[layer] = end
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]
