"""PagedAttention (Kwon et al. 2023): a KV cache in fixed-size blocks, reached through block tables.

A contiguous KV cache reserves ``max_len`` slots per sequence up front. Most of them are never used
(a reply stops long before the limit) or not used yet, and the free memory between reservations is
fragmented. vLLM instead stores keys and values in a pool of blocks of ``block_size`` tokens:

    key pool    (layers, num_blocks, H_kv, block_size, D)       the same for values
    block table sequence -> [physical block of tokens 0..S-1, of tokens S..2S-1, ...]

Token t of a sequence lives in block ``table[t // S]`` at offset ``t % S``. A sequence takes a new
block only when its last one is full, so at most S - 1 slots per sequence are wasted.

Reading K and V through the table, two ways:

* ``paged_attention_blockwise`` reads K/V block by block through the table, as vLLM's kernel does
  (sec. 4.1): one block per sequence at a time, as a GPU kernel loads a block into on-chip memory. Ours
  folds each block into the output with the online softmax of FlashAttention (lesson 17); vLLM's
  paged_attention_v1 instead keeps the sequence's scores in shared memory, takes their max and sum, and
  makes a second pass over the value blocks. Either way the whole context is never assembled in one tensor.
* ``gather_kv`` copies a batch's blocks into one contiguous (B, H_kv, T, D) tensor, and ``paged_attention``
  runs SDPA on that copy (``enable_gqa``: the K/V heads are not repeated). ``PagedBatch.update`` gathers for
  every layer at every step, because our model's attention takes contiguous K and V from its cache: a copy
  of the whole context per layer and step, the traffic vLLM's kernel avoids. It is the simple oracle.

Sharing: ``fork(parent, child)`` gives the child the parent's table and one more reference to each
block, so n samples of one prompt store the prompt once. Copy-on-write: before a sequence appends
to a last block that others share, it gets a private copy of that block (sec. 4.4, Fig. 8).

``PagedKVCache.attend`` runs the blockwise attention over the cache, through its own tables or a
hand-built one that it checks first (a block not the sequence's own is an error, not zeros).

``PagedBatch`` lets an unmodified model decode with this cache: it has the members the model asks of
a cache (``llmedu.nn.kv_cache.KVCacheLike``): ``length``, ``first_position`` and ``update(layer, k, v)``.

Left out: the CUDA kernel, swapping blocks to CPU memory, and prefix caching across requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .block_allocator import BlockAllocator, OutOfBlocks

__all__ = ["PagedKVCache", "PagedBatch", "gather_kv", "paged_attention", "paged_attention_blockwise"]


def gather_kv(pool: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Keys (or values) of a batch of sequences, read through their block tables.

    pool (num_blocks, H_kv, S, D); block_tables (B, n_blocks) of block numbers -> (B, H_kv, length, D).
    Block numbers outside 0 .. num_blocks - 1 are an error (indexing would wrap -1 to the last block).
    Which sequence owns which block is the cache's to check (``PagedKVCache.block_tables``).
    """
    B, n_blocks = block_tables.shape
    num_blocks, n_kv, S, D = pool.shape
    if length > n_blocks * S:
        raise ValueError(f"{length} tokens do not fit in {n_blocks} blocks of {S}")
    if block_tables.numel() and (int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks):
        bad = int(block_tables.min()) if int(block_tables.min()) < 0 else int(block_tables.max())
        raise ValueError(f"block table names block {bad}; the pool has blocks 0 .. {num_blocks - 1}")
    blocks = pool[block_tables]  # (B, n_blocks, H_kv, S, D)
    return blocks.transpose(1, 2).reshape(B, n_kv, n_blocks * S, D)[:, :, :length]  # (B, H_kv, length, D)


def _check_paged_args(q, key_pool, value_pool, block_tables, context_lens) -> None:
    B, H, Tq, D = q.shape
    if key_pool.shape != value_pool.shape or key_pool.dim() != 4 or key_pool.shape[-1] != D:
        raise ValueError(f"pools {tuple(key_pool.shape)}, {tuple(value_pool.shape)} do not hold heads of dim {D}")
    if H % key_pool.shape[1]:
        raise ValueError(f"{key_pool.shape[1]} key/value heads do not divide {H} query heads")
    if block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(
            f"need one block table and one length per sequence: {B} queries, tables {tuple(block_tables.shape)}, lengths {tuple(context_lens.shape)}"
        )
    if int(context_lens.min()) < Tq:
        raise ValueError(f"every context must hold the {Tq} query tokens, got lengths {context_lens.tolist()}")
    if int(context_lens.max()) > block_tables.shape[1] * key_pool.shape[2]:
        raise ValueError(
            f"a context of {int(context_lens.max())} tokens does not fit in {block_tables.shape[1]} blocks of {key_pool.shape[2]}"
        )
    if block_tables.numel() and (int(block_tables.min()) < 0 or int(block_tables.max()) >= key_pool.shape[0]):
        bad = int(block_tables.min()) if int(block_tables.min()) < 0 else int(block_tables.max())
        raise ValueError(f"block table names block {bad}; the pool has blocks 0 .. {key_pool.shape[0] - 1}")


def paged_attention(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of the last Tq tokens of each sequence over its own cached context.

    q (B, H, Tq, D); pools (num_blocks, H_kv, S, D); block_tables (B, n_blocks) long, padded with any
    valid block number; context_lens (B,): tokens in each sequence, the Tq new ones included.
    Sequence b's query i sits at position context_lens[b] - Tq + i and sees keys 0 .. that position.
    """
    B, H, Tq, D = q.shape
    _check_paged_args(q, key_pool, value_pool, block_tables, context_lens)
    T = int(context_lens.max())
    k, v = gather_kv(key_pool, block_tables, T), gather_kv(value_pool, block_tables, T)  # (B, H_kv, T, D) each
    position = context_lens[:, None] - Tq + torch.arange(Tq, device=q.device)  # (B, Tq) of each query
    visible = torch.arange(T, device=q.device)[None, None, :] <= position[:, :, None]  # (B, Tq, T)
    # enable_gqa: query head h reads K/V head h // (H / H_kv) in place; K and V are not repeated H / H_kv times
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], enable_gqa=True)  # (B, H, Tq, D)


def paged_attention_blockwise(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """``paged_attention``, reading K and V one block at a time through the tables, in place.

    Step j reads block ``block_tables[b, j]`` of every sequence b (B blocks of (H_kv, S, D)) and folds
    it into a running (max m, sum l, unnormalised output o) per query: the online softmax
    (Milakov & Gimelshein 2018; FlashAttention-2, Alg. 1). vLLM's kernel reads the same blocks, with one
    thread block per (sequence, head), but in two passes (scores, then values); here each step serves the
    whole batch. Arguments as in
    ``paged_attention``; blocks past a sequence's length (table padding) are fully masked.
    """
    B, H, Tq, D = q.shape
    _check_paged_args(q, key_pool, value_pool, block_tables, context_lens)
    n_kv, S = key_pool.shape[1], key_pool.shape[2]
    G, wide = H // n_kv, torch.promote_types(q.dtype, torch.float32)
    qg = q.view(B, n_kv, G, Tq, D).to(wide) * D**-0.5  # query heads grouped by the K/V head they share
    position = context_lens[:, None] - Tq + torch.arange(Tq, device=q.device)  # (B, Tq) of each query
    m = torch.full((B, n_kv, G, Tq), -torch.inf, dtype=wide, device=q.device)  # running max of the scores
    l = torch.zeros_like(m)  # running sum of exp(score - m)
    o = torch.zeros(B, n_kv, G, Tq, D, dtype=wide, device=q.device)  # running sum of exp(score - m) v
    for j in range(-(-int(context_lens.max()) // S)):
        k = key_pool[block_tables[:, j]].to(wide)  # (B, H_kv, S, D): block j of every sequence, via its table
        v = value_pool[block_tables[:, j]].to(wide)
        s = torch.einsum("bkgqd,bksd->bkgqs", qg, k)  # (B, H_kv, G, Tq, S)
        visible = j * S + torch.arange(S, device=q.device)[None, None, :] <= position[:, :, None]  # (B, Tq, S)
        s = s.masked_fill(~visible[:, None, None], -torch.inf)
        m_new = torch.maximum(m, s.amax(-1))  # finite from block 0 on: every query sees position 0
        p = torch.exp(s - m_new[..., None])  # (B, H_kv, G, Tq, S); 0 where masked
        rescale = torch.exp(m - m_new)  # (B, H_kv, G, Tq); 0 at j = 0, where m = -inf
        l = rescale * l + p.sum(-1)
        o = rescale[..., None] * o + torch.einsum("bkgqs,bksd->bkgqd", p, v)
        m = m_new
    return (o / l[..., None]).to(q.dtype).view(B, H, Tq, D)  # (B, H, Tq, D)


class PagedKVCache:
    """A pool of KV blocks for every layer, and the block table and length of every sequence."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        device=None,
        dtype=torch.float32,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        shape = (n_layers, num_blocks, n_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (L, N, H_kv, S, D)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict[int, list[int]] = {}  # sequence id -> physical blocks, in token order
        self.lengths: dict[int, int] = {}  # sequence id -> tokens stored
        self.filled = [0] * num_blocks  # tokens written in each physical block (for the waste figures)

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int = 16, device=None, dtype=torch.float32) -> PagedKVCache:
        """A cache shaped for a ``TransformerConfig``."""
        return cls(config.n_layers, config.n_kv_heads, config.head_dim, num_blocks, block_size, device, dtype)

    # -- sequences -------------------------------------------------------------------------------
    def add(self, seq: int) -> None:
        if seq in self.tables:
            raise ValueError(f"sequence {seq} is already in the cache")
        self.tables[seq], self.lengths[seq] = [], 0

    def fork(self, parent: int, child: int) -> None:
        """``child`` starts as a copy of ``parent`` that shares every block (no bytes are copied)."""
        self._known(parent)
        self.add(child)
        self.tables[child] = [self.allocator.share(b) for b in self.tables[parent]]
        self.lengths[child] = self.lengths[parent]

    def free(self, seq: int) -> None:
        """Drop a finished (or preempted) sequence; blocks nobody else holds return to the free list."""
        self._known(seq)
        for block in self.tables.pop(seq):
            self.allocator.free(block)
            if self.allocator.ref_counts[block] == 0:
                self.filled[block] = 0
        del self.lengths[seq]

    def _known(self, seq: int) -> None:
        if seq not in self.tables:
            raise KeyError(f"sequence {seq} is not in the cache")

    def blocks_needed(self, seq: int, n_new: int) -> int:
        """Fresh blocks that ``reserve(seq, n_new)`` would take (a copy-on-write counts as one)."""
        self._known(seq)
        length, table, S = self.lengths[seq], self.tables[seq], self.block_size
        fresh = -(-(length + n_new) // S) - len(table)
        cow = length % S != 0 and self.allocator.ref_counts[table[-1]] > 1
        return fresh + int(cow)

    def reserve(self, seq: int, n_new: int) -> int:
        """Make room for ``n_new`` more tokens of ``seq`` and count them; return the old length.

        A shared, partly filled last block is copied first (copy-on-write); then blocks are added.
        Raises ``OutOfBlocks`` (with the cache unchanged) if the pool cannot hold them.
        """
        self._known(seq)
        needed = self.blocks_needed(seq, n_new)
        if needed > self.allocator.num_free:
            raise OutOfBlocks(
                f"sequence {seq} needs {needed} more blocks for {n_new} tokens, {self.allocator.num_free} are free"
            )
        table, length = self.tables[seq], self.lengths[seq]
        if length % self.block_size and self.allocator.is_shared(table[-1]):
            table[-1] = self._copy_on_write(table[-1])
        while len(table) * self.block_size < length + n_new:
            table.append(self.allocator.allocate())
        self.lengths[seq] = length + n_new
        return length

    def _copy_on_write(self, block: int) -> int:
        """A private copy of a shared block, for the sequence about to write into it."""
        private = self.allocator.allocate()
        self.k[:, private] = self.k[:, block]  # every layer: (L, H_kv, S, D)
        self.v[:, private] = self.v[:, block]
        self.filled[private] = self.filled[block]
        self.allocator.free(block)  # one holder fewer of the shared original
        return private

    def write(self, layer: int, seq: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (H_kv, T, D) of ``seq``'s tokens start .. start + T - 1 (already reserved)."""
        T, S = k.shape[1], self.block_size
        if start + T > self.lengths[seq]:
            raise ValueError(
                f"tokens {start}..{start + T - 1} of sequence {seq} were not reserved (length {self.lengths[seq]})"
            )
        for lo, hi in _spans(start, start + T, S):  # positions lo..hi-1 lie in one block
            block = self.tables[seq][lo // S]
            if self.allocator.is_shared(block):
                raise RuntimeError(f"block {block} is shared: writing would change another sequence's past")
            offset = lo % S
            self.k[layer, block, :, offset : offset + hi - lo] = k[:, lo - start : hi - start]  # (H_kv, hi - lo, D)
            self.v[layer, block, :, offset : offset + hi - lo] = v[:, lo - start : hi - start]
            self.filled[block] = max(self.filled[block], offset + hi - lo)

    def block_tables(self, seqs: list[int], given: torch.Tensor | None = None) -> torch.Tensor:
        """(B, n_blocks) long: the tables of ``seqs``, checked, padded with their own last block.

        ``given``: a table built by hand, returned only if row b names sequence b's own blocks, in token
        order (any of them as padding): a block never allocated to it would be read as zeros or as
        another sequence's keys, so it is an error that names the sequence and the block."""
        for s in seqs:
            self._known(s)
        width = max(len(self.tables[s]) for s in seqs)
        rows = []
        for s in seqs:
            for block in self.tables[s]:
                if self.allocator.ref_counts[block] == 0:
                    raise ValueError(f"the block table of sequence {s} references block {block}, which is free")
            table = self.tables[s]
            rows.append(table + (table[-1:] or [0]) * (width - len(table)))
        if given is None:
            return torch.tensor(rows, dtype=torch.long, device=self.k.device)
        if given.dim() != 2 or given.shape[0] != len(seqs) or given.shape[1] < width:
            raise ValueError(f"need a table of {len(seqs)} rows of at least {width} blocks, got {tuple(given.shape)}")
        for s, row in zip(seqs, given.tolist()):
            own = self.tables[s]
            for j, block in enumerate(row):
                if block not in own or (j < len(own) and block != own[j]):
                    why = "never allocated to it" if block not in own else f"in place {j}, where {own[j]} belongs"
                    raise ValueError(f"the block table of sequence {s} names block {block}, {why} (its blocks: {own})")
        return given

    def attend(self, layer: int, q: torch.Tensor, seqs: list[int], given: torch.Tensor | None = None) -> torch.Tensor:
        """``paged_attention_blockwise`` of the last Tq tokens of ``seqs``, q (B, H, Tq, D), in ``layer``."""
        tables = self.block_tables(seqs, given)  # (B, n_blocks)
        lengths = torch.tensor([self.lengths[s] for s in seqs], device=q.device)
        return paged_attention_blockwise(q, self.k[layer], self.v[layer], tables, lengths)  # (B, H, Tq, D)

    # -- the memory figures ----------------------------------------------------------------------
    def slots(self) -> dict[str, int]:
        """Token slots of the pool: allocated (in used blocks), filled, and logical (per sequence)."""
        used = [b for b, c in enumerate(self.allocator.ref_counts) if c > 0]
        return {
            "allocated": len(used) * self.block_size,
            "filled": sum(self.filled[b] for b in used),
            "logical": sum(self.lengths.values()),  # > filled when sequences share blocks
        }


def _spans(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """Split positions start..end-1 at block boundaries: [(start, b1), (b1, b2), ..., (bn, end)]."""
    if end <= start:
        return []
    edges = [start, *range((start // size + 1) * size, end, size), end]
    return list(zip(edges[:-1], edges[1:]))


class PagedBatch:
    """A batch of sequences of one length, seen by a model as its KV cache for one forward pass.

    ``PagedBatch(cache, seqs, n_new)`` reserves room for ``n_new`` tokens of each sequence; the
    model then calls ``update(layer, k, v)`` once per layer with the new keys and values. It
    implements ``llmedu.nn.kv_cache.KVCacheLike``.
    """

    def __init__(self, cache: PagedKVCache, seqs: list[int], n_new: int):
        past = {cache.lengths[s] for s in seqs}
        if len(past) != 1:
            raise ValueError(
                f"a PagedBatch needs sequences of one length (the model takes one position), got {sorted(past)}"
            )
        self.cache, self.seqs, self.n_new = cache, list(seqs), n_new
        self.length = past.pop()  # tokens before this pass: the position of the first new token
        needed = sum(cache.blocks_needed(s, n_new) for s in self.seqs)
        if needed > cache.allocator.num_free:  # check first, so that a failure leaves the cache as it was
            raise OutOfBlocks(
                f"{len(self.seqs)} sequences need {needed} more blocks, {cache.allocator.num_free} are free"
            )
        for s in self.seqs:
            cache.reserve(s, n_new)
        self.tables = cache.block_tables(self.seqs)  # (B, n_blocks), after any copy-on-write

    @property
    def first_position(self) -> int:
        """The new tokens follow the cached ones: their first position is ``length``."""
        return self.length

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, n_new, D); return every key and value so far, (B, H_kv, length + n_new, D)."""
        if k.shape[0] != len(self.seqs) or k.shape[2] != self.n_new:
            raise ValueError(
                f"expected keys for {len(self.seqs)} sequences x {self.n_new} tokens, got {tuple(k.shape)}"
            )
        for i, s in enumerate(self.seqs):
            self.cache.write(layer, s, self.length, k[i], v[i])
        total = self.length + self.n_new
        return gather_kv(self.cache.k[layer], self.tables, total), gather_kv(self.cache.v[layer], self.tables, total)
