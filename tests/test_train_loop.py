"""The trainer: accumulation equals the big batch, exact resume, safe checkpoints, clear errors."""

import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.train import CheckpointError, TrainConfig, log_to, train
from llmedu.train import checkpoint as ckpt
from llmedu.train.schedules import warmup_cosine
from llmedu.viz import LiveMonitor

TINY = TransformerConfig.gpt2(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)


def mlp(norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    middle = nn.BatchNorm1d(32) if norm else nn.Identity()
    return nn.Sequential(nn.Linear(8, 32), middle, nn.GELU(), nn.Linear(32, 1))


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def gpt_loss(model, ids):
    return lm_loss(model(ids), ids)


def one_update(model, data, loss_fn, accumulation):
    """The change of every parameter after one SGD step with lr=1: minus the gradient."""
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    micro = len(data[0] if isinstance(data, tuple) else data) // accumulation
    batches = lambda i: (
        tuple(t[i * micro : (i + 1) * micro] for t in data)
        if isinstance(data, tuple)
        else data[i * micro : (i + 1) * micro]
    )
    train(model, opt, batches, loss_fn, TrainConfig(max_steps=1, accumulation=accumulation, progress=False))
    return [b - p.detach() for b, p in zip(before, model.parameters())]


def test_accumulation_equals_the_big_batch():
    data = (
        torch.randn(32, 8, generator=torch.Generator().manual_seed(1)),
        torch.randn(32, 1, generator=torch.Generator().manual_seed(2)),
    )
    big = one_update(mlp(), data, mse, 1)
    for k in (2, 4, 8):
        # the same sum of per-sample gradients in another order: fp32 rounding, far below 1e-6
        for a, b in zip(one_update(mlp(), data, mse, k), big):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_accumulation_equals_the_big_batch_for_our_gpt():
    ids = torch.randint(0, 50, (8, 16), generator=torch.Generator().manual_seed(3))  # (B, T)

    def fresh():
        torch.manual_seed(0)
        return CausalLM(TINY)

    big = one_update(fresh(), ids, gpt_loss, 1)
    small = one_update(fresh(), ids, gpt_loss, 4)
    for a, b in zip(small, big):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_accumulation_can_grow_with_the_step():
    """k = step -> 1, 2, 3: each step reads the next k micro-batches and follows the mean of their gradients."""
    torch.manual_seed(0)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(6)]  # 1 + 2 + 3 micro-batches
    model, reference = mlp(), mlp()
    seen = []

    def batches(i):
        seen.append(i)
        return data[i]

    history = train(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        batches,
        mse,
        TrainConfig(max_steps=3, accumulation=lambda step: step + 1, progress=False),
    )
    assert seen == list(range(6)) and history["tokens"] == [4 * 8, 8 * 8, 12 * 8]
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for group in ([0], [1, 2], [3, 4, 5]):  # by hand: the mean loss over the step's micro-batches
        x, y = torch.cat([data[i][0] for i in group]), torch.cat([data[i][1] for i in group])
        mse(reference, (x, y)).backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="accumulation must be an int >= 1"):
        train(
            mlp(),
            torch.optim.SGD(mlp().parameters(), lr=0.1),
            batches,
            mse,
            TrainConfig(max_steps=2, accumulation=lambda step: 0, progress=False),
        )


def test_accumulation_differs_with_batchnorm():
    """BatchNorm normalises with the statistics of the batch it sees: a micro-batch's, not the big one's."""
    data = (
        torch.randn(32, 8, generator=torch.Generator().manual_seed(1)),
        torch.randn(32, 1, generator=torch.Generator().manual_seed(2)),
    )
    big = one_update(mlp(norm=True), data, mse, 1)
    small = one_update(mlp(norm=True), data, mse, 4)
    worst = max((a - b).abs().max().item() for a, b in zip(small, big))
    assert worst > 1e-3, worst


# -- checkpoints and resume ------------------------------------------------------------------------
def resumable_setup(seed):
    torch.manual_seed(seed)
    model = CausalLM(
        TransformerConfig.gpt2(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, dropout=0.1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = lambda i: torch.randint(0, 50, (4, 16))  # drawn from the global RNG: resuming must restore it
    return model, opt, batches


def config(tmp_path, **kw):
    settings = dict(max_steps=10, accumulation=2, clip_grad_norm=1.0, checkpoint_every=4, progress=False)
    return TrainConfig(schedule=warmup_cosine(3, 10), checkpoint_dir=tmp_path, **{**settings, **kw})


class Killed(Exception):
    pass


def kill_at(step):
    def callback(info):
        if info.step == step:
            raise Killed

    return callback


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, monkeypatch):
    model, opt, batches = resumable_setup(0)
    torch.manual_seed(1)
    full = train(model, opt, batches, gpt_loss, config(tmp_path / "full"))

    model, opt, batches = resumable_setup(0)
    torch.manual_seed(1)
    with pytest.raises(Killed):
        train(model, opt, batches, gpt_loss, config(tmp_path / "killed"), callbacks=[kill_at(6)])
    assert ckpt.latest(tmp_path / "killed").name == "step-000004"

    model, opt, batches = resumable_setup(99)  # another initialisation and RNG state: all must come from the checkpoint
    torch.rand(5)
    for name in ("load", "loads"):  # loading must not unpickle anything
        monkeypatch.setattr(pickle, name, lambda *a, **k: pytest.fail("checkpoint loading unpickled"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("checkpoint loading called torch.load"))
    resumed = train(model, opt, batches, gpt_loss, config(tmp_path / "killed"), resume=True)
    assert [s.step for s in resumed.steps] == list(range(5, 11))
    assert resumed["loss"] == full["loss"][4:]  # exactly, not approximately
    assert resumed["lr"] == full["lr"][4:]
    files = sorted(p.name for p in (tmp_path / "killed" / "step-000010").iterdir())
    assert files == ["state.json", "tensors.safetensors"]


def test_resume_from_bad_checkpoints_is_a_clear_error_and_changes_nothing(tmp_path):
    model, opt, batches = resumable_setup(0)
    train(model, opt, batches, gpt_loss, TrainConfig(max_steps=2, checkpoint_dir=tmp_path, progress=False))
    good = ckpt.latest(tmp_path)
    state_before = {k: v.clone() for k, v in model.state_dict().items()}

    with pytest.raises(CheckpointError, match="not a folder"):
        train(model, opt, batches, gpt_loss, TrainConfig(max_steps=4, progress=False), resume=tmp_path / "step-000999")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(
            model,
            opt,
            batches,
            gpt_loss,
            TrainConfig(max_steps=4, checkpoint_dir=tmp_path / "empty", progress=False),
            resume=True,
        )
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        train(model, opt, batches, gpt_loss, TrainConfig(max_steps=4, checkpoint_dir=tmp_path, progress=False))

    bad = tmp_path / "bad"
    bad.mkdir()
    unrecorded = {
        k: v for k, v in json.loads((good / "state.json").read_text()).items() if k not in ("sha256", "state_sha256")
    }
    (bad / "state.json").write_text(json.dumps(unrecorded))  # no record: the file itself must be read safely
    payload = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(payload), "w"))

    (bad / "tensors.safetensors").write_bytes(pickle.dumps(Evil()))  # a pickle dressed as safetensors
    with pytest.raises(
        ckpt.UncheckedCheckpointError, match="records no sha256 of tensors.safetensors nor of state.json"
    ):
        ckpt.load(bad, model, opt)
    with pytest.warns(RuntimeWarning, match="unchecked"), pytest.raises(CheckpointError, match="not a readable safe"):
        ckpt.load(bad, model, opt, allow_unchecked=True)
    assert not payload.exists()

    (bad / "tensors.safetensors").write_bytes((good / "tensors.safetensors").read_bytes()[:1000])  # truncated
    with pytest.warns(RuntimeWarning, match="unchecked"), pytest.raises(CheckpointError, match="not a readable safe"):
        ckpt.load(bad, model, opt, allow_unchecked=True)
    (bad / "tensors.safetensors").write_bytes((good / "tensors.safetensors").read_bytes())
    (bad / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ckpt.load(bad, model, opt)
    state = json.loads((good / "state.json").read_text())
    del state["rng"]
    state["state_sha256"] = ckpt._state_digest(state)  # as a writer that left it out would record it
    (bad / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="incomplete or corrupt"):
        ckpt.load(bad, model, opt)

    other = CausalLM(TransformerConfig.gpt2(vocab_size=50, d_model=16, n_layers=2, n_heads=2, max_seq_len=16))
    with pytest.raises(CheckpointError, match="is \\(50, 32\\)"):
        ckpt.load(good, other, torch.optim.AdamW(other.parameters()))
    for name, value in model.state_dict().items():
        assert torch.equal(value, state_before[name]), f"{name} changed by a failed load"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "step-000002"]  # nothing new was written


def test_bad_config_is_rejected():
    for bad in (
        dict(max_steps=3, accumulation=0),
        dict(max_steps=3, accumulation=1.5),
        dict(),
        dict(max_steps=0),
        dict(max_seconds=-1.0),
        dict(max_steps=3, checkpoint_every=2),
    ):
        with pytest.raises(ValueError):
            TrainConfig(**bad)
    with pytest.raises(ValueError, match="accumulation must be an int >= 1"):
        TrainConfig(max_steps=3, accumulation=0)


def test_budgets_data_end_and_the_monitor():
    model = mlp()
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(5)]
    history = train(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        mse,
        TrainConfig(max_steps=100, accumulation=2, progress=False),
    )
    assert history.stop_reason == "data" and len(history.steps) == 2 and all(p.grad is None for p in model.parameters())

    with LiveMonitor(title="test", live=False) as mon:
        history = train(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            lambda i: data[i % 5],
            mse,
            TrainConfig(max_seconds=0.3, progress=False),
            callbacks=[log_to(mon, ("loss", "grad_norm"))],
        )
    assert history.stop_reason == "seconds" and history.steps[-1].elapsed >= 0.3
    assert mon.history["loss"] == history["loss"] and mon.steps == [s.step for s in history.steps]
    assert all(s.tokens == 4 * 8 for s in history.steps)  # the first tensor of each (x, y) batch


def test_resume_restores_the_loss_scaler(tmp_path):
    """fp16: the loss scale and its clean-step counter must survive a restart, or the next steps differ."""
    from llmedu.train import LossScaler, Precision

    data = [
        (
            torch.randn(16, 8, generator=torch.Generator().manual_seed(i)),
            torch.randn(16, 1, generator=torch.Generator().manual_seed(100 + i)),
        )
        for i in range(12)
    ]

    def run(directory, **kw):
        model = mlp()
        policy = Precision("fp16", LossScaler(init_scale=2.0**20, growth_interval=2))
        cfg = TrainConfig(max_steps=12, precision=policy, checkpoint_dir=directory, checkpoint_every=3, progress=False)
        return train(model, torch.optim.SGD(model.parameters(), lr=0.05), lambda i: data[i], mse, cfg, **kw)

    full = run(tmp_path / "full")
    with pytest.raises(Killed):
        run(tmp_path / "killed", callbacks=[kill_at(5)])
    resumed = run(tmp_path / "killed", resume=True)
    assert resumed["loss_scale"] == full["loss_scale"][3:] and resumed["loss"] == full["loss"][3:]
    assert any(full["skipped"]) and len(set(full["loss_scale"])) > 2  # the scale moved both ways


# -- faults: damaged checkpoints, non-finite losses, interrupts -----------------------------------------
def test_a_flipped_byte_is_caught_and_resuming_falls_back_to_the_checkpoint_before(tmp_path):
    model, opt, batches = resumable_setup(0)
    train(model, opt, batches, gpt_loss, config(tmp_path))  # checkpoints at steps 4, 8 and the end
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000004", "step-000008", "step-000010"]
    newest = tmp_path / "step-000010" / "tensors.safetensors"
    data = bytearray(newest.read_bytes())
    data[-5] ^= 1  # one bit of one weight
    newest.write_bytes(bytes(data))
    fresh, fresh_opt, _ = resumable_setup(0)
    with pytest.raises(CheckpointError, match=r"step-000010/tensors\.safetensors differs from the sha256"):
        ckpt.load(tmp_path / "step-000010", fresh, fresh_opt)
    with pytest.warns(RuntimeWarning, match="skipping a damaged checkpoint: .*step-000010"):
        path, state = ckpt.load_latest(tmp_path, fresh, fresh_opt)
    assert path.name == "step-000008" and state["step"] == 8


def test_latest_is_the_highest_step_not_the_last_name(tmp_path):
    for step in (999_999, 1_000_000):
        (tmp_path / ckpt.checkpoint_name(step)).mkdir()
        for name in (ckpt.TENSORS, ckpt.STATE):
            (tmp_path / ckpt.checkpoint_name(step) / name).write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1000000", "step-999999"]  # by name, 999999 is last
    assert ckpt.latest(tmp_path).name == "step-1000000"


def test_leftovers_of_a_writer_that_died_are_removed(tmp_path):
    leftover = tmp_path / ".step-000002.tmp-999999999"  # no such process
    leftover.mkdir(parents=True)
    (leftover / ckpt.TENSORS).write_text("half")
    model, opt, batches = resumable_setup(0)
    train(model, opt, batches, gpt_loss, TrainConfig(max_steps=1, checkpoint_dir=tmp_path, progress=False))
    assert not leftover.exists()


@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_a_non_finite_step_stops_training_before_it_is_applied_or_saved(tmp_path, poison):
    model, opt, batches = resumable_setup(0)

    def loss_fn(model, ids):
        loss = gpt_loss(model, ids)
        if len(history_steps) != 2:  # the third step goes wrong
            return loss
        return loss * float("nan") if poison == "loss" else loss + 0 * model.lm_head.weight.sum() * float("inf")

    history_steps = []
    cfg = TrainConfig(max_steps=5, checkpoint_dir=tmp_path, checkpoint_every=1, progress=False)
    before = None

    def remember(info):
        nonlocal before
        history_steps.append(info.step)
        before = {k: v.clone() for k, v in model.state_dict().items()}

    with pytest.raises(FloatingPointError, match=r"step 3: the (loss|gradient norm) is (nan|inf).*nonfinite='skip'"):
        train(model, opt, batches, loss_fn, cfg, callbacks=[remember])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the bad step changed the weights"
    assert ckpt.latest(tmp_path).name == "step-000002", "a non-finite step was checkpointed"


def test_non_finite_steps_can_be_skipped_with_a_warning(tmp_path):
    model, opt, batches = resumable_setup(0)
    calls = []

    def loss_fn(model, ids):
        calls.append(1)
        loss = gpt_loss(model, ids)
        return loss * float("nan") if len(calls) == 2 else loss

    with pytest.warns(RuntimeWarning, match="step 2: the loss is nan; the step is skipped"):
        history = train(model, opt, batches, loss_fn, TrainConfig(max_steps=4, nonfinite="skip", progress=False))
    assert history["skipped"] == [False, True, False, False]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(ValueError, match="nonfinite must be 'raise' or 'skip'"):
        TrainConfig(max_steps=1, nonfinite="ignore")


def test_an_interrupt_saves_the_last_finished_step_and_resuming_loses_nothing(tmp_path, capsys):
    model, opt, batches = resumable_setup(0)
    reference = train(model, opt, batches, gpt_loss, config(tmp_path / "straight"))

    model, opt, batches = resumable_setup(0)

    def stop_at_six(info):
        if info.step == 6:
            raise KeyboardInterrupt  # as Ctrl-C would, between two steps

    with pytest.raises(KeyboardInterrupt):
        train(model, opt, batches, gpt_loss, config(tmp_path / "run"), callbacks=[stop_at_six])
    assert "interrupted: step 6 saved" in capsys.readouterr().out
    assert ckpt.latest(tmp_path / "run").name == "step-000006"  # not only step-000004
    model, opt, _ = resumable_setup(1)  # other weights: the checkpoint must restore everything
    resumed = train(model, opt, batches, gpt_loss, config(tmp_path / "run"), resume=True)
    assert resumed["loss"] == pytest.approx(reference["loss"][6:], abs=1e-6)


# -- keeping only the newest checkpoints ----------------------------------------------------------------
def test_keep_checkpoints_removes_the_older_ones_and_resuming_is_still_exact(tmp_path):
    model, opt, batches = resumable_setup(0)
    torch.manual_seed(1)
    full = train(model, opt, batches, gpt_loss, config(tmp_path / "all", checkpoint_every=2))
    assert len(ckpt.checkpoints(tmp_path / "all")) == 5  # steps 2, 4, ..., 10: every one kept by default

    model, opt, batches = resumable_setup(0)
    torch.manual_seed(1)
    with pytest.raises(Killed):
        kept = config(tmp_path / "kept", checkpoint_every=2, keep_checkpoints=2)
        train(model, opt, batches, gpt_loss, kept, callbacks=[kill_at(7)])
    assert [p.name for p in ckpt.checkpoints(tmp_path / "kept")] == ["step-000004", "step-000006"]
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["step-000004", "step-000006"]  # no leftovers

    model, opt, batches = resumable_setup(99)
    resumed = train(model, opt, batches, gpt_loss, kept, resume=True)
    assert resumed["loss"] == full["loss"][6:]  # exactly: pruning removed only what resuming does not need
    assert [p.name for p in ckpt.checkpoints(tmp_path / "kept")] == ["step-000008", "step-000010"]


def test_with_kept_checkpoints_a_damaged_latest_still_falls_back_to_the_one_before(tmp_path):
    model, opt, batches = resumable_setup(0)
    train(model, opt, batches, gpt_loss, config(tmp_path, checkpoint_every=2, keep_checkpoints=2))
    newest = tmp_path / "step-000010" / "tensors.safetensors"
    data = bytearray(newest.read_bytes())
    data[-5] ^= 1
    newest.write_bytes(bytes(data))
    fresh, fresh_opt, _ = resumable_setup(0)
    with pytest.warns(RuntimeWarning, match="skipping a damaged checkpoint: .*step-000010"):
        path, state = ckpt.load_latest(tmp_path, fresh, fresh_opt)
    assert path.name == "step-000008" and state["step"] == 8


def test_keep_checkpoints_below_two_or_without_a_folder_is_refused(tmp_path):
    for keep in (1, 0, 2.5):
        with pytest.raises(ValueError, match="keep_checkpoints must be an int >= 2"):
            TrainConfig(max_steps=3, checkpoint_dir=tmp_path, keep_checkpoints=keep)
    with pytest.raises(ValueError, match="keep_checkpoints needs a checkpoint_dir"):
        TrainConfig(max_steps=3, keep_checkpoints=2)
    with pytest.raises(ValueError, match="keep must be an int >= 2"):
        ckpt.prune(tmp_path, 1)


def test_a_prune_killed_midway_leaves_a_hidden_leftover_not_a_half_checkpoint(tmp_path, monkeypatch):
    model, opt, batches = resumable_setup(0)
    train(model, opt, batches, gpt_loss, config(tmp_path))  # steps 4, 8, 10

    def killed(path, *args, **kwargs):  # the process dies inside the deletion: a half-deleted folder stays
        (Path(path) / ckpt.TENSORS).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune(tmp_path, 2)
    monkeypatch.undo()
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000008", "step-000010"]
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert [p.name.split(".tmp-")[0] for p in leftovers] == [".step-000004"]  # hidden, not a checkpoint
