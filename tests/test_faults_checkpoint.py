"""Damaged checkpoints never block a run: resume starts from the newest intact one and can resume again."""

import json
import re

import pytest
import torch

from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.train import CheckpointError, TrainConfig, train
from llmedu.train import checkpoint as ckpt
from llmedu.train.schedules import warmup_cosine


def setup(seed):
    torch.manual_seed(seed)
    config = TransformerConfig.gpt2(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, dropout=0.1)
    model = CausalLM(config)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3), lambda i: torch.randint(0, 50, (4, 16))


def gpt_loss(model, ids):
    return lm_loss(model(ids), ids)


def config(folder, **kw):
    settings = dict(max_steps=10, checkpoint_every=2, accumulation=2, progress=False, schedule=warmup_cosine(3, 10))
    return TrainConfig(checkpoint_dir=folder, **{**settings, **kw})


class Killed(Exception):
    pass


def kill_at(step):
    def callback(info):
        if info.step == step:
            raise Killed

    return callback


def damage(path, kind, other):
    """Damage one file of a checkpoint: cut it short, zero it, flip one byte, or put another checkpoint's there."""
    data = bytearray(path.read_bytes())
    if kind == "truncate":
        data = data[: len(data) // 2]
    elif kind == "zero":
        data = bytearray(len(data))
    elif kind == "flip" and path.name == ckpt.STATE:  # the sly flip: still valid JSON, another position
        digit = re.search(rb'"position": (\d)', data).start(1)
        data[digit] = ord("7") if data[digit] != ord("7") else ord("3")
    elif kind == "flip":
        data[-5] ^= 1  # one bit of one tensor
    else:  # replace
        data = (other / path.name).read_bytes()
    path.write_bytes(bytes(data))
    return bytes(data)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model, opt, batches = setup(0)
    torch.manual_seed(1)
    return train(model, opt, batches, gpt_loss, config(tmp_path_factory.mktemp("full")))["loss"]


DAMAGES = [
    (kind, file, None) for kind in ("truncate", "zero", "flip", "replace") for file in (ckpt.TENSORS, ckpt.STATE)
]


@pytest.mark.parametrize("kind, file, keep", [*DAMAGES, ("flip", ckpt.TENSORS, 2), ("replace", ckpt.STATE, 2)])
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_run_goes_on(
    tmp_path, monkeypatch, uninterrupted, kind, file, keep
):
    run = config(tmp_path, keep_checkpoints=keep)
    model, opt, batches = setup(0)
    torch.manual_seed(1)
    with pytest.raises(Killed):
        train(model, opt, batches, gpt_loss, run, callbacks=[kill_at(7)])
    assert ckpt.latest(tmp_path).name == "step-000006"
    damaged = damage(tmp_path / "step-000006" / file, kind, other=tmp_path / "step-000004")

    loaded = []
    real_load = ckpt.load
    monkeypatch.setattr(ckpt, "load", lambda path, *a, **k: loaded.append(path.name) or real_load(path, *a, **k))
    model, opt, batches = setup(99)  # all must come from the checkpoint
    with pytest.warns(RuntimeWarning, match=r"skipping a damaged checkpoint: .*step-000006.*moved aside"):
        with pytest.raises(Killed):
            train(model, opt, batches, gpt_loss, run, resume=True, callbacks=[kill_at(8)])
    assert loaded == ["step-000004"]  # nothing read from the damaged one
    aside = tmp_path / "step-000006.damaged"
    assert (aside / file).read_bytes() == damaged  # kept as it was, for a look
    assert ckpt.latest(tmp_path).name == "step-000006"  # the recomputed step, saved under its own name

    model, opt, batches = setup(98)
    resumed = train(model, opt, batches, gpt_loss, run, resume=True)  # and resumable again
    assert loaded == ["step-000004", "step-000006"]
    assert resumed["loss"] == uninterrupted[6:]  # exactly: as if nothing had happened
    names = sorted(p.name for p in tmp_path.iterdir())
    kept = ["step-000002", "step-000004", "step-000006", "step-000008", "step-000010"][-(keep or 5) :]
    assert names == sorted(["step-000006.damaged", *kept])  # listed nowhere, pruned by nobody


def test_the_first_resume_repeats_the_uninterrupted_losses(tmp_path, uninterrupted):
    model, opt, batches = setup(0)
    torch.manual_seed(1)
    with pytest.raises(Killed):
        train(model, opt, batches, gpt_loss, config(tmp_path), callbacks=[kill_at(7)])
    damage(tmp_path / "step-000006" / ckpt.TENSORS, "flip", None)
    model, opt, batches = setup(99)
    with pytest.warns(RuntimeWarning, match="step-000006"):
        resumed = train(model, opt, batches, gpt_loss, config(tmp_path), resume=True)
    assert resumed["loss"] == uninterrupted[4:]
    assert ckpt.newest_intact(tmp_path).name == "step-000010"


def test_a_second_damage_of_the_same_step_gets_its_own_name(tmp_path):
    model, opt, batches = setup(0)
    train(model, opt, batches, gpt_loss, config(tmp_path, max_steps=4))
    for _ in range(2):
        damage(tmp_path / "step-000004" / ckpt.TENSORS, "zero", None)
        with pytest.warns(RuntimeWarning, match="moved aside"):
            assert ckpt.newest_intact(tmp_path).name == "step-000002"
        model, opt, batches = setup(0)
        train(model, opt, batches, gpt_loss, config(tmp_path, max_steps=4), resume=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000002",
        "step-000004",
        "step-000004.damaged",
        "step-000004.damaged-2",
    ]
    damage(tmp_path / "step-000004" / ckpt.TENSORS, "zero", None)
    damage(tmp_path / "step-000002" / ckpt.STATE, "truncate", None)
    with pytest.warns(RuntimeWarning, match="moved aside"):
        assert ckpt.newest_intact(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no checkpoint .* only damaged ones"):
        train(model, opt, batches, gpt_loss, config(tmp_path, max_steps=4), resume=True)


def test_a_checkpoint_without_checksums_is_refused_unless_asked(tmp_path):
    model, opt, batches = setup(0)
    train(model, opt, batches, gpt_loss, config(tmp_path, max_steps=4))
    newest = tmp_path / "step-000004"
    state = json.loads((newest / ckpt.STATE).read_text())

    # the tensor checksum lost: the state's own checksum no longer matches, so it is damage like any other
    (newest / ckpt.STATE).write_text(json.dumps({k: v for k, v in state.items() if k != "sha256"}))
    with pytest.raises(CheckpointError, match=r"state\.json differs from the sha256"):
        ckpt.read(newest)

    # no checksum at all (as an older llmedu wrote them) and a flipped weight: an error, not a silent resume
    (newest / ckpt.STATE).write_text(json.dumps({k: v for k, v in state.items() if "sha256" not in k}))
    damage(newest / ckpt.TENSORS, "flip", None)
    fresh, fresh_opt, _ = setup(5)
    with pytest.raises(ckpt.UncheckedCheckpointError, match="records no sha256 .*allow_unchecked=True"):
        train(fresh, fresh_opt, batches, gpt_loss, config(tmp_path, max_steps=6), resume=True)
    assert ckpt.latest(tmp_path) == newest  # not moved: it may be an older llmedu's, the user decides
    with pytest.warns(RuntimeWarning, match="records no sha256 .*loading it unchecked"):
        assert ckpt.load(newest, fresh, fresh_opt, allow_unchecked=True)["step"] == 4


def test_pruning_a_checkpoint_that_is_a_symlink_removes_the_link_only(tmp_path):
    """A checkpoint kept on another disk and linked into the run's folder: pruning removes the link and leaves
    its target alone (rmtree refused the link and stopped the run, and the renamed link stayed behind)."""
    model, optimizer, _ = setup(0)
    elsewhere = ckpt.save(tmp_path / "other-disk", model, optimizer, {"step": 1})
    run = tmp_path / "run"
    run.mkdir()
    (run / ckpt.checkpoint_name(1)).symlink_to(elsewhere.resolve(), target_is_directory=True)
    for step in (2, 3):
        ckpt.save(run, model, optimizer, {"step": step})
    removed = ckpt.prune(run, 2)
    assert [p.name for p in removed] == [ckpt.checkpoint_name(1)]
    assert sorted(p.name for p in run.iterdir()) == [ckpt.checkpoint_name(2), ckpt.checkpoint_name(3)]
    assert (elsewhere / ckpt.TENSORS).is_file() and (elsewhere / ckpt.STATE).is_file()  # the target is intact
