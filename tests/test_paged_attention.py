"""llmedu.inference: the block allocator, the paged KV cache, and continuous batching with our GPT.

The oracles: attention over the paged cache must equal PyTorch's scaled_dot_product_attention over
the same keys and values stored contiguously (1e-6: both sum the same fp32 terms; only the masked
padding differs), and serving requests through the paged cache must produce exactly the tokens of
``llmedu.models.generate`` with its contiguous KV cache, for the same prompts and seeds.
"""

import pytest
import torch
import torch.nn.functional as F

from llmedu.inference import (
    BlockAllocator,
    ContinuousBatcher,
    OutOfBlocks,
    PagedBatch,
    PagedKVCache,
    Request,
    gather_kv,
    paged_attention,
)
from llmedu.inference.paged_attention import paged_attention_blockwise
from llmedu.models import CausalLM, TransformerConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: see conftest.py


def test_block_numbers_outside_the_pool_are_an_error():
    pool = torch.randn(4, 2, 8, 16)  # 4 blocks of 8 tokens
    with pytest.raises(ValueError, match=r"names block -1; the pool has blocks 0 \.\. 3"):
        gather_kv(pool, torch.tensor([[0, -1]]), 12)  # -1 would silently read the last block
    with pytest.raises(ValueError, match="names block 4"):
        gather_kv(pool, torch.tensor([[4]]), 3)


# -- the allocator -------------------------------------------------------------------------------------
def test_allocator_free_list_and_reference_counts():
    alloc = BlockAllocator(4)
    blocks = [alloc.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and alloc.num_free == 0
    with pytest.raises(OutOfBlocks, match="all 4 KV blocks are in use"):
        alloc.allocate()
    alloc.share(blocks[0])
    alloc.free(blocks[0])
    assert alloc.num_free == 0 and alloc.ref_counts[blocks[0]] == 1  # still held once
    alloc.free(blocks[0])
    assert alloc.num_free == 1 and alloc.allocate() == blocks[0]  # the freed block is reused
    alloc.check()


def test_allocator_rejects_double_free_and_unknown_blocks():
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    alloc.free(b)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)
    with pytest.raises(ValueError, match="it is free"):
        alloc.share(b)
    with pytest.raises(IndexError, match="numbered 0..1"):
        alloc.free(7)
    alloc.check()
    alloc.ref_counts[1] = 1  # corrupt it by hand: a block counted as held but still on the free list
    with pytest.raises(AssertionError, match="block 1"):
        alloc.check()


# -- paged attention against contiguous attention ------------------------------------------------------------
def scattered_cache(lengths, n_kv, D, S, seed=0):
    """Per-sequence contiguous K/V, and the same stored in a shuffled pool of blocks."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-L // S) for L in lengths)
    order = torch.randperm(n_blocks, generator=g).tolist()  # blocks are not in token order in the pool
    k_pool, v_pool = torch.zeros(n_blocks, n_kv, S, D), torch.zeros(n_blocks, n_kv, S, D)
    ks, vs, tables = [], [], []
    for L in lengths:
        k, v = torch.randn(n_kv, L, D, generator=g), torch.randn(n_kv, L, D, generator=g)
        table = [order.pop() for _ in range(-(-L // S))]
        for i, block in enumerate(table):
            k_pool[block, :, : len(range(i * S, min(L, (i + 1) * S)))] = k[:, i * S : (i + 1) * S]
            v_pool[block, :, : len(range(i * S, min(L, (i + 1) * S)))] = v[:, i * S : (i + 1) * S]
        ks.append(k), vs.append(v), tables.append(table)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return ks, vs, k_pool, v_pool, block_tables


ATTENTIONS = [paged_attention, paged_attention_blockwise]  # gather + SDPA; block by block through the table


# Tolerance 1e-6: the gathered version sums the same fp32 terms as SDPA; the block-by-block one sums them
# in another order with a rescaling per block, a few ulps of outputs of size ~1.
@pytest.mark.parametrize("attention", ATTENTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("Tq", [1, 3])
def test_paged_attention_equals_contiguous_attention(Tq, attention):
    lengths, H, n_kv, D, S = [5, 17, 32, 9], 4, 2, 8, 4
    ks, vs, k_pool, v_pool, tables = scattered_cache(lengths, n_kv, D, S)
    q = torch.randn(len(lengths), H, Tq, D, generator=torch.Generator().manual_seed(1))
    out = attention(q, k_pool, v_pool, tables, torch.tensor(lengths))
    for b, L in enumerate(lengths):
        k, v = ks[b].repeat_interleave(H // n_kv, 0), vs[b].repeat_interleave(H // n_kv, 0)  # (H, L, D)
        visible = torch.arange(L)[None, :] <= torch.arange(L - Tq, L)[:, None]  # (Tq, L), bottom-right causal
        ref = F.scaled_dot_product_attention(q[b], k, v, attn_mask=visible)
        torch.testing.assert_close(out[b], ref, atol=1e-6, rtol=0)


def test_blockwise_equals_gathered_on_a_larger_batch():
    lengths, H, n_kv, D, S = [1, 16, 33, 64, 7, 50], 8, 2, 16, 16  # lengths at and around block edges
    _, _, k_pool, v_pool, tables = scattered_cache(lengths, n_kv, D, S, seed=3)
    q = torch.randn(len(lengths), H, 1, D, generator=torch.Generator().manual_seed(4)) * 3  # peaked softmax
    context = torch.tensor(lengths)
    torch.testing.assert_close(
        paged_attention_blockwise(q, k_pool, v_pool, tables, context),
        paged_attention(q, k_pool, v_pool, tables, context),
        atol=1e-6,
        rtol=0,
    )


def test_gathered_attention_with_gqa_does_not_repeat_the_kv_heads():
    """SDPA's enable_gqa gives the output of repeating each K/V head for its query heads, without the copy:
    the largest tensor computed is one gathered (B, H_kv, T, D) copy, not a (B, H, T, D) repetition of it."""
    from llmedu.kernels.traffic import largest_temporary

    lengths, H, n_kv, D, S = [64, 40, 64], 8, 2, 16, 16
    _, _, k_pool, v_pool, tables = scattered_cache(lengths, n_kv, D, S, seed=5)
    q = torch.randn(len(lengths), H, 1, D, generator=torch.Generator().manual_seed(6))
    context = torch.tensor(lengths)
    repeated_k = gather_kv(k_pool, tables, 64).repeat_interleave(H // n_kv, dim=1)  # (B, H, T, D): the old path
    repeated_v = gather_kv(v_pool, tables, 64).repeat_interleave(H // n_kv, dim=1)
    visible = torch.arange(64)[None, None, None, :] < context[:, None, None, None]  # (B, 1, 1, T)
    expected = F.scaled_dot_product_attention(q, repeated_k, repeated_v, attn_mask=visible)
    torch.testing.assert_close(paged_attention(q, k_pool, v_pool, tables, context), expected, atol=1e-6, rtol=0)
    elements, shape, op = largest_temporary(paged_attention, q, k_pool, v_pool, tables, context)
    assert elements <= len(lengths) * n_kv * 64 * D, f"{op} made {shape}: the K/V heads were repeated"


@pytest.mark.parametrize("attention", ATTENTIONS, ids=lambda f: f.__name__)
def test_paged_attention_bad_input(attention):
    _, _, k_pool, v_pool, tables = scattered_cache([4, 6], 2, 8, 4)
    with pytest.raises(ValueError, match="heads of dim 16"):
        attention(torch.randn(2, 4, 1, 16), k_pool, v_pool, tables, torch.tensor([4, 6]))
    with pytest.raises(ValueError, match="do not divide"):
        attention(torch.randn(2, 3, 1, 8), k_pool, v_pool, tables, torch.tensor([4, 6]))
    with pytest.raises(ValueError, match="one block table and one length per sequence"):
        attention(torch.randn(2, 4, 1, 8), k_pool, v_pool, tables, torch.tensor([4]))
    with pytest.raises(ValueError, match="every context must hold the 2 query tokens"):
        attention(torch.randn(2, 4, 2, 8), k_pool, v_pool, tables, torch.tensor([1, 6]))
    with pytest.raises(ValueError, match="does not fit in 2 blocks of 4"):
        attention(torch.randn(2, 4, 1, 8), k_pool, v_pool, tables, torch.tensor([4, 9]))
    with pytest.raises(ValueError, match="names block -1"):
        attention(torch.randn(2, 4, 1, 8), k_pool, v_pool, tables.clone().fill_(-1), torch.tensor([4, 6]))


# -- the paged cache: sharing, copy-on-write, errors ----------------------------------------------------------
def fill(cache, seq, n, value):
    """Append n tokens whose keys and values are all ``value`` (one layer) through a PagedBatch."""
    batch = PagedBatch(cache, [seq], n)
    kv = torch.full((1, cache.k.shape[2], n, cache.k.shape[-1]), float(value))
    return batch.update(0, kv, kv)


def test_fork_shares_blocks_and_copy_on_write_keeps_the_parent_intact():
    cache = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=2, num_blocks=8, block_size=4)
    cache.add(0)
    fill(cache, 0, 6, 1.0)  # blocks: [full, half full]
    cache.fork(0, 1)
    assert cache.tables[1] == cache.tables[0] and cache.allocator.num_used == 2  # nothing copied
    assert cache.slots() == {"allocated": 8, "filled": 6, "logical": 12}
    k_child, _ = fill(cache, 1, 3, 2.0)  # the child diverges: its half-full last block is copied
    assert cache.tables[1][0] == cache.tables[0][0] and cache.tables[1][1] != cache.tables[0][1]
    assert cache.allocator.ref_counts[cache.tables[0][0]] == 2 and cache.allocator.ref_counts[cache.tables[0][1]] == 1
    assert k_child[0, 0, :, 0].tolist() == [1.0] * 6 + [2.0] * 3  # the shared past, then its own tokens
    k_parent, _ = fill(cache, 0, 1, 3.0)  # the parent now owns its last block alone: written in place
    assert k_parent[0, 0, :, 0].tolist() == [1.0] * 6 + [3.0]
    cache.free(0), cache.free(1)
    assert cache.allocator.num_used == 0
    cache.allocator.check()


def test_writing_into_a_shared_block_is_refused():
    cache = PagedKVCache(1, 1, 2, num_blocks=4, block_size=4)
    cache.add(0)
    fill(cache, 0, 2, 1.0)
    cache.fork(0, 1)
    cache.lengths[0] += 1  # reserve behind the cache's back, skipping copy-on-write
    with pytest.raises(RuntimeError, match="shared"):
        cache.write(0, 0, 2, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))


def test_block_table_referencing_a_freed_block_is_an_error():
    cache = PagedKVCache(1, 1, 2, num_blocks=4, block_size=4)
    cache.add(0)
    fill(cache, 0, 5, 1.0)
    cache.allocator.free(cache.tables[0][1])  # freed behind the table's back
    with pytest.raises(ValueError, match="references block .*, which is free"):
        cache.block_tables([0])


def test_a_hand_built_block_table_naming_another_block_is_refused():
    cache = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=2, num_blocks=8, block_size=4)
    cache.add(0), cache.add(1)
    fill(cache, 0, 6, 1.0), fill(cache, 1, 3, 2.0)  # sequence 0: blocks [0, 1]; sequence 1: [2]; 3..7 free
    q = torch.randn(2, 1, 1, 2, generator=torch.Generator().manual_seed(0))
    own = cache.block_tables([0, 1])  # [[0, 1], [2, 2]]: the second row padded with its own block
    torch.testing.assert_close(cache.attend(0, q, [0, 1], own.clone()), cache.attend(0, q, [0, 1]))
    with pytest.raises(ValueError, match=r"sequence 0 names block 5, never allocated to it \(its blocks: \[0, 1\]\)"):
        cache.attend(0, q, [0, 1], torch.tensor([[0, 5], [2, 2]]))  # block 5 holds zeros: it was read as keys
    with pytest.raises(ValueError, match="sequence 1 names block 0, never allocated to it"):
        cache.attend(0, q, [0, 1], torch.tensor([[0, 1], [2, 0]]))  # even as padding: sequence 0's block
    with pytest.raises(ValueError, match="sequence 0 names block 1, in place 0, where 0 belongs"):
        cache.attend(0, q, [0, 1], torch.tensor([[1, 0], [2, 2]]))  # its own blocks, out of token order
    with pytest.raises(ValueError, match=r"2 rows of at least 2 blocks, got \(2, 1\)"):
        cache.attend(0, q, [0, 1], torch.tensor([[0], [2]]))


def test_out_of_blocks_leaves_the_cache_unchanged():
    cache = PagedKVCache(1, 1, 2, num_blocks=3, block_size=4)
    cache.add(0), cache.add(1)
    fill(cache, 0, 8, 1.0)
    before = (dict(cache.lengths), {s: list(t) for s, t in cache.tables.items()}, cache.allocator.num_free)
    with pytest.raises(OutOfBlocks, match="need 2 more blocks, 1 are free"):
        PagedBatch(cache, [1], 5)
    assert (dict(cache.lengths), {s: list(t) for s, t in cache.tables.items()}, cache.allocator.num_free) == before
    cache.allocator.check()


# -- continuous batching with our GPT --------------------------------------------------------------------------
def workload(n_requests=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    return [
        Request(
            [rand(0, 64) for _ in range(rand(1, 14))],
            max_new_tokens=rand(1, 16),
            n=1 + i % 3,
            temperature=[0.0, 1.0][i % 2],
            top_k=[None, 20][i % 2],
            seed=i,
        )
        for i in range(n_requests)
    ]


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_continuous_batching_reproduces_contiguous_generation(position):
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, position=position
    )
    model = CausalLM(cfg).eval()
    requests = workload()
    batcher = ContinuousBatcher(model, num_blocks=20, block_size=4, max_batch=6)  # small: forces preemption
    outputs = batcher.run(requests, progress=False)
    assert batcher.preemptions > 0 and any(r["running"] > 1 for r in batcher.history)
    for i, req in enumerate(requests):
        for j in range(req.n):
            generator = torch.Generator().manual_seed(req.seed + j)
            ids = model.generate(
                torch.tensor([req.prompt]),
                req.max_new_tokens,
                temperature=req.temperature,
                top_k=req.top_k,
                generator=generator,
            )
            assert outputs[i][j] == ids[0, len(req.prompt) :].tolist(), f"request {i}, sample {j}"
    assert batcher.cache.allocator.num_used == 0 and not batcher.cache.tables  # nothing leaked
    batcher.cache.allocator.check()


def test_a_contiguous_reservation_admits_fewer_sequences_into_the_same_blocks():
    """reserve='request': a sequence holds prompt + max_new_tokens slots from admission to the end. Under the
    same blocks it never preempts, never holds more than the pool, makes the same tokens as the paged run,
    and serves fewer sequences per step, so it needs more steps for the same work."""
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_seq_len=64)).eval()
    g = torch.Generator().manual_seed(2)
    requests = [
        Request(torch.randint(1, 64, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist(), 24, seed=i)
        for i in range(10)
    ]  # replies end at token 0 (eos) or after 24 tokens
    runs = {}
    for reserve in (None, "request"):
        batcher = ContinuousBatcher(model, num_blocks=24, block_size=4, max_batch=64, eos_id=0, reserve=reserve)
        runs[reserve] = (batcher, batcher.run(requests, progress=False))
    (paged, paged_out), (slabs, slab_out) = runs[None], runs["request"]
    assert slab_out == paged_out  # the admission rule changes when a sequence runs, not what it samples
    assert slabs.preemptions == 0 and slabs.reserved == 0 and slabs.cache.allocator.num_used == 0
    for record in slabs.history:
        assert record["held"] <= 24 * 4 and record["allocated"] <= record["held"]
        held = sum(-(-(len(requests[slabs.request_of[s]].prompt) + 24) // 4) * 4 for s in record["lengths"])
        assert record["held"] == held  # a slab per running sequence, nothing more
    served = {name: [r["decoded"] for r in b.history] for name, b in (("paged", paged), ("slabs", slabs))}
    assert max(served["paged"]) > max(served["slabs"]) and len(served["paged"]) < len(served["slabs"])
    made = [sum(r["tokens"] for r in b.history) for b in (paged, slabs)]
    assert made == [sum(len(o[0]) for o in paged_out)] * 2


def test_a_bad_reservation_is_refused():
    model = CausalLM(TransformerConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_seq_len=64)).eval()
    for bad in ("max", 0, -16, 2.5):
        with pytest.raises(ValueError, match=f"reserve must be None .* got {bad!r}"):
            ContinuousBatcher(model, num_blocks=8, reserve=bad)
    with pytest.raises(ValueError, match="request 0: 20 tokens exceed a slab of reserve=16"):
        ContinuousBatcher(model, num_blocks=8, block_size=4, reserve=16).run([Request([1] * 10, 10)], progress=False)
    with pytest.raises(ValueError, match="alone needs more than the 8 blocks"):  # two slabs of 5 blocks
        ContinuousBatcher(model, num_blocks=8, block_size=4, reserve="request").run(
            [Request([1] * 10, 10, n=2)], progress=False
        )


def test_paged_waste_is_below_one_block_per_sequence():
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_seq_len=64)).eval()
    batcher = ContinuousBatcher(model, num_blocks=64, block_size=4, max_batch=8)
    batcher.run(workload(6, seed=1), progress=False)
    for record in batcher.history:
        seqs = len(record["lengths"])
        assert record["allocated"] - record["filled"] <= seqs * 3  # at most S - 1 empty slots per sequence
        assert record["filled"] <= record["logical"]  # shared prompt blocks are stored once


def test_a_request_larger_than_the_cache_is_refused():
    model = CausalLM(TransformerConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_seq_len=64)).eval()
    with pytest.raises(ValueError, match="alone needs more than the 4 blocks"):
        ContinuousBatcher(model, num_blocks=4, block_size=4).run([Request([1] * 10, max_new_tokens=10)], progress=False)


# -- the graders of lesson 18 ---------------------------------------------------------------------------
def test_graders_pass_right_answers_and_fail_wrong_ones():
    from llmedu.checks.attention import check_gather_kv, check_slot_of
    from llmedu.inference import gather_kv

    assert check_slot_of(lambda position, table, size: (table[position // size], position % size))
    swapped = check_slot_of(lambda position, table, size: (table[position // size], position // size))
    assert not swapped and "position" in swapped.failure
    assert check_gather_kv(gather_kv)
    heads_mixed = check_gather_kv(
        lambda pool, tables, length: pool[tables].flatten(1, 2).transpose(1, 2)[:, :, :length]
    )
    assert not heads_mixed and "shape" in heads_mixed.failure
