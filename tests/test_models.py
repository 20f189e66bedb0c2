"""The configurable transformer: every variant builds and runs, masks hold for the whole stack,
generation with the KV cache equals generation without, bad configs fail early.

Tolerance 1e-5 (float32, a few layers): the cached and uncached paths sum the same products in a
different order.
"""

import pytest
import torch

from llmedu.models import CausalLM, MaskedLM, SequenceClassifier, Transformer, TransformerConfig, generate
from llmedu.models.bert import mlm_loss
from llmedu.models.counting import count_parameters, flops_per_token, matmul_parameters, mfu
from llmedu.models.gpt import lm_loss
from llmedu.models.transformer import make_block
from llmedu.nn.blocks import ParallelBlock, SerialBlock
from llmedu.nn.norms import deepnorm_constants

TOL = dict(atol=1e-5, rtol=0)
VARIANTS = {
    "gpt2": TransformerConfig.gpt2(vocab_size=64, d_model=48, n_heads=3, n_layers=2, max_seq_len=32),
    "llama-gqa": TransformerConfig.llama(vocab_size=64, d_model=48, n_heads=6, n_kv_heads=2, n_layers=2),
    "mqa-alibi": TransformerConfig(vocab_size=64, d_model=48, n_heads=4, n_kv_heads=1, n_layers=2, position="alibi"),
    "t5-bias-sandwich": TransformerConfig(
        vocab_size=64, d_model=48, n_heads=4, n_layers=2, position="relative", norm_placement="sandwich"
    ),
    "sinusoidal-post": TransformerConfig(
        vocab_size=64, d_model=48, n_heads=4, n_layers=2, position="sinusoidal", norm_placement="post"
    ),
    "cramming-deepnorm": TransformerConfig(
        vocab_size=64,
        d_model=48,
        n_heads=4,
        n_layers=2,
        position="scaled_sinusoidal",
        norm_placement="deepnorm",
        activation="geglu",
    ),
    "parallel-rope": TransformerConfig(
        vocab_size=64, d_model=48, n_heads=4, n_layers=2, position="rope", block="parallel", norm="rmsnorm", bias=False
    ),
}


@pytest.fixture(params=sorted(VARIANTS))
def lm(request):
    torch.manual_seed(0)
    return CausalLM(VARIANTS[request.param]).eval()


def test_future_tokens_cannot_change_past_logits(lm):
    ids = torch.randint(0, 64, (2, 12))
    other = ids.clone()
    other[:, 8:] = (other[:, 8:] + 1) % 64
    torch.testing.assert_close(lm(ids)[:, :8], lm(other)[:, :8], **TOL)
    assert not torch.allclose(lm(ids)[:, 8:], lm(other)[:, 8:], atol=1e-4)


def test_cached_decoding_gives_the_logits_of_one_pass(lm):
    ids = torch.randint(0, 64, (2, 12))
    cache = lm.transformer.new_cache(batch=2, max_len=12)
    steps = [lm(ids[:, :5], cache=cache)] + [lm(ids[:, t : t + 1], cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), lm(ids), **TOL)


def test_generate_with_and_without_cache_agree(lm):
    prompt = torch.randint(0, 64, (3, 4))
    greedy = generate(lm, prompt, 10)
    assert greedy.shape == (3, 14) and torch.equal(greedy[:, :4], prompt)
    assert torch.equal(greedy, generate(lm, prompt, 10, use_cache=False))
    sampled = [
        generate(lm, prompt, 10, temperature=1.0, top_k=5, use_cache=c, generator=torch.Generator().manual_seed(3))
        for c in (True, False)
    ]
    assert torch.equal(*sampled)


def test_padding_mask_makes_padding_invisible():
    torch.manual_seed(0)
    bert = MaskedLM(TransformerConfig.bert(vocab_size=64, d_model=48, n_heads=3, n_layers=2, max_seq_len=32)).eval()
    ids = torch.randint(0, 64, (1, 9))
    padded = torch.cat([ids, torch.randint(0, 64, (1, 5))], dim=1)
    mask = torch.tensor([[1] * 9 + [0] * 5])
    torch.testing.assert_close(bert(padded, mask)[:, :9], bert(ids), **TOL)
    assert not torch.allclose(bert(padded)[:, :9], bert(ids), atol=1e-4)


def test_heads_have_the_right_shapes_and_losses():
    torch.manual_seed(0)
    cfg = TransformerConfig.bert(vocab_size=64, d_model=48, n_heads=3, n_layers=1, max_seq_len=16)
    ids = torch.randint(0, 64, (2, 10))
    assert SequenceClassifier(cfg, n_classes=3)(ids).shape == (2, 3)
    mlm = MaskedLM(cfg)
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    assert mlm_loss(mlm(ids), labels).item() == pytest.approx(torch.log(torch.tensor(64.0)).item(), rel=0.05)
    gpt = CausalLM(VARIANTS["gpt2"])
    assert gpt.lm_head.weight is gpt.transformer.tok_embed.weight  # tied
    assert lm_loss(gpt(ids), ids).item() == pytest.approx(torch.log(torch.tensor(64.0)).item(), rel=0.05)
    with pytest.raises(ValueError, match="causal=False"):
        MaskedLM(VARIANTS["gpt2"])
    with pytest.raises(ValueError, match="causal=True"):
        CausalLM(cfg)


def test_every_variant_trains():
    for name, cfg in VARIANTS.items():
        torch.manual_seed(0)
        model = CausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ids = torch.randint(0, 64, (2, 12))
        first = lm_loss(model(ids), ids)
        for _ in range(5):
            loss = lm_loss(model(ids), ids)
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert loss.item() < first.item(), name


def test_bad_configs_fail_at_construction():
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        TransformerConfig(d_model=100, n_heads=3)
    with pytest.raises(ValueError, match="does not divide"):
        TransformerConfig(d_model=96, n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="position="):
        TransformerConfig(position="spiral")
    with pytest.raises(ValueError, match="pre-LN"):
        TransformerConfig(block="parallel", norm_placement="post")
    with pytest.raises(ValueError, match="even head dimension"):
        TransformerConfig(d_model=12, n_heads=4, position="rope")


def test_deepnorm_alpha_reaches_deepnorm_blocks_only():
    for name, cfg in VARIANTS.items():
        expected = deepnorm_constants(cfg.n_layers)[0] if cfg.norm_placement == "deepnorm" else 1.0
        assert make_block(cfg).alpha == expected, name
    alpha = deepnorm_constants(12)[0]  # what make_block used to pass to every block
    with pytest.raises(ValueError, match="deepnorm_alpha=.* a ParallelBlock with placement='pre' would ignore it"):
        ParallelBlock(d_model=32, n_heads=4, d_ff=64, deepnorm_alpha=alpha)
    with pytest.raises(ValueError, match="deepnorm_alpha=.* a SerialBlock with placement='post' would ignore it"):
        SerialBlock(d_model=32, n_heads=4, d_ff=64, placement="post", deepnorm_alpha=alpha)
    assert SerialBlock(d_model=32, n_heads=4, d_ff=64, placement="deepnorm", deepnorm_alpha=alpha).alpha == alpha


def test_bad_inputs_fail_at_call():
    model = CausalLM(VARIANTS["gpt2"])  # a learned table of 32 positions
    with pytest.raises(ValueError, match="past the learned table of 32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="exceed the learned position table"):
        generate(model, torch.zeros(1, 30, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="int64"):
        model(torch.zeros(1, 5))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model(torch.zeros(1, 5, dtype=torch.long), inputs_embeds=torch.zeros(1, 5, 48))
    with pytest.raises(ValueError, match="inputs_embeds must be"):
        model(inputs_embeds=torch.zeros(1, 5, 47))
    with pytest.raises(ValueError, match="token id 64 is outside the vocabulary of 64"):
        model(torch.tensor([[1, 64]]))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -3"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), -3)
    with pytest.raises(ValueError, match="top_k must be an int from 1 to the vocabulary size 64, got 65"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, temperature=1.0, top_k=65)


def test_inputs_embeds_is_the_embedding_path_made_explicit(lm):
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    embeds = lm.get_input_embeddings()(ids)  # (B, T, d)
    torch.testing.assert_close(lm(inputs_embeds=embeds), lm(ids), **TOL)


def test_counting_by_hand():
    cfg = TransformerConfig.gpt2(vocab_size=64, d_model=48, n_heads=3, n_layers=2, max_seq_len=32)
    model = Transformer(cfg)
    per_block = 4 * (48 * 48 + 48) + (48 * 192 + 192) + (192 * 48 + 48) + 2 * 2 * 48
    assert count_parameters(model, embeddings=False) == 2 * per_block + 2 * 48  # + final norm
    assert count_parameters(model) == count_parameters(model, embeddings=False) + 64 * 48 + 32 * 48
    assert count_parameters(CausalLM(cfg)) == count_parameters(model)  # the tied head adds nothing
    n = count_parameters(model, embeddings=False)
    assert flops_per_token(cfg, n, seq_len=32) == 6 * n + 12 * 2 * 32 * 48
    assert flops_per_token(cfg, n, seq_len=32, training=False) == 2 * n + 4 * 2 * 32 * 48
    assert mfu(1e9, 100.0, 1e12) == pytest.approx(0.1)


def test_flops_formula_equals_torch_flop_counter():
    """torch.utils.flop_counter counts every matmul of a training step; with the written-out attention
    (the fused CPU kernel is not counted by it) 6N + 12 L T d per token is exact, not an estimate."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = TransformerConfig.gpt2(vocab_size=64, d_model=48, n_heads=3, n_layers=2, max_seq_len=32, attn_impl="math")
    model = CausalLM(cfg)
    ids = torch.randint(0, 64, (3, 32))
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(ids), ids).backward()
    n = matmul_parameters(model)
    assert n == 2 * (4 * 48 * 48 + 2 * 48 * 192) + 64 * 48  # blocks + the tied output projection
    assert counter.get_total_flops() == flops_per_token(cfg, n, seq_len=32) * ids.numel()
