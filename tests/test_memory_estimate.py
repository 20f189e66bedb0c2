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
