"""Serving a model: the KV cache in pages, and many requests in one batch.

block_allocator   BlockAllocator: a free list and reference counts over KV blocks (vLLM sec. 4)
paged_attention   PagedKVCache (block tables, fork, copy-on-write), gather_kv, paged_attention,
                  paged_attention_blockwise (K/V read block by block through the table),
                  PagedBatch (lets an unmodified model decode with the paged cache)
ragged            decode_step: one forward pass for sequences of different lengths (a position per row)
batching          ContinuousBatcher: iteration-level scheduling of Requests over the paged cache
kv_waste          used / reserved / fragmented slots: paged blocks vs contiguous reservations
"""

from .batching import ContinuousBatcher, Request
from .block_allocator import BlockAllocator, OutOfBlocks
from .paged_attention import PagedBatch, PagedKVCache, gather_kv, paged_attention, paged_attention_blockwise
from .ragged import RaggedPagedBatch, decode_step

__all__ = [
    "BlockAllocator",
    "ContinuousBatcher",
    "OutOfBlocks",
    "PagedBatch",
    "PagedKVCache",
    "RaggedPagedBatch",
    "Request",
    "decode_step",
    "gather_kv",
    "paged_attention",
    "paged_attention_blockwise",
]
