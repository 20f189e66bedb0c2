"""A mixture of experts selected in ``TransformerConfig``: the model builds, trains, and counts right.

The MoE layers themselves are checked against a loop over tokens (``test_nn_moe.py``) and against
Mixtral's block; here: that the config puts them in every block, that ``moe_loss`` is the stated sum
of their auxiliary losses, that a tiny MoE GPT learns through the ordinary trainer, that a dense
config is untouched, and that parameter and FLOP counts follow the experts (total: all of them;
active per token: k of them).
"""

import pytest
import torch

from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.config import MoEConfig
from llmedu.models.counting import count_parameters, flops_per_token, matmul_parameters
from llmedu.models.gpt import lm_loss
from llmedu.nn.moe import MoEFeedForward
from llmedu.train.loop import TrainConfig, train

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)


def test_every_block_gets_a_mixture_and_moe_loss_is_the_stated_sum():
    torch.manual_seed(0)
    moe = MoEConfig(n_experts=4, top_k=2, capacity_factor=1.0, aux_loss_coef=0.01, z_loss_coef=0.001)
    model = CausalLM(TransformerConfig(**TINY, moe=moe))
    assert all(isinstance(b.mlp, MoEFeedForward) and len(b.mlp.experts) == 4 for b in model.transformer.blocks)
    assert model.transformer.moe_stats() == []  # nothing routed yet
    ids = torch.randint(0, 64, (2, 16))
    model(ids)
    stats = model.transformer.moe_stats()
    assert len(stats) == 2 and all(int(s.tokens_per_expert.sum()) == 32 * 2 for s in stats)
    expected = sum(0.01 * s.aux_loss + 0.001 * s.z_loss for s in stats)
    assert model.transformer.moe_loss().item() == pytest.approx(expected.item(), rel=1e-6)
    dense = CausalLM(TransformerConfig(**TINY))
    dense(ids)
    assert dense.transformer.moe_loss().item() == 0.0


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread is faster, and much faster on a loaded machine (no oversubscription)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_tiny_moe_gpt_trains_with_its_auxiliary_losses(one_thread):
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig(**TINY, moe=MoEConfig(n_experts=4, top_k=2)))
    data = torch.randint(0, 64, (8, 4, 16), generator=torch.Generator().manual_seed(1))  # 8 batches

    aux = []

    def loss_fn(m, ids):
        logits = m(ids)
        extra = m.transformer.moe_loss()
        aux.append(extra.item())
        return lm_loss(logits, ids) + extra

    with torch.no_grad():
        before = sum(lm_loss(model(ids), ids).item() for ids in data) / len(data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train(model, optimizer, lambda i: data[i % 8], loss_fn, TrainConfig(max_steps=60, progress=False))
    with torch.no_grad():
        after = sum(lm_loss(model(ids), ids).item() for ids in data) / len(data)
    # random tokens: the model can only memorise them, which 60 steps start to do (ln 64 = 4.16 at first)
    assert after < before - 0.3, (before, after)
    # two layers, each adding 0.01 * aux (about 1 when balanced, up to E / k... when one expert takes all)
    # and 0.001 * z (the squared log-partition: (ln 4)^2 = 1.9 for small logits)
    assert all(0.015 < a < 0.1 for a in aux), (min(aux), max(aux))


def test_a_dense_config_is_unchanged():
    cfg = TransformerConfig(**TINY)
    assert cfg.moe is None and TransformerConfig(**cfg.to_dict()) == cfg
    moe_cfg = TransformerConfig(**TINY, moe=MoEConfig(4, 1))
    assert TransformerConfig(**moe_cfg.to_dict()) == moe_cfg  # the nested dict comes back as a MoEConfig
    torch.manual_seed(0)
    a = CausalLM(cfg)
    torch.manual_seed(0)
    b = CausalLM(TransformerConfig(**TINY, moe=None))
    ids = torch.randint(0, 64, (2, 8))
    assert torch.equal(a(ids), b(ids))


def test_bad_moe_settings_are_clear_errors():
    with pytest.raises(ValueError, match="moe.capacity_factor must be > 0"):
        MoEConfig(4, 2, capacity_factor=0.0)
    with pytest.raises(ValueError, match="moe.capacity_factor must be > 0"):
        MoEConfig(4, 2, capacity_factor=-0.5)
    with pytest.raises(ValueError, match=r"moe.top_k must be in 1..n_experts=4"):
        MoEConfig(4, 5)
    with pytest.raises(ValueError, match="moe.n_experts must be >= 1"):
        MoEConfig(0, 1)
    with pytest.raises(ValueError, match="loss coefficients"):
        MoEConfig(4, 2, aux_loss_coef=-1.0)


def test_mixtral_8x7b_counts_its_parameters_as_the_paper():
    # Jiang et al. 2024, sec. 2: 47B parameters, 13B active per token (46,702,792,704 in transformers)
    cfg = TransformerConfig.llama(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, max_seq_len=4096,
        moe=MoEConfig(n_experts=8, top_k=2, capacity_factor=None),
    )  # fmt: skip
    with torch.device("meta"):  # shapes only: nothing allocated
        model = CausalLM(cfg)
    assert count_parameters(model) == 46_702_792_704
    assert round(count_parameters(model, active=True) / 1e9, 1) == 12.9
    # 6 of 8 experts idle per token: 32 layers * 6 * 3 * 4096 * 14336 weights
    assert count_parameters(model) - count_parameters(model, active=True) == 32 * 6 * 3 * 4096 * 14336


def test_flops_follow_the_active_parameters():
    moe = CausalLM(TransformerConfig(**TINY, moe=MoEConfig(n_experts=8, top_k=2)))
    dense = CausalLM(TransformerConfig(**TINY))
    ffn = 2 * 32 * 128  # one expert's (or the dense FFN's) matmul weights, d = 32, d_ff = 128
    router = 8 * 32
    n_layers = 2
    assert matmul_parameters(moe) == matmul_parameters(dense) + n_layers * (7 * ffn + router)
    assert matmul_parameters(moe, active=True) == matmul_parameters(dense) + n_layers * (ffn + router)
    assert matmul_parameters(dense, active=True) == matmul_parameters(dense)
    biases = 128 + 32  # an expert's parameters besides its matrices
    assert count_parameters(moe) - count_parameters(moe, active=True) == n_layers * 6 * (ffn + biases)
    # top-2 of 8 experts: the FFN's FLOPs double, its parameters grow 8-fold
    extra = flops_per_token(moe.config, matmul_parameters(moe, active=True), 16) - flops_per_token(
        dense.config, matmul_parameters(dense), 16
    )
    assert extra == 6 * n_layers * (ffn + router)
