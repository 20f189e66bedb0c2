"""fp8 and bf16 gradients against fp32's on one fp32 trajectory; current scaling."""

import pytest
import torch

from llmedu.models.config import TransformerConfig
from llmedu.models.gpt import CausalLM
from llmedu.train.fp8 import DelayedScaling
from llmedu.train.fp8_gradients import GRADIENT_VARIANTS, CurrentScaling, gradient_errors, use_current_scaling
from llmedu.train.fp8_run import compare_precisions

SMALL = dict(batch=4, seq_len=32, d_model=32, n_heads=2, n_layers=1)


def test_current_scaling_does_not_overflow_on_a_spike_that_delayed_scaling_clips():
    spike = [1.0, 1.0, 10.0, 1.0]
    delayed, current = DelayedScaling("e5m2"), CurrentScaling("e5m2")
    g = torch.Generator().manual_seed(0)
    for amax in spike:
        x = torch.randn(1000, generator=g) * amax
        delayed.quantize(x)
        q = current.quantize(x)
        assert q.data.abs().max() <= 57344 and q.scale * float(x.abs().max()) <= 57344 * (1 + 1e-6)
    assert delayed.overflows > 0 and current.overflows == 0


def test_current_scaling_never_counts_the_amax_itself_as_an_overflow():
    g = torch.Generator().manual_seed(1)
    for fmt in ("e4m3", "e5m2"):
        scaling = CurrentScaling(fmt)
        for _ in range(300):  # amaxes whose fp32 product with fmax / amax rounds up past fmax, among others
            scaling.quantize(torch.randn(64, generator=g) * torch.exp2(torch.empty(1).uniform_(-30, 30, generator=g)))
        assert scaling.overflows == 0, fmt


def test_use_current_scaling_needs_fp8_layers():
    with pytest.raises(ValueError, match="convert_to_fp8"):
        use_current_scaling(CausalLM(TransformerConfig(d_model=32, n_heads=2, n_layers=1, max_seq_len=32)))


def test_gradient_errors_follow_the_fp32_run_and_rank_bf16_closer_than_fp8():
    out = gradient_errors(steps=4, **SMALL)
    reference = compare_precisions(steps=4, precisions=("fp32",), **SMALL)  # the shadows do not move the weights
    assert out["loss"] == reference["losses"]["fp32"]
    for step in range(4):
        assert out["rel_error"]["bf16"][step] < min(out["rel_error"][v][step] for v in ("fp8 delayed", "fp8 current"))
        assert all(0.8 < out["cosine"][v][step] <= 1 + 1e-12 for v in GRADIENT_VARIANTS)
    assert out["fp8_steps"]["fp8 delayed"][0]["grad"]["underflows"] > 0  # step 0 casts at scale 1
    assert all(s[k]["overflows"] == 0 for s in out["fp8_steps"]["fp8 current"] for k in s)
    with pytest.raises(ValueError, match="steps"):
        gradient_errors(steps=0)


def test_gradient_errors_measure_sampling_noise_and_the_embeddings_share_without_moving_the_run():
    out = gradient_errors(steps=3, **SMALL)
    reference = compare_precisions(steps=3, precisions=("fp32",), **SMALL)
    assert out["loss"] == reference["losses"]["fp32"]  # the extra batch B' changes nothing in the trajectory
    assert len(out["noise"]) == 3 and all(0.05 < n < 10 for n in out["noise"])  # another batch: a different gradient
    for v in GRADIENT_VARIANTS:
        assert len(out["embedding_share"][v]) == 3 and all(0 < s < 1 for s in out["embedding_share"][v])
