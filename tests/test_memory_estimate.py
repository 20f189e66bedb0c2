"""The analytic formulas against the papers' own numbers and against what MemoryTracker measures."""

import pytest
import torch

from llmedu.checks.memory import check_zero_bytes
from llmedu.memory import (
    MemoryTracker,
    TinyGPT,
    activation_bytes_per_layer,
    adamw_fp32_bytes,
    mixed_precision_adam_bytes,
    simulate_training_step,
    training_step,
    zero_bytes_per_rank,
)
from llmedu.memory.estimate import ring_attention_kv_bytes


def test_model_states_of_fp32_adamw_agree_with_the_tracker():
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=512, seq_len=64, d_model=128, n_layers=2, n_heads=4)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = (torch.randint(0, 512, (4, 64)), torch.randint(0, 512, (4, 64)))
    with MemoryTracker(model, optimizer) as mt:
        training_step(model, optimizer, batch)

    psi = sum(p.numel() for p in model.parameters())
    estimate = adamw_fp32_bytes(psi)
    measured = mt.max_bytes("parameters", "gradients", "optimizer")
    print(f"model states: estimated {sum(estimate.values())} B, measured {measured} B")
    # 5%: the formula leaves out AdamW's step counters (4 bytes per parameter tensor).
    assert measured == pytest.approx(sum(estimate.values()), rel=0.05)
    assert mt.max_bytes("parameters") == estimate["parameters"]
    assert mt.max_bytes("gradients") == estimate["gradients"]
    assert mt.max_bytes("optimizer") == pytest.approx(estimate["optimizer"], rel=0.05)


def test_zero_per_rank_memory_matches_figure_1_of_the_paper():
    # ZeRO (Rajbhandari et al. 2020), Figure 1: Ψ = 7.5B, N = 64, K = 12, in GB (1e9 bytes).
    psi, n = 7_500_000_000, 64
    expected_gb = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expected_gb.items():
        got = sum(zero_bytes_per_rank(psi, n, stage).values()) / 1e9
        assert got == pytest.approx(gb, abs=0.05), f"stage {stage}"
    assert mixed_precision_adam_bytes(psi) == {"parameters": 2 * psi, "gradients": 2 * psi, "optimizer": 12 * psi}
    assert zero_bytes_per_rank(psi, 1, 3) == {k: float(v) for k, v in mixed_precision_adam_bytes(psi).items()}


def test_activation_formula_is_the_papers():
    # Korthikanti et al. 2022, eq. (1): s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit with dropout.
    s, b, h, a = 2048, 4, 12288, 96  # GPT-3 175B's layer
    assert activation_bytes_per_layer(s, b, h, a) == s * b * h * 34 + 5 * a * s * s * b
    assert activation_bytes_per_layer(s, b, h, a, bytes_per_value=4) == s * b * h * 66 + 9 * a * s * s * b
    fp32_no_dropout = activation_bytes_per_layer(s, b, h, a, bytes_per_value=4, dropout=False)
    assert fp32_no_dropout == s * b * h * 64 + 4 * a * s * s * b


@pytest.mark.parametrize("s, b, h, a", [(128, 4, 256, 4), (256, 2, 128, 8), (64, 8, 512, 8)])
def test_activation_formula_agrees_with_a_simulated_layer(s, b, h, a):
    """One more layer of TinyGPT (fp32, no dropout) saves what the formula says, within 1%.

    The residue is what the formula leaves out: the causal mask (s² bytes) and LayerNorm's mean and
    1/std (2·4·s·b bytes per LayerNorm).
    """

    def activations(n_layers):
        tokens = lambda: (torch.randint(0, 512, (b, s)),) * 2  # noqa: E731 (inputs and targets)
        mt = simulate_training_step(lambda: TinyGPT(512, s, h, n_layers, a), tokens)
        return mt.max_bytes("activations")

    per_layer = activations(3) - activations(2)
    formula = activation_bytes_per_layer(s, b, h, a, bytes_per_value=4, dropout=False)
    print(f"s={s} b={b} h={h} a={a}: measured {per_layer} B, formula {formula} B, ratio {per_layer / formula:.4f}")
    assert per_layer == pytest.approx(formula, rel=0.01)
    assert per_layer - formula == s * s + 2 * (2 * 4 * s * b)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="n_params"):
        adamw_fp32_bytes(0)
    with pytest.raises(ValueError, match="n_params"):
        mixed_precision_adam_bytes(1.5e9)
    with pytest.raises(ValueError, match="k "):
        mixed_precision_adam_bytes(10, k=-1)
    with pytest.raises(ValueError, match="stage"):
        zero_bytes_per_rank(10, 4, stage=4)
    with pytest.raises(ValueError, match="world_size"):
        zero_bytes_per_rank(10, 0, stage=1)
    with pytest.raises(ValueError, match="divisible"):
        activation_bytes_per_layer(128, 1, 100, 3)
    with pytest.raises(ValueError, match="bytes_per_value"):
        activation_bytes_per_layer(128, 1, 96, 3, bytes_per_value=3)
    with pytest.raises(ValueError, match="seq_len"):
        activation_bytes_per_layer(0, 1, 96, 3)


def test_the_grader_passes_a_right_answer_and_fails_a_wrong_one():
    def right(n_params, world_size, stage):
        k = 12
        shards = [
            (2 + 2 + k) * n_params,
            4 * n_params + k * n_params / world_size,
            2 * n_params + (2 + k) * n_params / world_size,
            (2 + 2 + k) * n_params / world_size,
        ]
        return shards[stage]

    def forgets_gradients(n_params, world_size, stage):  # stage 2 shards gradients too
        return right(n_params, world_size, min(stage, 1)) if stage < 3 else right(n_params, world_size, 3)

    assert check_zero_bytes(right)
    assert not check_zero_bytes(forgets_gradients)
    assert not check_zero_bytes(lambda n_params, world_size, stage: 1 / 0)


def test_tensor_sequence_and_context_parallel_follow_table_2():
    # Korthikanti et al. 2022, table 2, per layer in 16-bit with dropout; GPT-3 175B's layer, t = 8
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    none = activation_bytes_per_layer(s, b, h, a)
    tp = activation_bytes_per_layer(s, b, h, a, tensor_parallel=t)
    tp_sp = activation_bytes_per_layer(s, b, h, a, tensor_parallel=t, sequence_parallel=True)
    assert tp == s * b * h * 10 + s * b * h * 24 // t + 5 * a * s * s * b // t  # sbh(10 + 24/t + 5as/(ht))
    assert tp_sp == none // t  # sbh/t (34 + 5as/h)
    print(f"GPT-3 layer: {none / 2**30:.2f} GiB, TP=8 {tp / 2**30:.2f} GiB, TP+SP {tp_sp / 2**30:.2f} GiB")
    # context parallelism: each of c ranks holds s/c tokens and their scores against all s keys
    for c in (2, 4):
        assert activation_bytes_per_layer(s, b, h, a, context_parallel=c) == none // c
        both = activation_bytes_per_layer(s, b, h, a, tensor_parallel=t, sequence_parallel=True, context_parallel=c)
        assert both == none // (t * c)
    # K and V of s/c tokens, two blocks: the one in use and the one arriving
    assert ring_attention_kv_bytes(s, b, h, 4) == 2 * 2 * (s // 4) * b * h * 2


def test_moe_activations_agree_with_the_tracker():
    """One MoE layer (fp32, top-k, nothing dropped) saves v·N·d·(1 + 11k), within 2%.

    The formula's MoE FFN minus the dense FFN is 11k - 8 values per token and feature; a dense FFN
    saves its input and GeLU's input and output, 9 per token and feature, which the tracker confirms
    exactly. The MoE's residue is the router's (N, E) probabilities and its int64 indices.
    """
    from llmedu.nn.activations import FeedForward
    from llmedu.nn.moe import MoE

    n, d, v = 256, 128, 4
    x = torch.randn(n, d, requires_grad=True)
    ffn = FeedForward(d, 4 * d, "gelu", fused=True)
    with MemoryTracker(ffn) as mt:
        ffn(x)
    assert mt.max_bytes("activations") == 9 * v * n * d
    dense = activation_bytes_per_layer(n, 1, d, 4, bytes_per_value=v, dropout=False)
    for k in (1, 2):
        torch.manual_seed(0)
        moe = MoE(d, 4 * d, n_experts=4, top_k=k, capacity_factor=None, fused=True)
        with MemoryTracker(moe) as mt:
            moe(x)
        measured = mt.max_bytes("activations")
        formula = activation_bytes_per_layer(n, 1, d, 4, bytes_per_value=v, dropout=False, moe_top_k=k)
        assert formula - dense == (11 * k - 8) * v * n * d
        print(f"top-{k}: measured {measured} B, formula's FFN part {(1 + 11 * k) * v * n * d} B")
        assert measured == pytest.approx((1 + 11 * k) * v * n * d, rel=0.02)


def test_bad_parallel_degrees_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide n_heads=4"):
        activation_bytes_per_layer(64, 1, 32, 4, tensor_parallel=3)
    with pytest.raises(ValueError, match="context_parallel=3 does not divide seq_len=64"):
        activation_bytes_per_layer(64, 1, 32, 4, context_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel=4 does not divide the 6 tokens per rank"):
        activation_bytes_per_layer(12, 1, 32, 4, tensor_parallel=4, sequence_parallel=True, context_parallel=2)
    with pytest.raises(ValueError, match="context_parallel must be a positive int"):
        activation_bytes_per_layer(64, 1, 32, 4, context_parallel=0)
    with pytest.raises(ValueError, match="not modelled"):
        activation_bytes_per_layer(64, 1, 32, 4, tensor_parallel=2, moe_top_k=2)
    with pytest.raises(ValueError, match="context_parallel=3 does not divide seq_len=64"):
        ring_attention_kv_bytes(64, 1, 32, 3)
