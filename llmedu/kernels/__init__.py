"""Attention kernels written out tile by tile, so that what a fused GPU kernel does can be read.

    flash_attention   FlashAttention-2 (Dao 2023): tiled forward with an online softmax, a backward
                      that recomputes the probabilities from the saved logsumexp; O(T) memory
    traffic           the bytes a kernel moves between HBM and on-chip memory, counted as it runs
                      (FlashAttention, Section 3.2), and standard attention with the same count

Importing this package registers ``"flash"`` as an attention function of ``llmedu.nn.attention``,
so any model of the course can use it: ``TransformerConfig(attn_impl="flash")``.
"""

from ..nn.attention import ATTENTION_FUNCTIONS, register_attention
from .flash_attention import DEFAULT_BLOCK_SIZE, FlashAttentionFunction, flash_attention

__all__ = ["flash_attention", "FlashAttentionFunction", "DEFAULT_BLOCK_SIZE"]


def _flash(q, k, v, causal, attn_mask):
    """The registry's signature: fn(q, k, v, causal, attn_mask) -> out."""
    return flash_attention(q, k, v, causal=causal, attn_mask=attn_mask)


if "flash" not in ATTENTION_FUNCTIONS:  # importlib.reload must not register it twice
    register_attention("flash", _flash)
