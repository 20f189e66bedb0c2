"""Block-wise 8-bit quantization of Adam's moments (Dettmers et al. 2022) and AdamW8bit.

Bounds used below. After absmax scaling a value y = x / N_b lies in [-1, 1]; the nearest code is at
most half the gap between the two codes around y away, so |x - dequantize(quantize(x))| <= N_b * gap / 2.
The widest gap of the signed map is 0.9/64 = 0.0140625 (the top decade's 64 bins of [0.1, 1]), of the
unsigned map 0.9/128. For small y the gaps, hence the errors, shrink with y (the dynamic type's point).
"""

import copy

import pytest
import torch

from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.optim import AdamW, AdamW8bit, dequantize_blockwise, dynamic_map, quantize_blockwise, state_bytes
from llmedu.train.loop import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")  # many tiny ops: one thread is faster on a busy 2-core CPU

SIGNED, UNSIGNED = dynamic_map(signed=True), dynamic_map(signed=False)
WIDEST_GAP = {True: 0.9 / 64, False: 0.9 / 128}
CONFIG = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
DATA = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))  # (B, T) random tokens


def _heavy_tailed(n, seed=0, signed=True):
    """Values over six decades, like Adam's moments; squared (>= 0) for the unsigned map."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10 ** (-6 * torch.rand(n, generator=g))
    return x if signed else x**2


# -- the code map -----------------------------------------------------------------------------------
@pytest.mark.parametrize("signed", [True, False])
def test_code_map_properties(signed):
    code = dynamic_map(signed)
    assert code.shape == (256,) and code.dtype == torch.float32
    assert (code[1:] > code[:-1]).all()  # sorted, 256 distinct values
    assert (code == 0).sum() == 1 and code.max() == 1.0
    assert torch.diff(code).max().item() == pytest.approx(WIDEST_GAP[signed], rel=1e-4)  # float32 codes
    positive = code[code > 0]
    for e in range(7):  # 2^(6-e) (signed) or 2^(7-e) (unsigned) values in the decade (0.1, 1) * 10^-e
        in_decade = ((positive > 0.1 * 10**-e) & (positive < 10**-e)).sum().item()
        assert in_decade == 2 ** ((6 if signed else 7) - e)
    if signed:  # symmetric, except that the 256th code is +1 and there is no -1 (as in bitsandbytes)
        assert torch.equal(code[code < 0].flip(0), -code[(code > 0) & (code < 1)])
        assert code.min().item() == pytest.approx(-(0.9 * 127 / 128 + 0.1), abs=1e-7)  # -0.99297
    else:
        assert code.min() == 0


def test_code_map_equals_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is not installed (optional)")
    for signed in (True, False):
        assert torch.equal(dynamic_map(signed), bnb.create_dynamic_map(signed=signed))
    x = _heavy_tailed(5000)
    theirs, state = bnb.quantize_blockwise(x, code=SIGNED, blocksize=2048)
    ours, absmax = quantize_blockwise(x, SIGNED, 2048)
    assert torch.equal(absmax, state.absmax)
    # Ours is the exact nearest code, theirs never nearer. They agree on every value of the top decade;
    # below it bitsandbytes' CPU kernel (0.50.2) drifts: 2% of codes differ in [1e-3, 1e-2), 31% in
    # [1e-5, 1e-4), all below 1e-5 (where it returns nonzero codes far from the value).
    scaled = x / absmax.repeat_interleave(2048)[: x.numel()]  # (n,) in [-1, 1]
    assert ((scaled - SIGNED[ours.long()]).abs() <= (scaled - SIGNED[theirs.long()]).abs()).all()
    top = scaled.abs() >= 0.1
    assert top.sum() > 100 and torch.equal(ours[top], theirs[top])


# -- quantize / dequantize ----------------------------------------------------------------------------
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape, block_size", [((5000,), 2048), ((3, 50, 7), 64), ((1,), 2048), ((300,), 7)])
def test_round_trip_is_the_nearest_code_within_the_bound(signed, shape, block_size):
    code = dynamic_map(signed)
    n = torch.Size(shape).numel()
    x = _heavy_tailed(n, signed=signed).view(shape)
    codes, absmax = quantize_blockwise(x, code, block_size)
    assert codes.shape == x.shape and codes.dtype == torch.uint8
    assert absmax.shape == (-(-n // block_size),) and absmax.dtype == torch.float32
    back = dequantize_blockwise(codes, absmax, code, block_size)
    assert back.shape == x.shape

    scale = absmax.repeat_interleave(block_size)[:n].view(shape)  # each element's block absmax
    brute_force = (x.unsqueeze(-1) / scale.unsqueeze(-1) - code).abs().argmin(-1)  # nearest of all 256 codes
    assert torch.equal(codes.long(), brute_force)
    assert ((back - x).abs() <= scale * WIDEST_GAP[signed] / 2 + 1e-7 * scale).all()
    positive_max = (x.abs() == scale) & (x > 0)  # a block's +absmax: code 1.0, stored exactly
    assert torch.equal(back[positive_max], x[positive_max])


def test_zero_blocks_and_empty_tensors():
    x = torch.cat([torch.zeros(2048), torch.randn(10)])
    codes, absmax = quantize_blockwise(x, SIGNED)
    assert absmax[0] == 0 and torch.equal(dequantize_blockwise(codes, absmax, SIGNED)[:2048], torch.zeros(2048))
    codes, absmax = quantize_blockwise(torch.zeros(0), SIGNED)
    assert codes.numel() == 0 and absmax.numel() == 0


@pytest.mark.parametrize("block_size", [0, -2048, 2.5, True, "2048"])
def test_bad_block_sizes_are_clear_errors(block_size):
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        quantize_blockwise(torch.randn(10), SIGNED, block_size)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(3))], block_size=block_size)


def test_mismatched_inputs_are_clear_errors():
    codes, absmax = quantize_blockwise(torch.randn(5000), SIGNED, 2048)  # 3 blocks
    with pytest.raises(ValueError, match="need 20 absmax values"):
        dequantize_blockwise(codes, absmax, SIGNED, 256)
    with pytest.raises(TypeError, match="uint8"):
        dequantize_blockwise(codes.long(), absmax, SIGNED, 2048)
    with pytest.raises(TypeError, match="floating-point"):
        quantize_blockwise(torch.arange(10), SIGNED)
    with pytest.raises(ValueError, match="learning rate"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(3))], lr=-1.0)
    with pytest.raises(ValueError, match="min_8bit_size"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(3))], min_8bit_size=-1)


# -- the optimizer ------------------------------------------------------------------------------------
def _model(config=CONFIG) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(config)


def _losses(model, optimizer, steps):
    losses = []
    for _ in range(steps):
        loss = lm_loss(model(DATA), DATA)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses)


def test_state_memory_is_about_2_bytes_per_parameter():
    config = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=16)
    n = sum(p.numel() for p in _model(config).parameters())
    per_param = {}
    for name, make in [
        ("fp32", lambda ps: AdamW(ps)),
        ("8-bit", lambda ps: AdamW8bit(ps)),
        ("8-bit everything", lambda ps: AdamW8bit(ps, min_8bit_size=0)),
    ]:
        model = _model(config)
        optimizer = make(model.parameters())
        lm_loss(model(DATA), DATA).backward()
        optimizer.step()  # the state exists after the first step
        per_param[name] = state_bytes(optimizer) / n
        if name == "8-bit everything":  # exactly: 1 + 1 byte per element, 2 absmax per block, one step each
            expected = sum(2 * p.numel() + 8 * -(-p.numel() // 2048) + 4 for p in model.parameters())
            assert state_bytes(optimizer) == expected
    assert 8.0 < per_param["fp32"] < 8.01  # 4 + 4 bytes, plus one 4-byte step counter per tensor
    assert 2.0 < per_param["8-bit everything"] < 2.02
    assert 2.0 < per_param["8-bit"] < 2.2  # biases and norms (< 4096 elements) keep fp32 moments


def test_first_step_equals_fp32_adamw():
    """The update uses the fresh fp32 moments; only what is *stored* for the next step is quantized."""
    ref, ours = _model(), _model()
    _losses(ref, AdamW(ref.parameters(), lr=3e-3), 1)
    _losses(ours, AdamW8bit(ours.parameters(), lr=3e-3, min_8bit_size=0), 1)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), ours.parameters()))


def test_training_stays_close_to_fp32_adamw():
    """100 steps, lr 3e-3: the loss falls from 4.17 to ~0.1 nats in both; the curves stay within 0.05 nats.

    Why that tolerance: each stored moment is off by at most ~0.7% of its block's absmax (and far less
    for small values), Adam's update m/sqrt(v) is a ratio that such relative errors barely move, and the
    paper finds 8-bit states match 32-bit ones. Measured max gap: 0.014 nats (block 2048, every tensor
    8-bit); 0.05 leaves room for other CPUs' rounding, and is 1.2% of the 4.07 nats the loss falls.
    """
    ref, ours = _model(), _model()
    fp32 = _losses(ref, AdamW(ref.parameters(), lr=3e-3), 100)
    eight = _losses(ours, AdamW8bit(ours.parameters(), lr=3e-3, min_8bit_size=0), 100)
    assert fp32[-1] < 0.2 and eight[-1] < 0.2  # both learned (memorised the batch)
    assert (fp32 - eight).abs().max() < 0.05


def test_state_dict_round_trip_keeps_codes_and_trajectory():
    straight = _model()
    _losses(straight, AdamW8bit(straight.parameters(), min_8bit_size=0), 10)
    first = _model()
    opt1 = AdamW8bit(first.parameters(), min_8bit_size=0)
    _losses(first, opt1, 5)
    saved = copy.deepcopy(opt1.state_dict())
    second = _model()
    second.load_state_dict(first.state_dict())
    opt2 = AdamW8bit(second.parameters(), min_8bit_size=0)
    opt2.load_state_dict(saved)
    state = next(iter(opt2.state.values()))
    assert state["exp_avg_codes"].dtype == torch.uint8 and state["exp_avg_absmax"].dtype == torch.float32
    _losses(second, opt2, 5)
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), second.parameters()))


def test_our_trainer_runs_and_resumes_exactly_with_it(tmp_path):
    """The checkpoint keeps the uint8 codes and the per-block scales (shapes unlike the parameter's)."""
    loss_fn = lambda m, batch: lm_loss(m(batch), batch)
    straight = _model()
    history = train(
        straight, AdamW8bit(straight.parameters(), lr=3e-3), lambda i: DATA, loss_fn, TrainConfig(8, progress=False)
    )
    assert history["loss"][-1] < history["loss"][0]
    first = _model()
    config = TrainConfig(4, checkpoint_dir=tmp_path, progress=False)
    train(first, AdamW8bit(first.parameters(), lr=3e-3), lambda i: DATA, loss_fn, config)
    resumed = _model()
    config = TrainConfig(8, checkpoint_dir=tmp_path, progress=False)
    train(resumed, AdamW8bit(resumed.parameters(), lr=3e-3), lambda i: DATA, loss_fn, config, resume=True)
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), resumed.parameters()))


def test_state_of_another_block_size_is_refused_before_anything_changes(tmp_path):
    """2048 and 2400 give the same number of blocks for 10,000 elements: only the recorded size tells them apart."""
    weight = torch.nn.Parameter(torch.randn(10_000))
    saving = AdamW8bit([weight], block_size=2048, min_8bit_size=0)
    weight.grad = torch.randn(10_000)
    saving.step()
    saved = copy.deepcopy(saving.state_dict())
    assert saved["state"][0]["block_size"] == 2048
    loading = AdamW8bit([weight], block_size=2400, min_8bit_size=0)
    with pytest.raises(ValueError, match="quantized in blocks of 2048 elements.*block_size=2400.*block_size=2048"):
        loading.load_state_dict(saved)
    assert not loading.state  # nothing loaded
    del saved["state"][0]["block_size"]  # state saved before the size was recorded: the block count is checked
    with pytest.raises(ValueError, match="has 5 blocks for 10000 elements, block_size=1000 makes 10"):
        AdamW8bit([weight], block_size=1000, min_8bit_size=0).load_state_dict(saved)
    with pytest.warns(UserWarning, match="records no block_size: not checked"):
        AdamW8bit([weight], block_size=2400, min_8bit_size=0).load_state_dict(saved)  # 5 blocks either way

    # and through a checkpoint: resuming with another block size is an error, not 20% off second moments
    loss_fn = lambda m, batch: lm_loss(m(batch), batch)
    first = _model()
    train(
        first,
        AdamW8bit(first.parameters(), block_size=2048),
        lambda i: DATA,
        loss_fn,
        TrainConfig(2, checkpoint_dir=tmp_path, progress=False),
    )
    other = _model()
    with pytest.raises(ValueError, match="quantized in blocks of 2048 elements"):
        config = TrainConfig(4, checkpoint_dir=tmp_path, progress=False)
        train(other, AdamW8bit(other.parameters(), block_size=2400), lambda i: DATA, loss_fn, config, resume=True)
