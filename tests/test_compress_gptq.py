"""GPTQ: on the same weights and the same grid, it lowers the layer's output error below RTN's; its codes
are stored packed (``PackedLinear``) and read back exactly."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from llmedu.compress.gptq import (
    PackedLinear,
    gptq_codes,
    gptq_quantize,
    hessian,
    layer_error,
    rtn_codes,
    rtn_quantize,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # many small ops on a busy 2-core CPU


def correlated_inputs(n=512, d=64, seed=0):
    """Inputs whose features are correlated (as real activations are): X = Z A, Z ~ N(0, 1) drawn with
    ``seed``, the mixing A the same for every seed (one distribution, several samples)."""
    mixing = torch.randn(d, d, generator=torch.Generator().manual_seed(1234)) / d**0.5  # (d, d)
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) @ mixing


def test_hessian_is_twice_the_mean_outer_product():
    x = correlated_inputs(n=10, d=4)
    assert torch.allclose(hessian(x.view(2, 5, 4)), 2 * x.double().t() @ x.double() / 10)


def test_gptq_is_rtn_when_the_inputs_are_uncorrelated():
    # H = 2 I / d: its inverse's Cholesky factor is diagonal, so no error is pushed to other columns
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    x = torch.eye(48) * 3.0
    assert torch.equal(gptq_quantize(w, x, bits=4), rtn_quantize(w, bits=4))


@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_beats_rtn_on_held_out_inputs(bits):
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(2)) * 0.1
    calib, held_out = correlated_inputs(seed=3), correlated_inputs(seed=4)
    q, r = gptq_quantize(w, calib, bits=bits), rtn_quantize(w, bits=bits)
    # the same grid: every GPTQ value is one of RTN's codes for its row
    scale = (w.max(1, keepdim=True).values.clamp(min=0) - w.min(1, keepdim=True).values.clamp(max=0)) / (2**bits - 1)
    assert torch.allclose((q - r) / scale, ((q - r) / scale).round(), atol=1e-3)
    # measured on these inputs: GPTQ's error ~0.55x RTN's; ask for 0.8x on inputs it never saw
    assert layer_error(w, q, held_out) < 0.8 * layer_error(w, r, held_out)
    assert layer_error(w, q, calib) < layer_error(w, r, calib)


def test_lazy_batches_do_not_change_the_result():
    w = torch.randn(16, 40, generator=torch.Generator().manual_seed(5))
    x = correlated_inputs(d=40, seed=6)
    # the lazy update is the same sum in another order: float64 keeps the codes identical
    assert torch.equal(gptq_quantize(w, x, block_size=1), gptq_quantize(w, x, block_size=7))
    assert torch.equal(gptq_quantize(w, x, block_size=1), gptq_quantize(w, x, block_size=128))


def test_a_dead_input_column_is_zeroed():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    x = correlated_inputs(d=16)
    x[:, 3] = 0
    assert (gptq_quantize(w, x)[:, 3] == 0).all()


@pytest.mark.slow  # loads MiniLM and runs GPTQ on a 384 x 384 layer: ~15 s on a busy 2-core machine
def test_gptq_beats_rtn_on_a_real_minilm_layer():
    from llmedu.compress.finetuned import new_classifier, rotten_tomatoes

    torch.manual_seed(0)
    model = new_classifier(num_hidden_layers=1).eval()
    layer = model.bert.encoder.layer[0].attention.self.query
    seen = []
    handle = layer.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    data = rotten_tomatoes("train", batch_size=32, max_len=48)
    masks = []
    with torch.no_grad():
        for i in range(4):
            b = data[i]
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
            masks.append(b["attention_mask"].bool())
    handle.remove()
    tokens = [x[m] for x, m in zip(seen, masks)]  # real tokens only
    calib, held_out = torch.cat(tokens[:2]), torch.cat(tokens[2:])
    q, r = gptq_quantize(layer.weight, calib, bits=4), rtn_quantize(layer.weight, bits=4)
    # GPTQ needs calibration tokens well beyond d_in = 384: with ~900 it measured 0.88x RTN's held-out
    # error, with ~1,700 (here) 0.7x. Ask for 0.85x.
    assert layer_error(layer.weight, q, held_out) < 0.85 * layer_error(layer.weight, r, held_out)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_packed_linear_stores_the_codes_and_reads_them_back_exactly(bits, symmetric):
    torch.manual_seed(0)
    linear = nn.Linear(7, 5)  # 35 codes: not a multiple of 2 or 4, so the last byte is padded
    codes, scale, zero_point = rtn_codes(linear.weight, bits, symmetric)
    layer = PackedLinear.rtn(linear, bits, symmetric)
    assert layer.packed.dtype == torch.uint8 and layer.packed.numel() == math.ceil(35 * bits / 8)
    qmin = -(2 ** (bits - 1)) if symmetric else 0
    assert torch.equal(layer.codes().double(), codes - qmin)  # stored unsigned, the grid's offset removed
    assert torch.equal(layer.zero_point.double(), zero_point - qmin)
    assert torch.equal(layer.dequantized_weight(), rtn_quantize(linear.weight, bits, symmetric))
    x = torch.randn(3, 4, 7)
    assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight(), linear.bias))


def test_packed_gptq_layer_holds_gptq_codes_on_rtn_grid():
    w = torch.randn(16, 40, generator=torch.Generator().manual_seed(8))
    x = correlated_inputs(d=40, seed=9)
    linear = nn.Linear(40, 16)
    with torch.no_grad():
        linear.weight.copy_(w)
    codes, scale, zero_point = gptq_codes(w, x, bits=4)
    assert torch.equal(scale, rtn_codes(w, bits=4)[1]) and torch.equal(codes, codes.round())
    layer = PackedLinear.gptq(linear, x, bits=4)
    assert torch.equal(layer.dequantized_weight(), gptq_quantize(w, x, bits=4))
    assert not torch.equal(layer.codes().double(), rtn_codes(w, bits=4)[0])  # other codes than rounding's


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 4, 8\)"):
        PackedLinear.rtn(nn.Linear(4, 4), bits=3)  # 3-bit codes do not fill a byte
    with pytest.raises(ValueError, match=r"must lie in \[0, 15\]"):
        PackedLinear(torch.full((2, 2), 16.0), torch.ones(2, 1), torch.zeros(2, 1), None, bits=4)
    with pytest.raises(ValueError, match="expected inputs with 4 features"):
        PackedLinear.rtn(nn.Linear(4, 4))(torch.ones(2, 3))
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"weight must be \(d_out, d_in\) and x \(..., d_in\)"):
        gptq_quantize(w, torch.randn(4, 15))
    with pytest.raises(ValueError, match="bits must be one of"):
        gptq_quantize(w, torch.randn(4, 16), bits=16)
    with pytest.raises(ValueError, match="damp is a fraction"):
        gptq_quantize(w, torch.randn(4, 16), damp=1.5)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        gptq_quantize(w, torch.randn(4, 16), block_size=0)
