"""Mixed precision: our loss scaler against torch.amp.GradScaler, master weights, number formats."""

import math

import pytest
import torch

from llmedu.train import LossScaler, MasterWeights, Precision, TrainConfig, train
from llmedu.train.precision import bit_pattern, format_info

INF, NAN = float("inf"), float("nan")
# A scripted gradient sequence: clean streaks long enough to grow, overflows (inf) and NaNs.
SCRIPT = [1.0, 1.0, 1.0, INF, 1.0, 1.0, 1.0, 1.0, NAN, INF, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, INF, 1.0]


def replay(make_scaler, scale_of):
    """Run SCRIPT through a scaler; record the scale before each step and whether the weight moved."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = make_scaler()
    scales, stepped = [], []
    for g in SCRIPT:
        scales.append(scale_of(scaler))
        before = p.detach().clone()
        loss = (p * torch.tensor([g, 1.0, 2.0, 3.0])).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        stepped.append(not torch.equal(before, p.detach()))
    return scales, stepped, p.detach()


def test_scaler_makes_the_same_decisions_as_grad_scaler():
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = replay(lambda: LossScaler(**kw), lambda s: s.scale_value)
    theirs = replay(lambda: torch.amp.GradScaler("cpu", **kw), lambda s: s.get_scale())
    assert ours[0] == theirs[0]  # the scale before every step: exactly (powers of two)
    assert ours[1] == theirs[1]  # skipped exactly when GradScaler skipped
    assert torch.equal(ours[2], theirs[2])  # and the same final weights, bit for bit
    assert (
        ours[1].count(False) == 4 and max(ours[0]) > 2.0**10 and min(ours[0]) < 2.0**10
    )  # the script did exercise both


def test_scaler_misuse_and_state():
    s = LossScaler(init_scale=8.0, growth_interval=2)
    with pytest.raises(RuntimeError, match="update"):
        s.update()
    with pytest.raises(ValueError):
        LossScaler(backoff_factor=1.5)
    s.load_state_dict({"scale": 4.0, "clean_steps": 1})
    assert s.state_dict() == {"scale": 4.0, "clean_steps": 1}


def test_fp16_underflow_and_why_scaling_helps():
    tiny = torch.tensor(1e-8)  # a gradient below fp16's smallest subnormal (6e-8)
    assert tiny.half().item() == 0.0
    assert (tiny * 2**16).half().float().item() / 2**16 == pytest.approx(1e-8, rel=1e-3)
    assert torch.tensor(70000.0).half().isinf()  # above fp16's max, 65504


def test_unscale_refuses_fp16_gradients_and_keeps_fp32_ones():
    """A true gradient of 2^-30, scaled by 2^16 to 2^-14 (in fp16's range): unscaled in fp16 it would come back 0."""
    scaled = torch.tensor([2.0**-30 * 2**16])
    p16 = torch.nn.Parameter(torch.zeros(1, dtype=torch.float16))
    p16.grad = scaled.half()
    scaler = LossScaler(init_scale=2.0**16)
    with pytest.raises(ValueError, match="fp16 gradient of shape"):
        scaler.unscale_(torch.optim.SGD([p16], lr=1.0))
    assert p16.grad.item() == 2.0**-14  # refused before anything changed
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):  # as GradScaler does
        gs = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        gs.scale(torch.zeros(()))
        gs.unscale_(torch.optim.SGD([p16], lr=1.0))
    p32 = torch.nn.Parameter(torch.zeros(1))  # the fp32 path: autocast's parameters, or MasterWeights' copies
    p32.grad = p16.grad.float()
    assert LossScaler(init_scale=2.0**16).unscale_(torch.optim.SGD([p32], lr=1.0)) is False
    assert p32.grad.item() == 2.0**-30


def test_master_weights_keep_small_updates_that_fp16_rounds_away():
    """w = 1 and 400 updates of -1e-4: fp16 weights cannot move (spacing near 1 is 2^-10 ~ 1e-3),
    fp32 masters accumulate them: 1 - 0.04 = 0.96 up to fp16 rounding of the final copy."""

    def run(with_masters):
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(model.weight)
        masters = MasterWeights(model, torch.float16) if with_masters else None
        if not with_masters:
            model.half()
        opt = torch.optim.SGD(masters.params if masters else model.parameters(), lr=1e-4)
        for _ in range(400):
            loss = model(torch.ones(1, 1, dtype=torch.float16)).sum()  # d loss / d w = 1
            loss.backward()
            if masters:
                masters.grads_to_master()
            opt.step()
            opt.zero_grad()
            if masters:
                masters.master_to_model()
        return model.weight.item(), (masters.params[0].item() if masters else None)

    naive, _ = run(False)
    fp16_copy, master = run(True)
    assert naive == 1.0  # every update was rounded away
    # fp32 rounds each of the 400 updates by at most half an ulp near 1 (6e-8): 2.4e-5 at worst
    assert master == pytest.approx(0.96, abs=2.4e-5)
    assert fp16_copy == pytest.approx(0.96, abs=2**-11)  # the 16-bit copy, rounded to fp16


def test_master_weights_dtypes_and_bad_input():
    model = torch.nn.Linear(3, 3)
    masters = MasterWeights(model, torch.bfloat16)
    assert model.weight.dtype == torch.bfloat16 and all(m.dtype == torch.float32 for m in masters.params)
    with pytest.raises(ValueError, match="16-bit"):
        MasterWeights(torch.nn.Linear(2, 2), torch.float64)
    with pytest.raises(ValueError, match="fp32 model"):
        MasterWeights(model, torch.float16)  # already bf16: the masters would not be exact


def test_number_formats():
    assert bit_pattern(1.0, torch.float16) == "0 01111 0000000000"
    assert bit_pattern(1.0, torch.bfloat16) == "0 01111111 0000000"
    assert bit_pattern(-2.0, torch.float32) == "1 10000000 " + "0" * 23
    assert bit_pattern(65504.0, torch.float16) == "0 11110 1111111111"  # fp16's largest number
    fp16, bf16 = format_info(torch.float16), format_info(torch.bfloat16)
    assert fp16["max"] == 65504.0 and fp16["smallest subnormal"] == 2.0**-24
    assert bf16["smallest subnormal"] == 2.0**-133 and bf16["max"] == torch.finfo(torch.float32).max * (1 - 2**-8) / (
        1 - 2**-24
    )
    assert torch.tensor(fp16["smallest subnormal"] / 2, dtype=torch.float32).half().item() == 0.0


def test_unknown_precision_is_an_error():
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        Precision("fp8")
    with pytest.raises(ValueError, match="unknown precision"):
        TrainConfig(max_steps=1, precision="half")


def test_fp16_training_skips_overflowing_steps_and_backs_off():
    """A loss scale of 2^40 overflows fp16; the trainer must skip and halve until gradients fit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    policy = Precision("fp16", LossScaler(init_scale=2.0**40, growth_interval=1000))
    config = TrainConfig(max_steps=60, precision=policy, progress=False)
    history = train(
        model, opt, lambda i: (x, y), lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1]), config
    )
    skipped, scales = history["skipped"], history["loss_scale"]
    assert skipped[0] and not skipped[-1]
    assert all(b == a / 2 for a, b, s in zip(scales, scales[1:], skipped) if s)  # back off on every overflow
    assert all(b == a for a, b, s in zip(scales, scales[1:], skipped) if not s)  # no growth within 1000 steps
    assert scales[-1] * 65504 < 2.0**40  # it came down to where fp16 holds the gradients
    assert math.isfinite(history["loss"][-1]) and history["loss"][-1] < history["loss"][skipped.index(False)]


def test_bf16_autocast_trains_like_fp32():
    """bf16 keeps about 3 significant digits: the first loss agrees with fp32's to 1%, and training works."""
    losses = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
        x, y = (
            torch.randn(128, 16, generator=torch.Generator().manual_seed(1)),
            torch.randn(128, 1, generator=torch.Generator().manual_seed(2)),
        )
        h = train(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            lambda i: (x, y),
            lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1]),
            TrainConfig(max_steps=30, precision=precision, progress=False),
        )
        assert model[0].weight.dtype == torch.float32  # autocast leaves the weights (the masters) in fp32
        losses[precision] = h["loss"]
    assert losses["bf16"][0] == pytest.approx(losses["fp32"][0], rel=1e-2)
    assert losses["bf16"][0] != losses["fp32"][0]  # bf16 did compute something in 16 bits
    assert losses["bf16"][-1] < 0.8 * losses["bf16"][0]
