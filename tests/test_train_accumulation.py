"""fp32 accumulation and TF32: the bf16 stall point in closed form, TF32 rounding, matmul errors."""

import math

import pytest
import torch

from llmedu.train.accumulation import matmul_errors, round_to_tf32, running_sum, stall_point


def test_bf16_running_sum_stalls_where_the_closed_form_says():
    v = torch.tensor(1e-3, dtype=torch.bfloat16).item()  # 0.00099945068359375, in (2**-10, 2**-9)
    assert stall_point(1e-3) == 0.5  # 2**(floor(log2 v) + 9)
    assert running_sum(1e-3, 10_000, torch.bfloat16) == 0.5  # not 9.99: stuck after ~500 additions
    assert running_sum(1e-3, 10_000, torch.float32) == 10_000 * v  # fp32 sums 8-bit values exactly here
    assert running_sum(2**-10, 10_000, torch.bfloat16) == stall_point(2**-10) == 2**-2  # ties round to even
    assert running_sum(1e-4, 100_000, torch.float16, torch.float16) == stall_point(1e-4, torch.float16)


@pytest.mark.parametrize("value", [3e-3, 0.1, 7.0, 1e-5])
def test_stall_point_for_other_values(value):
    v = torch.tensor(value, dtype=torch.bfloat16).item()
    n = int(2 * stall_point(value) / v)  # twice as many additions as reaching the stall point needs
    assert running_sum(value, n, torch.bfloat16) == stall_point(value)


def test_accumulation_bad_input():
    with pytest.raises(ValueError, match="n must be"):
        running_sum(1.0, -1, torch.float32)
    with pytest.raises(ValueError, match="positive"):
        stall_point(0.0)
    with pytest.raises(ValueError, match="knows"):
        stall_point(1.0, torch.int8)


def test_tf32_rounding_keeps_10_mantissa_bits_and_rounds_half_to_even():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * torch.exp(torch.randn(100_000, generator=g) * 5)
    t = round_to_tf32(x)
    assert (t.view(torch.int32) & 0x1FFF == 0).all()  # the low 23 - 10 = 13 mantissa bits are zero
    assert ((t - x).abs() <= x.abs() * 2.0**-11).all()  # at most half a TF32 ulp away
    # fp16 also has 10 mantissa bits: inside its normal range the two roundings must agree bit for bit
    normal = (x.abs() >= 2.0**-14) & (x.abs() <= 60000)
    assert normal.sum() > 50_000
    assert torch.equal(t[normal], x[normal].half().float())
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 1 + 2**-11 + 2**-23])
    assert round_to_tf32(ties).tolist() == [1.0, 1 + 2**-9, -1.0, 1 + 2**-10]  # even, even, even, above the tie
    special = round_to_tf32(torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 3.4028235e38]))
    assert special[:2].tolist() == [math.inf, -math.inf] and special[2].isnan()
    assert special[3:5].view(torch.int32).tolist() == [0, -(2**31)] and special[5].item() == math.inf


def test_matmul_errors_match_the_rounding_estimate():
    errors = matmul_errors(sizes=(64, 256))
    rms = math.sqrt(3 / (8 * math.log(2)) / 12)  # rms relative rounding error per input, in units of 2**-m
    for n, e in errors.items():
        assert e["fp32"] < 1e-6  # fp32 accumulation alone: ~1e-7
        assert e["tf32"] == pytest.approx(math.sqrt(2) * rms * 2.0**-10, rel=0.1), n
        assert e["bf16"] == pytest.approx(math.sqrt(2) * rms * 2.0**-7, rel=0.1), n
        assert e["tf32 vs fp32"] == pytest.approx(e["tf32"], rel=0.01)  # the input rounding dominates
