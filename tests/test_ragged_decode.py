"""A decoding step for sequences of different lengths is one forward pass (``llmedu.inference.ragged``), and
the continuous batcher built on it still makes exactly the tokens of ``generate``, for every position scheme."""

import pytest
import torch

from llmedu.inference import ContinuousBatcher, OutOfBlocks, PagedBatch, PagedKVCache, Request, decode_step
from llmedu.models import CausalLM, TransformerConfig


def _model(position):
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, position=position
    )
    return CausalLM(cfg).eval()


def _requests():
    g = torch.Generator().manual_seed(1)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    return [
        Request(
            [rand(0, 64) for _ in range(rand(1, 14))], rand(2, 16), n=1 + i % 2, temperature=[0.0, 1.0][i % 2], seed=i
        )
        for i in range(8)
    ]


@pytest.mark.parametrize("position", ["learned", "rope", "alibi", "relative"])
def test_one_pass_per_step_reproduces_generate(position):
    model, requests = _model(position), _requests()
    batcher = ContinuousBatcher(model, num_blocks=12, block_size=4, max_batch=6)  # small: forces preemption
    calls = {"model": 0, "block 0": 0}  # prefills call the model; a decoding step runs its blocks itself
    hooks = [
        m.register_forward_pre_hook(lambda mod, a, key=key: calls.update({key: calls[key] + 1}))
        for key, m in (("model", model), ("block 0", model.transformer.blocks[0]))
    ]
    with torch.no_grad():
        outputs = batcher.run(requests, progress=False)
    for h in hooks:
        h.remove()
    for i, req in enumerate(requests):
        for j in range(req.n):
            g = torch.Generator().manual_seed(req.seed + j)
            ids = model.generate(
                torch.tensor([req.prompt]), req.max_new_tokens, temperature=req.temperature, generator=g
            )
            assert outputs[i][j] == ids[0, len(req.prompt) :].tolist(), f"{position}: request {i}, sample {j}"
    # sequences of different lengths decode together, yet each step decodes in one forward pass
    assert any(len(set(r["lengths"].values())) > 1 for r in batcher.history) and batcher.preemptions > 0
    decoding_steps = sum(r["decoded"] > 0 for r in batcher.history)
    assert calls["block 0"] == calls["model"] + decoding_steps
    assert sum(r["passes"] for r in batcher.history) == calls["block 0"]


def test_decode_step_equals_one_pass_per_sequence():
    """Three sequences of lengths 3, 6 and 9 in one pass give the logits each gets alone (PagedBatch of one)."""
    model = _model("rope")
    alone, together = (PagedKVCache.for_model(model.config, num_blocks=16, block_size=4) for _ in range(2))
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    expected = []
    with torch.no_grad():
        for s, p in enumerate(prompts):
            for cache in (alone, together):
                cache.add(s)
                model(torch.tensor([p]), cache=PagedBatch(cache, [s], len(p)))
            expected.append(model(torch.tensor([[11]]), cache=PagedBatch(alone, [s], 1))[0, -1])
        got = decode_step(model, together, [0, 1, 2], [11, 11, 11])  # (3, vocab)
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=1e-5)
    assert together.lengths == {0: 4, 1: 7, 2: 10}


def test_decode_step_bad_input_leaves_the_cache_unchanged():
    model = _model("rope")
    cache = PagedKVCache.for_model(model.config, num_blocks=2, block_size=4)
    for s in (0, 1):
        cache.add(s)
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3, 4]]), cache=PagedBatch(cache, [s], 4))
    with pytest.raises(ValueError, match="one token per sequence"):
        decode_step(model, cache, [0, 1], [3])
    with pytest.raises(OutOfBlocks, match="2 sequences need 2 more blocks, 0 are free"):
        decode_step(model, cache, [0, 1], [3, 3])
    assert cache.lengths == {0: 4, 1: 4} and cache.allocator.num_used == 2
