"""Prompt tuning and prefix tuning: learn what the frozen model reads, not how it computes.

Prompt tuning (Lester et al. 2021, "The Power of Scale for Parameter-Efficient Prompt Tuning"):
P trainable vectors are put in front of the token embeddings, as if the input began with P
"virtual tokens" whose embeddings are free parameters:

    x = [p_1 ... p_P ; E(w_1) ... E(w_T)]          (B, P + T, d)      P * d parameters

Prefix tuning (Li & Liang 2021; as "deep prompt tuning" in P-tuning v2, Liu et al. 2022): every
layer gets P trainable keys and values that every real token can attend to. The prefix is
exactly a KV cache that was learned instead of computed, so it enters the model the way a cache
does (``past_key_values`` in ``transformers``, ``cache=`` in ours):

    attention_l(q, [K_l^prefix ; K_l], [V_l^prefix ; V_l])    P * L * 2 * H_kv * D parameters

Li & Liang found training the prefix directly unstable and trained it through an MLP
(``projection=hidden``): prefix = W_2 tanh(W_1 e + b_1) + b_2 from a (P, d) embedding e; after
training only the resulting prefix needs to be kept. (Its input embedding is H_kv * D wide,
which is d without grouped queries; ``peft`` does the same.) Both wrappers extend the attention mask by
P ones. In prompt tuning the prompts are tokens: they take positions 0..P-1 and the real tokens
P..P+T-1. In prefix tuning the prefix is a past, and ``peft`` (through ``transformers``' cache) also moves
the real tokens to positions P..P+T-1; that is ``shift_positions=True``, the default.
``shift_positions=False`` keeps them at 0..T-1. A model with learned absolute positions never saw [CLS] at
position P in pretraining, though P-tuning v2 trained BERT prefixes with the shift; lesson 19's study
trains both.

Left out: prompt initialisation from a text, multi-task prompts, encoder-decoder models.
"""

from __future__ import annotations

import torch
from torch import nn

from .inject import ensure_not_applied, freeze_base, model_dims

__all__ = ["PromptTuning", "PrefixTuning", "PrefixCache"]


def _extend_mask(attention_mask: torch.Tensor | None, batch: int, n: int, device) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    ones = torch.ones(batch, n, dtype=attention_mask.dtype, device=device)
    return torch.cat([ones, attention_mask], dim=1)  # (B, P + T): the virtual tokens are never padding


class PromptTuning(nn.Module):
    """``model`` with ``n_virtual`` trainable input embeddings in front of every sequence.

    ``model`` must accept ``inputs_embeds`` (every ``transformers`` model does). ``init``:
    ``"vocab"`` copies the embeddings of random vocabulary tokens (Lester et al.'s better start),
    ``"random"`` draws N(0, 1) (``peft``'s default).
    """

    peft_method = "prompt"

    def __init__(self, model: nn.Module, n_virtual: int = 20, init: str = "vocab"):
        super().__init__()
        ensure_not_applied(model, "prompt")
        if not isinstance(n_virtual, int) or n_virtual <= 0:
            raise ValueError(f"n_virtual must be a positive int, got {n_virtual!r}")
        if not hasattr(model, "get_input_embeddings"):
            raise TypeError(
                f"{type(model).__name__} does not take input embeddings (no get_input_embeddings()); "
                "prompt tuning needs a model that accepts inputs_embeds"
            )
        table = model.get_input_embeddings().weight  # (V, d)
        if init == "vocab":
            rows = torch.randint(0, table.shape[0], (n_virtual,), device=table.device)
            start = table.detach()[rows].clone()
        elif init == "random":
            start = torch.randn(n_virtual, table.shape[1], device=table.device, dtype=table.dtype)
        else:
            raise ValueError(f"init must be 'vocab' or 'random', got {init!r}")
        self.base = model
        self.prompt = nn.Parameter(start)  # (P, d)
        self.enabled = True
        freeze_base(self)

    def forward(self, input_ids: torch.Tensor, attention_mask=None, token_type_ids=None, labels=None, **kwargs):
        if not self.enabled:
            optional = {"token_type_ids": token_type_ids, "labels": labels}
            kwargs.update({k: v for k, v in optional.items() if v is not None})
            return self.base(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        B, P = input_ids.shape[0], self.prompt.shape[0]
        embeds = self.base.get_input_embeddings()(input_ids)  # (B, T, d)
        embeds = torch.cat([self.prompt.expand(B, -1, -1).to(embeds.dtype), embeds], dim=1)  # (B, P + T, d)
        if token_type_ids is not None:  # the virtual tokens belong to the first segment
            kwargs["token_type_ids"] = torch.cat([token_type_ids.new_zeros(B, P), token_type_ids], dim=1)
        if labels is not None:  # token labels (language modelling) get -100, "nothing to predict", at a prompt
            kwargs["labels"] = (
                torch.cat([labels.new_full((B, P), -100), labels], dim=1) if labels.dim() == 2 else labels
            )
        mask = _extend_mask(attention_mask, B, P, input_ids.device)
        return self.base(inputs_embeds=embeds, attention_mask=mask, **kwargs)


class PrefixCache:
    """A learned prefix that our model reads as its KV cache (it implements ``llmedu.nn.kv_cache.KVCacheLike``).

    ``update`` returns the prefix followed by the new keys/values and stores nothing, so the
    prefix stays a leaf of autograd and each forward starts from it again. ``first_position`` is
    where the real tokens' positions start: P (after the prefix, as ``peft``) or 0.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, shift_positions: bool = True):
        self.keys, self.values = keys, values  # (L, B, H_kv, P, D) each
        self.shift_positions = shift_positions

    @property
    def length(self) -> int:
        """P: the prefix's tokens."""
        return self.keys.shape[3]

    @property
    def first_position(self) -> int:
        """P when the real tokens follow the prefix (``shift_positions``), else 0."""
        return self.length if self.shift_positions else 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, H_kv, T, D) -> the prefix, then k and v: (B, H_kv, P + T, D) each. Stores nothing."""
        return torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)  # (B, H_kv, P + T, D)


class PrefixTuning(nn.Module):
    """``model`` with ``n_virtual`` trainable keys and values in front of every layer's attention.

    ``projection``: ``None`` trains the prefix directly; an int trains it through Li & Liang's
    MLP with that hidden size. ``shift_positions``: the real tokens sit after the prefix (P..P+T-1,
    ``peft``'s behaviour) or keep positions 0..T-1 (see the module docstring).
    """

    peft_method = "prefix"

    def __init__(
        self, model: nn.Module, n_virtual: int = 20, projection: int | None = None, shift_positions: bool = True
    ):
        super().__init__()
        ensure_not_applied(model, "prefix")
        if not isinstance(n_virtual, int) or n_virtual <= 0:
            raise ValueError(f"n_virtual must be a positive int, got {n_virtual!r}")
        dims = model_dims(model)
        self.base = model
        self.n_virtual, self.dims, self.shift_positions = n_virtual, dims, shift_positions
        width = dims["layers"] * 2 * dims["kv_heads"] * dims["head_dim"]  # one layer's K and V, all layers
        device = next(model.parameters()).device
        if projection is None:
            self.prefix = nn.Parameter(torch.randn(n_virtual, width, device=device))  # (P, L * 2 * H_kv * D)
            self.mlp = None
        else:
            if not isinstance(projection, int) or projection <= 0:
                raise ValueError(f"projection must be None or a positive hidden size, got {projection!r}")
            kv_width = dims["kv_heads"] * dims["head_dim"]  # one layer's keys: d, or less with grouped queries
            self.prefix = nn.Parameter(torch.randn(n_virtual, kv_width, device=device))  # (P, H_kv * D)
            self.mlp = nn.Sequential(nn.Linear(kv_width, projection), nn.Tanh(), nn.Linear(projection, width)).to(
                device
            )
        self.enabled = True
        freeze_base(self)

    def key_values(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix as keys and values, each (L, B, H_kv, P, D)."""
        d = self.dims
        flat = self.prefix if self.mlp is None else self.mlp(self.prefix)  # (P, L * 2 * H_kv * D)
        kv = flat.view(self.n_virtual, 2 * d["layers"], d["kv_heads"], d["head_dim"])  # (P, 2L, H_kv, D)
        kv = kv.permute(1, 2, 0, 3).unsqueeze(1).expand(-1, batch, -1, -1, -1)  # (2L, B, H_kv, P, D)
        return kv[0::2], kv[1::2]  # layer l: keys at row 2l, values at 2l + 1 (peft's layout)

    def forward(self, input_ids: torch.Tensor, attention_mask=None, **kwargs):
        if not self.enabled:
            return self.base(input_ids, attention_mask=attention_mask, **kwargs)
        B = input_ids.shape[0]
        keys, values = self.key_values(B)
        dtype = next(self.base.parameters()).dtype
        keys, values = keys.to(dtype), values.to(dtype)
        mask = _extend_mask(attention_mask, B, self.n_virtual, input_ids.device)
        if hasattr(self.base.config, "n_layers"):  # ours: a cache object that attention calls update() on
            cache = PrefixCache(keys, values, self.shift_positions)
            return self.base(input_ids, attention_mask=mask, cache=cache, **kwargs)
        from transformers import DynamicCache

        cache = DynamicCache([(keys[layer], values[layer]) for layer in range(keys.shape[0])])
        if not self.shift_positions:  # transformers would number the tokens from the cache's length
            kwargs["position_ids"] = torch.arange(input_ids.shape[1], device=input_ids.device).expand(B, -1)  # (B, T)
        return self.base(input_ids=input_ids, attention_mask=mask, past_key_values=cache, **kwargs)
