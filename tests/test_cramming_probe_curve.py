"""The probe curve: the study's linear probe along a run's checkpoints, its JSON, reading and errors."""

import json
import math
import shutil

import matplotlib
import pytest
import torch

import llmedu.cramming.studies.probe_curve as pc
from llmedu.cramming.evaluate import make_splits
from llmedu.cramming.pretrain import PretrainRun, pretrain
from llmedu.cramming.recipe import TINY_SHAPE, crammed
from llmedu.cramming.studies.encoders import encoder_features
from llmedu.cramming.studies.probe_curve import (
    checkpoint_features,
    checkpoint_weights,
    choose_checkpoints,
    probe_scores,
    run_checkpoints,
    run_probe_curve,
)
from llmedu.cramming.studies.probe_curve_report import (
    CONTROL,
    average_noise,
    curve_table,
    curve_verdict,
    first_crossing,
    load_probe_curve,
    plot_probe_curve,
    study_references,
)
from llmedu.cramming.studies.report import RECORDED
from llmedu.train.checkpoint import TENSORS, CheckpointError

matplotlib.use("Agg")

pytestmark = pytest.mark.usefixtures("one_thread")  # many tiny ops: two threads wait on each other

TASKS = ("rotten_tomatoes", "bbc_news")
CAPS = dict(tasks=TASKS, max_train=48, max_eval=24, progress=False)
TEXTS = ["a good film", "the news of the day, at length", "and it came to pass"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Six steps of the tiny shape, a checkpoint every two, the held-out loss at each (100k chars: enough rows)."""
    out = tmp_path_factory.mktemp("run") / "crammed"
    run = PretrainRun(
        crammed(**{**TINY_SHAPE, "micro_batch": 8}), None, max_steps=6, corpora=["kjv"], max_chars=100_000
    )
    pretrain(out, run, tokenizer_chars=30_000, progress=False, checkpoint_every=2, eval_every=2, eval_batches=1)
    return out


@pytest.fixture(scope="module")
def curve(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("curve") / "probe_curve.json"
    references = {"TF-IDF + logistic regression": 0.776, "MiniLM-L6, linear probe": 0.779}
    return out, run_probe_curve(tiny_run, out, points=None, references=references, **CAPS)


def test_every_checkpoint_is_a_point_with_its_clock_tokens_and_loss(tiny_run, curve):
    out, results = curve
    assert set(results) == {"provenance", "config", "references", "control", "points", "verdict"}
    assert results["provenance"]["run_finished"] and results["provenance"]["checkpoints"] == 3
    found = run_checkpoints(tiny_run)
    assert [c["step"] for c in found] == [2, 4, 6] == results["config"]["steps"]
    points = results["points"]
    assert [p["step"] for p in points] == [2, 4, 6]
    assert [p["latest"] for p in points] == [False, False, True]
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert points[-1]["tokens_seen"] == summary["tokens_seen"]  # the summary's count, at the last checkpoint
    assert points[-1]["seconds"] == pytest.approx(summary["elapsed_seconds"], abs=1e-3)
    assert all(a["tokens_seen"] < b["tokens_seen"] and a["seconds"] < b["seconds"] for a, b in zip(points, points[1:]))
    assert [p["val_loss"] for p in points] == [h["val_loss"] for h in summary["val_history"]]
    assert [p["budget_fraction"] for p in points] == pytest.approx([1 / 3, 2 / 3, 1], abs=1e-3)  # max_steps budget
    assert points[-1]["lr_factor"] == 0  # the one-cycle schedule has annealed only at the end
    for p in points:
        assert set(p["tasks"]) == set(TASKS) and p["tasks"]["bbc_news"]["sizes"] == {"train": 48, "dev": 24, "test": 24}
        assert p["average"]["mean"] == pytest.approx(sum(p["tasks"][t]["test"]["mean"] for t in TASKS) / 2)
        # the gap is the point minus the control, on the average and per task
        assert p["gap"]["average"] == pytest.approx(p["average"]["mean"] - results["control"]["average"]["mean"])
        for t in TASKS:
            expected = p["tasks"][t]["test"]["mean"] - results["control"]["tasks"][t]["test"]["mean"]
            assert p["gap"]["tasks"][t] == pytest.approx(expected)
    assert results["control"]["name"] == CONTROL
    assert load_probe_curve(out) == json.loads(json.dumps(results))  # the file is the last state


def test_the_control_and_the_last_point_are_the_studys_probe_rows(tiny_run, curve):
    """The curve loads every checkpoint into one encoder (its token ids remembered): nothing stale may leak."""
    _, results = curve
    splits = {t: make_splits(t, 0.1, seed=0, max_train=48, max_eval=24) for t in TASKS}
    control = probe_scores(encoder_features(tiny_run, from_scratch=True)[0], splits)
    assert control["tasks"] == results["control"]["tasks"]
    final = probe_scores(encoder_features(tiny_run)[0], splits)  # the study's "<run>, linear probe" row
    assert final["tasks"] == results["points"][-1]["tasks"]
    assert final["tasks"] != control["tasks"]


def test_the_last_checkpoint_gives_the_final_weights_features(tiny_run):
    found = run_checkpoints(tiny_run)
    final = encoder_features(tiny_run)[0](TEXTS)  # (3, d): what the study probes
    last = checkpoint_features(tiny_run, checkpoint_weights(found[-1]["path"]))[0](TEXTS)
    first = checkpoint_features(tiny_run, checkpoint_weights(found[0]["path"]))[0](TEXTS)
    assert final.shape == (3, TINY_SHAPE["d_model"])
    assert torch.equal(last, final)  # bit for bit
    assert not torch.allclose(first, final)  # two steps of training earlier: other weights


def test_the_table_verdict_and_plot_read_the_curve(curve):
    _, results = curve
    table = curve_table(results)
    assert len(table.splitlines()) == 2 + 3 + 1 + 2  # header, rule, points, control, references
    assert CONTROL in table and "MiniLM-L6, linear probe" in table
    assert results["verdict"] == curve_verdict(results) and "random init" in results["verdict"]
    axes = plot_probe_curve(results)
    assert len(axes) == 2 and len(axes[0].lines) == 1 + 2 + 2  # the curve, control and threshold, references
    assert len(axes[1].lines) == 1 + len(results["config"]["tasks"])  # zero, then one gap line per task
    tasks = list(results["points"][-1]["tasks"].values())
    by_hand = math.sqrt(sum(t["test"]["mean"] * (1 - t["test"]["mean"]) / t["sizes"]["test"] for t in tasks)) / len(
        tasks
    )
    assert average_noise(results["points"][-1]) == pytest.approx(by_hand)
    plot_probe_curve(results, axes, label="again", calibration=False)  # a second run on the same axes
    assert len(axes[0].lines) == 6 and len(axes[1].lines) == 1 + 2 * len(results["config"]["tasks"])


def test_a_stopped_curve_resumes_without_probing_again(tiny_run, curve, tmp_path, monkeypatch):
    out, results = curve
    copy = tmp_path / "curve.json"
    shutil.copy(out, copy)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a probed checkpoint was probed again")

    monkeypatch.setattr(pc, "checkpoint_features", must_not_run)
    monkeypatch.setattr(pc, "encoder_features", must_not_run)
    again = run_probe_curve(tiny_run, copy, points=None, references=results["references"], resume=True, **CAPS)
    assert again["points"] == json.loads(json.dumps(results["points"]))
    with pytest.raises(ValueError, match="other settings"):
        run_probe_curve(tiny_run, copy, points=2, resume=True, **CAPS)


def test_checkpoints_are_chosen_evenly_in_tokens():
    found = [{"step": s, "tokens_seen": t} for s, t in [(100, 10), (200, 30), (300, 60), (400, 100), (500, 140)]]
    assert [c["step"] for c in choose_checkpoints(found, points=2)] == [300, 500]  # nearest to 70 and 140 tokens
    assert [c["step"] for c in choose_checkpoints(found, points=4)] == [200, 300, 400, 500]  # 35, 70, 105, 140
    assert choose_checkpoints(found) == found and choose_checkpoints(found, points=9) == found
    assert [c["step"] for c in choose_checkpoints(found, steps=[500, 100])] == [100, 500]
    with pytest.raises(ValueError, match=r"no checkpoint at step \[150\]"):
        choose_checkpoints(found, steps=[150])
    with pytest.raises(ValueError, match="not both"):
        choose_checkpoints(found, points=2, steps=[100])
    with pytest.raises(ValueError, match="points must be"):
        choose_checkpoints(found, points=0)


def test_bad_inputs_raise_clear_errors(tiny_run, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a pretraining run"):
        run_probe_curve(tmp_path, **CAPS)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_run / "run.json", bare / "run.json")
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):
        run_probe_curve(bare, **CAPS)
    with pytest.raises(KeyError, match="unknown task 'sst2'"):
        run_probe_curve(tiny_run, **{**CAPS, "tasks": ("sst2",)})
    with pytest.raises(ValueError, match="fraction"):
        run_probe_curve(tiny_run, threshold=3, **CAPS)
    spec = json.loads((tiny_run / "run.json").read_text())
    (bare / "run.json").write_text(json.dumps({**spec, "corpora": ["kjv", "tweets"]}))
    with pytest.raises(ValueError, match="tweet_sentiment"):  # the study's rule: not a task of its own corpus
        run_probe_curve(bare, **{**CAPS, "tasks": ("tweet_sentiment",)})
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        checkpoint_weights(tmp_path)
    damaged = tmp_path / "step-000002"  # a byte of a checkpoint's weights flipped: refused, not loaded
    shutil.copytree(sorted((tiny_run / "checkpoints").iterdir())[0], damaged)
    data = bytearray((damaged / TENSORS).read_bytes())
    data[-1] ^= 0xFF
    (damaged / TENSORS).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 recorded when it was saved"):
        checkpoint_weights(damaged)
    with pytest.raises(FileNotFoundError, match="no probe curve here"):
        load_probe_curve(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="lacks control, points"):
        load_probe_curve(RECORDED)  # a study's output is not a curve
    (tmp_path / "broken.json").write_text(
        json.dumps({"provenance": {}, "config": {}, "control": {"tasks": {}, "average": {}}, "points": [{"step": 1}]})
    )
    with pytest.raises(ValueError, match="point 0 lacks tokens_seen"):
        load_probe_curve(tmp_path / "broken.json")


def _synthetic(gaps: list[float], control: float = 0.62) -> dict:
    points = [
        {
            "step": 500 * (i + 1),
            "tokens_seen": 5_000_000 * (i + 1),
            "seconds": 240.0 * (i + 1),
            "lr_factor": 0.5,
            "average": {"mean": control + g},
            "gap": {"average": g},
        }
        for i, g in enumerate(gaps)
    ]
    return {"config": {"threshold": 0.03}, "control": {"average": {"mean": control}}, "points": points}


def test_the_verdict_follows_the_numbers():
    never = curve_verdict(_synthetic([0.0, 0.01, 0.025, 0.02]))
    assert "never leads" in never and "+2.5 points" in never and "step 1,500" in never
    holds = curve_verdict(_synthetic([0.0, 0.01, 0.035, 0.04]))
    assert "first leads" in holds and "step 1,500" in holds and "12.0 min" in holds and "stays" in holds
    later = curve_verdict(_synthetic([0.0, 0.01, 0.02, 0.04]))
    assert "step 2,000" in later and "16.0 min" in later and "20.0M tokens" in later
    lost = curve_verdict(_synthetic([0.04, 0.01, 0.02]))
    assert "step 500" in lost and "does not hold" in lost and "+2.0 points" in lost
    assert "first leads" in curve_verdict(_synthetic([0.0, 0.01, 0.025]), threshold=0.02)  # a lower bar
    annealed = _synthetic([0.0, 0.04])
    annealed["points"][-1]["lr_factor"] = 0.0  # the run's end: no caveat about the schedule
    assert "the last checkpoint probed" in curve_verdict(annealed) and "annealed" not in curve_verdict(annealed)
    assert first_crossing(_synthetic([0.01, 0.05, 0.04])["points"], 0.03)[0]["step"] == 1000
    assert curve_verdict(_synthetic([])) == "No checkpoint has been probed yet."


def test_references_come_from_the_recorded_study():
    refs = study_references()
    assert refs == pytest.approx({"TF-IDF + logistic regression": 0.7758, "MiniLM-L6, linear probe": 0.7790}, abs=1e-4)
    with pytest.raises(KeyError, match="no row"):
        study_references(rows=("GPT-4",))


def test_the_command_line_names_a_folder_that_is_not_a_run(tmp_path):
    """``python -m llmedu.cramming probe-curve`` on a folder without run.json: the error says what to give."""
    from llmedu.cramming.__main__ import main

    with pytest.raises(FileNotFoundError, match="is not a pretraining run .* python -m llmedu.cramming pretrain"):
        main(["probe-curve", "--run", str(tmp_path / "nothing"), "--out", str(tmp_path / "curve.json")])
    assert not (tmp_path / "curve.json").exists()
