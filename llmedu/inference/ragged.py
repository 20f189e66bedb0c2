"""One decoding step for sequences of different lengths in one forward pass: a position per row.

``Transformer.forward`` takes one position for the whole batch (it reads ``cache.first_position``), so a batch
of sequences of different lengths would need a pass per length. vLLM's model instead takes a position per
token and runs every running sequence in one pass (Kwon et al. 2023, sec. 4.5; ``positions`` in vLLM's model
inputs). ``decode_step`` does that with the model's own modules, one new token per sequence:

    embedding   the token, plus the position table's row of each sequence's own position (learned, sinusoidal)
    positions   RoPE tables per row, (B, 1, 1, D), or an ALiBi / relative bias per row, (B, H, 1, T_k)
    attention   each sequence's keys and values gathered through its block table to the longest context;
                the keys past a sequence's own length are masked out (an additive mask of -inf)
    head        the final norm and the output layer, as ``CausalLM.forward``

``RaggedPagedBatch`` is the cache the blocks see: ``update`` writes each row's keys at its own position.

Left out: prefill in the same pass (chunked prefill mixes both) and the blockwise kernel inside the model
(``update`` gathers a copy of the context per layer, as ``PagedBatch`` does).
"""

from __future__ import annotations

import torch

from ..nn.positions import rope_cos_sin
from .block_allocator import OutOfBlocks
from .paged_attention import PagedKVCache, gather_kv

__all__ = ["RaggedPagedBatch", "decode_step"]


class RaggedPagedBatch:
    """Sequences of any lengths, one new token each, seen by the model's blocks as their KV cache."""

    def __init__(self, cache: PagedKVCache, seqs: list[int]):
        if not seqs:
            raise ValueError("a decoding step needs at least one sequence")
        needed = sum(cache.blocks_needed(s, 1) for s in seqs)
        if needed > cache.allocator.num_free:  # check first, so that a failure leaves the cache as it was
            raise OutOfBlocks(f"{len(seqs)} sequences need {needed} more blocks, {cache.allocator.num_free} are free")
        self.cache, self.seqs = cache, list(seqs)
        self.past = [cache.lengths[s] for s in self.seqs]  # each sequence's own position for its new token
        for s in self.seqs:
            cache.reserve(s, 1)
        self.tables = cache.block_tables(self.seqs)  # (B, n_blocks), after any copy-on-write
        self.length = max(self.past)  # the widest past: every row's keys are gathered to length + 1

    @property
    def first_position(self) -> int:
        return self.length  # unused by decode_step, which reads ``past``: a position per row

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, 1, D), row b at its own position; return (B, H_kv, length + 1, D) each."""
        if k.shape[0] != len(self.seqs) or k.shape[2] != 1:
            raise ValueError(f"expected keys for {len(self.seqs)} sequences x 1 token, got {tuple(k.shape)}")
        for i, s in enumerate(self.seqs):
            self.cache.write(layer, s, self.past[i], k[i], v[i])
        total = self.length + 1
        return gather_kv(self.cache.k[layer], self.tables, total), gather_kv(self.cache.v[layer], self.tables, total)


def decode_step(model, cache: PagedKVCache, seqs: list[int], tokens: list[int]) -> torch.Tensor:
    """Append ``tokens[b]`` to sequence ``seqs[b]`` for every b in one forward pass of ``model`` (a ``CausalLM``);
    return the next-token logits, (B, vocab)."""
    if len(tokens) != len(seqs):
        raise ValueError(f"one token per sequence: got {len(tokens)} tokens for {len(seqs)} sequences")
    tr, c = model.transformer, model.config
    device = tr.tok_embed.weight.device
    batch = RaggedPagedBatch(cache, seqs)
    ids = torch.tensor(tokens, device=device)[:, None]  # (B, 1)
    pos = torch.tensor(batch.past, device=device)  # (B,): the position of each new token
    x = tr.tok_embed(ids)  # (B, 1, d)
    if tr.type_embed is not None:
        x = x + tr.type_embed(torch.zeros_like(ids))
    if tr.pos_embed is not None:
        x = x + tr.pos_embed(pos)[:, None]  # (B, 1, d): each row its own position's vector
    if tr.embed_norm is not None:
        x = tr.embed_norm(x)
    x = tr.drop(x)
    keys = torch.arange(batch.length + 1, device=device)  # (T_k,)
    mask = torch.zeros(len(seqs), 1, 1, len(keys), dtype=x.dtype, device=device)  # (B, 1, 1, T_k)
    if tr.pos_bias is not None:  # (1, H, 1, T_k) per row, from its own query position
        mask = torch.cat([tr.pos_bias(pos[b : b + 1], keys).to(x.dtype) for b in range(len(seqs))])
    mask = mask.masked_fill((keys[None, :] > pos[:, None])[:, None, None], torch.finfo(x.dtype).min)
    rope = None
    if c.position == "rope":
        cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_base)  # (B, D) each
        rope = cos[:, None, None], sin[:, None, None]  # (B, 1, 1, D): row b turned by its own position
    for i, block in enumerate(tr.blocks):
        x = block(x, causal=c.causal, attn_mask=mask, rope=rope, cache=batch, layer=i)  # (B, 1, d)
    return model.lm_head(tr.apply_final_norm(x))[:, -1]  # (B, vocab)
