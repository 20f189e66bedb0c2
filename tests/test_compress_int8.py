"""Integer quantization: error bounds per scheme, and our dynamic int8 model against torch.ao's.

torch.ao.quantization.quantize_dynamic is the production reference: with the same scheme (8-bit
symmetric weights, 7-bit asymmetric dynamic activations) and the same rounding, both produce the same
integer codes, so the outputs agree to float32 rounding of the final rescale (measured ~1e-6 on
MiniLM's last hidden state, whose entries reach ~6) while each is ~1 away from fp32.
"""

import copy
import warnings

import pytest
import torch
from torch import nn

from llmedu.compress.finetuned import new_classifier, rotten_tomatoes
from llmedu.compress.int8 import (
    QuantLinear,
    dequantize,
    int8_matmul,
    qrange,
    quantize,
    quantize_linears,
    quantize_per_call,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # many small ops on a busy 2-core CPU


@pytest.mark.parametrize("bits", [2, 4, 7, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("axis", [None, 0])
def test_round_trip_error_is_at_most_half_a_step(bits, symmetric, axis):
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(bits)) * 3 + (0 if symmetric else 1)
    q, scale, zero_point = quantize(x, bits, symmetric, axis)
    qmin, qmax = qrange(bits, symmetric)
    assert q.dtype == (torch.int8 if symmetric else torch.uint8)
    assert int(q.min()) >= qmin and int(q.max()) <= qmax
    assert scale.shape == ((1, 1) if axis is None else (16, 1))
    err = (dequantize(q, scale, zero_point) - x).abs()
    # every value lies inside [min, max], so it is at most half a step from a code (the symmetric
    # +absmax sits exactly half a step above code 127); plus 4 float32 ulps of |x| for the rounding
    assert (err <= scale / 2 + 4 * torch.finfo(torch.float32).eps * x.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantize_leaves_its_input_unchanged(dtype):
    # quantize works in place on a float64 copy; a float64 input must not be that copy
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0), dtype=dtype) * 2 - 0.5
    before = x.clone()
    for symmetric in (True, False):
        quantize(x, 8, symmetric, axis=0)
    assert torch.equal(x, before)


def test_per_channel_beats_per_tensor_with_one_large_row():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    w[0] *= 50  # one output channel of large weights
    errors = {}
    for axis in (None, 0):
        q, s, z = quantize(w, 8, True, axis)
        errors[axis] = (dequantize(q, s, z) - w)[1:].abs().mean().item()  # the other rows
    assert errors[0] < errors[None] / 20


def test_zero_is_exact_and_asymmetric_uses_the_whole_range():
    x = torch.tensor([[0.0, 0.3, 1.7, 2.5]])  # all >= 0: asymmetric spends no code on negatives
    q, s, z = quantize(x, 8, symmetric=False)
    assert dequantize(q, s, z)[0, 0] == 0.0
    assert int(q.max()) == 255 and int(z) == 0
    q, s, z = quantize(x, 8, symmetric=True)
    assert int(q.max()) == 127 and int(q.min()) == 0  # half the symmetric codes are never used here


def test_int8_matmul_is_exact():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (5, 300), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (300, 7), generator=g, dtype=torch.int8)
    assert torch.equal(int8_matmul(a, b), (a.long() @ b.long()).int())


def test_quant_linear_matches_torch_dynamic_linear_exactly_in_codes():
    torch.manual_seed(0)
    linear = nn.Linear(48, 24)
    x = torch.randn(3, 5, 48) * 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated in favour of torchao
        theirs = torch.ao.quantization.quantize_dynamic(nn.Sequential(linear), {nn.Linear}, dtype=torch.qint8)[0]
    ours = QuantLinear.from_linear(linear)
    assert torch.equal(ours.weight_q, theirs.weight().int_repr())
    assert (ours(x) - theirs(x)).abs().max() < 1e-5  # same codes; float32 rounding of the rescale only
    assert (ours(x) - linear(x)).abs().max() > 1e-3  # and it is a quantized layer: not the fp32 one


def test_per_call_codes_round_once_as_torchs_quantizer_does():
    # Values within a few float32 steps of the ties x / s + z = k + 1/2, where the order of rounding decides
    # the code: computing x * (1/s) + z in two rounded steps picks another code for some of them.
    ends = torch.tensor([-3.0, 5.0])  # they fix the range, hence s and z
    _, scale, zero_point = quantize(ends, bits=7, symmetric=False)
    ties = ((torch.arange(128, dtype=torch.float64) + 0.5 - float(zero_point)) * float(scale)).float()
    near = [ties]
    for direction in (1e9, -1e9):
        x = ties
        for _ in range(64):
            x = torch.nextafter(x, torch.full_like(x, direction))
            near.append(x)
    x = torch.cat([ends, *near])
    x = x[(x >= -3.0) & (x <= 5.0)]
    ours, s, z = quantize_per_call(x, bits=7)
    assert torch.equal(s, scale) and torch.equal(z, zero_point)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated; here they are the reference
        theirs = torch.quantize_per_tensor(x, float(scale), int(zero_point), torch.quint8).int_repr()
    assert torch.equal(ours, theirs.to(torch.int8))  # fbgemm's quantizer, code for code
    assert torch.equal(ours, quantize(x, bits=7, symmetric=False)[0].to(torch.int8))  # and the float64 steps
    twice = (x * float(1.0 / scale) + zero_point).round_().clamp_(0, 127).to(torch.int8)
    assert (twice != ours).sum() > 0  # the values do tell one rounding from two


def test_per_call_codes_equal_quantize_on_activations():
    torch.manual_seed(0)
    for shape, spread, shift in [((64, 384), 1.0, 0.0), ((33, 1536), 7.0, 2.5), ((5, 8), 0.01, -1.0)]:
        x = torch.randn(shape) * spread + shift
        q, s, z = quantize_per_call(x)
        ref, s_ref, z_ref = quantize(x, bits=7, symmetric=False)
        assert q.dtype == torch.int8 and torch.equal(q, ref.to(torch.int8))
        assert torch.equal(s, s_ref) and torch.equal(z, z_ref)
    with pytest.raises(ValueError, match="bits must be 2..7"):
        quantize_per_call(torch.randn(4, 4), bits=8)  # codes up to 255 do not fit int8
    with pytest.raises(ValueError, match="non-empty floating-point"):
        quantize_per_call(torch.ones(4, 4, dtype=torch.int32))


@pytest.fixture(scope="module")
def minilm_and_batch():
    torch.manual_seed(0)
    model = new_classifier(num_hidden_layers=2).eval()
    return model, rotten_tomatoes("validation", batch_size=8, max_len=32)[0]


@pytest.mark.slow  # loads MiniLM: ~10 s on a busy 2-core machine
@pytest.mark.parametrize("per_channel", [False, True])
def test_our_dynamic_int8_minilm_matches_torch_ao(minilm_and_batch, per_channel):
    model, batch = minilm_and_batch
    ours = copy.deepcopy(model)
    names = quantize_linears(ours, per_channel=per_channel)
    assert len(names) == 2 * 6 + 2  # 6 linears per layer, the pooler and the classifier
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig if per_channel else None
    spec = {nn.Linear: qconfig} if per_channel else {nn.Linear}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), spec, dtype=torch.qint8)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        fp32 = model.bert(**inputs).last_hidden_state[mask]
        a = ours.bert(**inputs).last_hidden_state[mask]
        b = theirs.bert(**inputs).last_hidden_state[mask]
        logits_a, logits_b = ours(**inputs).logits, theirs(**inputs).logits
    # 1e-4: the same integer codes in every layer; what differs is float32 summation order in the
    # rescale (~1e-6 per layer), which a few layers may amplify. The quantization error itself is ~1e-1.
    assert (a - b).abs().max() < 1e-4
    assert (logits_a - logits_b).abs().max() < 1e-4
    assert (a - fp32).abs().max() > 1e-2


def test_bad_input_gets_a_clear_error():
    x = torch.randn(4, 4)
    for bits in (1, 9, 16, 4.0, True):
        with pytest.raises(ValueError, match="bits must be one of"):
            quantize(x, bits=bits)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        quantize(x, axis=2)
    with pytest.raises(TypeError, match="integer codes"):
        dequantize(x, torch.ones(1), torch.zeros(1))
    with pytest.raises(TypeError, match="int8 operands"):
        int8_matmul(torch.ones(2, 2, dtype=torch.int32), torch.ones(2, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\(M, K\) @ \(K, N\)"):
        int8_matmul(torch.ones(2, 3, dtype=torch.int8), torch.ones(2, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match="expected inputs with 8 features"):
        QuantLinear.from_linear(nn.Linear(8, 4))(torch.randn(2, 7))
    with pytest.raises(TypeError, match="quantizes an nn.Linear"):
        QuantLinear.from_linear(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_linears(nn.Sequential(nn.ReLU()))
