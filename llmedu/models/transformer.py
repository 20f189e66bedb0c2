"""The one transformer stack of the course: embeddings, N blocks, a final norm.

Everything that varies is read from ``TransformerConfig``:

    ids (B, T) -> token embeddings [+ absolute positions] [+ segments] [-> norm]      (B, T, d)
               -> blocks: attention (with RoPE, or ALiBi / T5 bias in the mask) + FFN  (B, T, d)
               -> final norm (pre-LN and sandwich stacks)                              (B, T, d)

It returns hidden states; the heads in ``gpt.py`` and ``bert.py`` turn them into logits. ``forward``
is these steps, one method each around the loop over the blocks: ``embed``, ``attention_inputs`` (the
mask and the RoPE tables that every block reads) and ``apply_final_norm``. Pipeline stages
(``llmedu.parallel.pipeline_parallel``) call the same methods, so a new position encoding, once
written in ``nn/positions.py``, is wired in here only.

With a KV cache (any ``llmedu.nn.kv_cache.KVCacheLike``) it processes only the new tokens and reads
the past from the cache, which is how ``generate`` decodes.

Initialisation follows GPT-2: N(0, 0.02), with the projections that write into the residual stream
scaled by 1/sqrt(2 * n_layers) (Radford et al. 2019, sec. 2.3); DeepNorm stacks use DeepNet's
initialisation instead.

With ``config.moe`` set, every block's FFN is a mixture of experts (``llmedu.nn.moe.MoEFeedForward``):
the block still adds ``self.mlp(h)``, and ``moe_loss()`` collects the layers' auxiliary losses of the
last forward pass for the training loss: ``lm_loss(...) + model.transformer.moe_loss()``.

Left out: encoder-decoder models, and the position handling of left-padded batches during decoding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..nn.attention import padding_bias
from ..nn.blocks import ParallelBlock, SerialBlock
from ..nn.kv_cache import KVCache, KVCacheLike
from ..nn.moe import MoEFeedForward, MoEStats
from ..nn.norms import deepnorm_constants, deepnorm_init_, make_norm
from ..nn.positions import (
    ALiBi,
    LearnedPositions,
    RelativePositionBias,
    ScaledSinusoidalPositions,
    SinusoidalPositions,
    rope_cos_sin,
)
from .config import TransformerConfig

__all__ = ["Transformer", "make_block"]


def make_block(config: TransformerConfig) -> nn.Module:
    """One block of the stack ``config`` describes (DeepNorm's alpha only where the norms are DeepNorm's)."""
    block = ParallelBlock if config.block == "parallel" else SerialBlock
    deepnorm = config.norm_placement == "deepnorm"
    made = block(
        d_model=config.d_model,
        n_heads=config.n_heads,
        d_ff=config.d_ff,
        n_kv_heads=config.n_kv_heads,
        activation=config.activation,
        norm=config.norm,
        norm_eps=config.norm_eps,
        placement=config.norm_placement,
        bias=config.bias,
        attn_impl=config.attn_impl,
        dropout=config.dropout,
        deepnorm_alpha=deepnorm_constants(config.n_layers)[0] if deepnorm else 1.0,
        fused=config.fused,
    )
    if config.moe is not None:  # the mixture of experts takes the FFN's place
        m = config.moe
        made.mlp = MoEFeedForward(
            config.d_model,
            config.d_ff,
            m.n_experts,
            m.top_k,
            m.capacity_factor,
            config.activation,
            config.bias,
            m.renormalize,
            config.fused,
        )
    return made


class Transformer(nn.Module):
    """input_ids (B, T) -> hidden states (B, T, d_model)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = c = config
        self.tok_embed = nn.Embedding(c.vocab_size, c.d_model)
        self.type_embed = nn.Embedding(c.type_vocab_size, c.d_model) if c.type_vocab_size else None
        self.pos_embed = {
            "learned": lambda: LearnedPositions(c.max_seq_len, c.d_model),
            "sinusoidal": lambda: SinusoidalPositions(c.d_model),
            "scaled_sinusoidal": lambda: ScaledSinusoidalPositions(c.d_model),
        }.get(c.position, lambda: None)()
        self.pos_bias = {
            "alibi": lambda: ALiBi(c.n_heads),
            "relative": lambda: RelativePositionBias(
                c.n_heads, c.relative_buckets, c.relative_max_distance, bidirectional=not c.causal
            ),
        }.get(c.position, lambda: None)()
        self.embed_norm = make_norm(c.norm, c.d_model, c.norm_eps, c.bias, c.fused) if c.embedding_norm else None
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(make_block(c) for _ in range(c.n_layers))
        final = c.norm_placement in ("pre", "sandwich")  # post-LN stacks end normalised already
        self.final_norm = make_norm(c.norm, c.d_model, c.norm_eps, c.bias, c.fused) if final else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        c = self.config
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=c.init_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.Embedding, LearnedPositions, RelativePositionBias)):
                nn.init.normal_(module.weight, std=c.init_std)
        for block in self.blocks:
            if c.norm_placement == "deepnorm":
                deepnorm_init_(block, beta=deepnorm_constants(c.n_layers)[1])
            else:  # the projections that add into the residual stream (each expert's, in an MoE)
                downs = [e.down_proj for e in block.mlp.experts] if c.moe is not None else [block.mlp.down_proj]
                for proj in (block.attn.o_proj, *downs):
                    nn.init.normal_(proj.weight, std=c.init_std / math.sqrt(2 * c.n_layers))

    def moe_stats(self) -> list[MoEStats]:
        """Each MoE layer's ``MoEStats`` of the last forward pass (routing, drops, losses); [] if dense."""
        return [b.mlp.stats for b in self.blocks if isinstance(b.mlp, MoEFeedForward) and b.mlp.stats is not None]

    def moe_loss(self) -> torch.Tensor:
        """``aux_loss_coef * aux + z_loss_coef * z`` summed over the MoE layers (last forward); 0 if dense."""
        m, total = self.config.moe, torch.zeros((), device=self.tok_embed.weight.device)
        for stats in self.moe_stats():
            total = total + m.aux_loss_coef * stats.aux_loss + m.z_loss_coef * stats.z_loss
        return total

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        """An empty KV cache for this model (on its device, in its dtype)."""
        c, weight = self.config, self.tok_embed.weight
        return KVCache(
            c.n_layers, batch, c.n_kv_heads, c.head_dim, max_len or c.max_seq_len, weight.device, weight.dtype
        )

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding table (the name ``transformers`` uses, so PEFT code finds it)."""
        return self.tok_embed

    def embed(
        self,
        input_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        first_position: int = 0,
    ) -> torch.Tensor:
        """Token ids (B, T), or their embeddings (B, T, d), -> the first block's input (B, T, d).

        Adds the segment embeddings and the absolute positions ``first_position .. first_position + T - 1``
        (where the config has them), then the embedding norm and dropout.
        """
        c = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            if input_ids.dim() != 2 or input_ids.dtype != torch.long:
                raise ValueError(
                    f"input_ids must be a (batch, seq) tensor of int64, got {input_ids.dtype} {tuple(input_ids.shape)}"
                )
            low, high = (input_ids.min().item(), input_ids.max().item()) if input_ids.numel() else (0, 0)
            if low < 0 or high >= c.vocab_size:  # an embedding lookup would fail with an index error
                bad = low if low < 0 else high
                raise ValueError(
                    f"token id {bad} is outside the vocabulary of {c.vocab_size} (ids 0..{c.vocab_size - 1})"
                )
            x = self.tok_embed(input_ids)  # (B, T, d)
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != c.d_model:
                raise ValueError(f"inputs_embeds must be (batch, seq, {c.d_model}), got {tuple(inputs_embeds.shape)}")
            own = self.tok_embed.weight.dtype
            if inputs_embeds.dtype != own and not torch.is_autocast_enabled(inputs_embeds.device.type):
                raise TypeError(  # else the first matmul fails deep inside a block, or the model silently runs wider
                    f"inputs_embeds are {inputs_embeds.dtype} but the model's weights are {own}: "
                    f"pass inputs_embeds.to({own}), or run under torch.autocast"
                )
            x = inputs_embeds
        B, T = x.shape[:2]
        if self.type_embed is not None:
            types = (
                token_type_ids if token_type_ids is not None else torch.zeros(B, T, dtype=torch.long, device=x.device)
            )
            low, high = (types.min().item(), types.max().item()) if types.numel() else (0, 0)
            if low < 0 or high >= c.type_vocab_size:  # a lookup would fail with an index error (a CUDA assert)
                raise ValueError(
                    f"token_type_ids holds {low if low < 0 else high}, outside the {c.type_vocab_size} segment types "
                    f"(ids 0..{c.type_vocab_size - 1})"
                )
            x = x + self.type_embed(types)
        if self.pos_embed is not None:
            positions = torch.arange(first_position, first_position + T, device=x.device)  # (T,)
            x = x + self.pos_embed(positions)  # (T, d) broadcast over the batch
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return self.drop(x)

    def attention_inputs(
        self, x: torch.Tensor, first_position: int = 0, past: int = 0, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """What every block's attention needs besides its input x (B, T, d): ``(attn_mask, rope)``.

        x gives only the batch, length, device and dtype. The new tokens sit at positions
        ``first_position .. first_position + T - 1`` and follow ``past`` cached ones. ``attn_mask`` is
        additive, broadcastable to (B, H, T, past + T): the relative or ALiBi bias and the padding of
        ``attention_mask`` (B, past + T), or None. ``rope`` is the rotary (cos, sin) tables, each
        (T, D), or None.
        """
        c = self.config
        B, T = x.shape[:2]
        positions = torch.arange(first_position, first_position + T, device=x.device)  # (T,)
        mask = None
        if self.pos_bias is not None:
            keys = torch.arange(first_position - past, first_position + T, device=x.device)  # (Tk,): cached, then new
            mask = self.pos_bias(positions, keys).to(x.dtype)  # (1, H, T, Tk)
        if attention_mask is not None:
            if attention_mask.shape != (B, past + T):
                raise ValueError(
                    f"attention_mask must have shape {(B, past + T)} (batch, past + new tokens), "
                    f"got {tuple(attention_mask.shape)}"
                )
            pad = padding_bias(attention_mask, x.dtype)  # (B, 1, 1, Tk)
            mask = pad if mask is None else mask.masked_fill(pad < 0, torch.finfo(x.dtype).min)
        rope = rope_cos_sin(positions, c.head_dim, c.rope_base) if c.position == "rope" else None
        return mask, rope

    def apply_final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, d): the final norm of pre-LN and sandwich stacks; post-LN stacks end normalised."""
        return self.final_norm(x) if self.final_norm is not None else x

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        cache: KVCacheLike | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``attention_mask`` (B, T_past + T): 1 for tokens, 0 for padding. Returns (B, T, d).

        ``inputs_embeds`` (B, T, d) replaces ``input_ids`` when the token embeddings are made
        elsewhere (prompt tuning prepends trainable ones); positions are added as usual.
        """
        past = cache.length if cache is not None else 0
        # the new tokens' positions follow what the cache holds, unless the cache says otherwise (a
        # learned prefix need not count as text: llmedu.peft.PrefixTuning(shift_positions=False))
        first = cache.first_position if cache is not None else 0
        x = self.embed(input_ids, token_type_ids, inputs_embeds, first)  # (B, T, d)
        mask, rope = self.attention_inputs(x, first, past, attention_mask)
        for i, block in enumerate(self.blocks):
            x = block(x, causal=self.config.causal, attn_mask=mask, rope=rope, cache=cache, layer=i)  # (B, T, d)
        return self.apply_final_norm(x)
