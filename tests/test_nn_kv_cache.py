"""The KV-cache protocol: the three caches have its members and behave as it says; a cache without
``first_position`` is refused, by ``isinstance`` and by the model.

Shapes: k, v (B, H_kv, T_new, D) in, (B, H_kv, T_past + T_new, D) out. Returned values are copies
of what went in (or of the learned prefix), so they are compared exactly.
"""

import pytest
import torch

from llmedu.inference.paged_attention import PagedBatch, PagedKVCache
from llmedu.models import Transformer, TransformerConfig
from llmedu.nn.kv_cache import KVCache, KVCacheLike
from llmedu.peft.prompt import PrefixCache

B, H_KV, D = 2, 2, 4


def _kv(t: int, value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (B, H_kv, t, D) filled with ``value`` and ``-value``."""
    k = torch.full((B, H_KV, t, D), value)
    return k, -k


def test_the_three_caches_satisfy_the_protocol():
    paged = PagedKVCache(n_layers=1, n_kv_heads=H_KV, head_dim=D, num_blocks=8, block_size=4)
    paged.add(0), paged.add(1)
    prefix = torch.zeros(1, B, H_KV, 3, D)  # (L, B, H_kv, P, D)
    caches = [KVCache(1, B, H_KV, D, max_len=8), PagedBatch(paged, [0, 1], 2), PrefixCache(prefix, prefix)]
    for cache in caches:
        assert isinstance(cache, KVCacheLike), type(cache).__name__


def test_contiguous_cache_grows_once_every_layer_has_its_tokens():
    cache = KVCache(n_layers=2, batch=B, n_kv_heads=H_KV, head_dim=D, max_len=8)
    assert (cache.length, cache.first_position) == (0, 0)
    k, v = cache.update(0, *_kv(3, 1.0))
    assert k.shape == v.shape == (B, H_KV, 3, D)
    assert cache.length == 0  # layer 1 does not hold the tokens yet
    cache.update(1, *_kv(3, 1.0))
    assert (cache.length, cache.first_position) == (3, 3)
    k, v = cache.update(0, *_kv(2, 2.0))
    assert k.shape == v.shape == (B, H_KV, 5, D)
    assert k[0, 0, :, 0].tolist() == [1.0, 1.0, 1.0, 2.0, 2.0] and torch.equal(v, -k)


def test_paged_batch_is_one_forward_pass_of_sequences_of_one_length():
    paged = PagedKVCache(n_layers=1, n_kv_heads=H_KV, head_dim=D, num_blocks=8, block_size=4)
    paged.add(0), paged.add(1)
    PagedBatch(paged, [0, 1], 3).update(0, *_kv(3, 1.0))  # a prompt of 3 tokens
    batch = PagedBatch(paged, [0, 1], 2)  # the next pass: 2 new tokens after the 3
    assert (batch.length, batch.first_position) == (3, 3)
    k, v = batch.update(0, *_kv(2, 2.0))
    assert k.shape == v.shape == (B, H_KV, 5, D)
    assert k[1, 1, :, 0].tolist() == [1.0, 1.0, 1.0, 2.0, 2.0] and torch.equal(v, -k)
    assert (batch.length, batch.first_position) == (3, 3)  # the past of this pass; the next batch sees 5
    assert PagedBatch(paged, [0, 1], 1).length == 5


@pytest.mark.parametrize("shift_positions", [True, False])
def test_prefix_cache_returns_the_prefix_then_the_new_tokens_and_stores_nothing(shift_positions):
    keys = torch.full((2, B, H_KV, 3, D), 7.0)  # (L, B, H_kv, P, D)
    cache = PrefixCache(keys, -keys, shift_positions)
    first = 3 if shift_positions else 0
    assert (cache.length, cache.first_position) == (3, first)
    k, v = cache.update(1, *_kv(2, 1.0))
    assert k.shape == v.shape == (B, H_KV, 5, D)
    assert k[0, 0, :, 0].tolist() == [7.0, 7.0, 7.0, 1.0, 1.0] and torch.equal(v, -k)
    assert (cache.length, cache.first_position) == (3, first)


class _WithoutFirstPosition:
    """A cache written before ``first_position`` was part of the protocol."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int):
        self.inner = KVCache(n_layers, 1, n_kv_heads, head_dim, max_len=16)

    @property
    def length(self) -> int:
        return self.inner.length

    def update(self, layer, k, v):
        return self.inner.update(layer, k, v)


def test_a_cache_without_first_position_is_refused():
    config = TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_seq_len=16)
    model = Transformer(config).eval()
    cache = _WithoutFirstPosition(config.n_layers, config.n_kv_heads, config.head_dim)
    assert not isinstance(cache, KVCacheLike)
    ids = torch.randint(0, 32, (1, 4))
    with pytest.raises(AttributeError, match="first_position"):
        model(ids, cache=cache)
    assert isinstance(model.new_cache(1), KVCacheLike)
    model(ids, cache=model.new_cache(1))  # the same call with a complete cache runs
