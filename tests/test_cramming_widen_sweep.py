"""Widening a finished study's sweep: the same numbers as a study run with the wider grid, and refusals."""

import json
from dataclasses import replace

import pytest

from llmedu.cramming.evaluate import make_splits
from llmedu.cramming.more_seeds import add_seeds
from llmedu.cramming.study import StudyConfig, run_study
from llmedu.cramming.widen_sweep import widen_sweep

CONFIG = StudyConfig(tasks=("bbc_news",), lrs=(4e-4,), seeds=(0, 1), label_sizes=(8, None), epochs=1, max_train=32,
                     max_eval=16, minilm=False)  # fmt: skip


@pytest.fixture
def rate_dependent_scores(monkeypatch):
    """Every fine-tune scored by its rate and seed alone: a moved choice and the seeds it trains are then visible
    (a tiny model's accuracy may not move at all). Dev prefers 1e-3 over 4e-4 over 1e-4 (8e-4 ties 1e-3: the
    lower rate must win); the seed adds a small amount, so the test seeds' scores differ."""
    dev_score = {1e-4: 0.1, 4e-4: 0.2, 8e-4: 0.3, 1e-3: 0.3}
    calls = []

    def finetune_scorer(folder, from_scratch=False, settings=None):
        def score(train, test, lr, seed):
            calls.append((from_scratch, len(train), test, lr, seed))
            return dev_score[lr] + seed / 100 + len(train) / 1e4

        return score

    monkeypatch.setattr("llmedu.cramming.study.finetune_scorer", finetune_scorer)
    return calls


def test_a_widened_study_scores_what_a_study_with_the_wide_grid_scores(
    tiny_cramming_run, tmp_path, rate_dependent_scores
):
    runs = {"crammed": tiny_cramming_run}
    run_study(runs, CONFIG, out=tmp_path / "narrow.json", progress=False)
    narrow = add_seeds(tmp_path / "narrow.json", runs, [2], out=tmp_path / "narrow3.json", progress=False)
    calls = rate_dependent_scores
    calls.clear()
    wide = widen_sweep(tmp_path / "narrow3.json", runs, [1e-3, 8e-4, 1e-4], out=tmp_path / "wide.json", progress=False)
    widening = list(calls)
    whole = run_study(runs, replace(CONFIG, lrs=(1e-4, 4e-4, 8e-4, 1e-3), seeds=(0, 1, 2)), progress=False)
    assert wide["config"]["lrs"] == [1e-4, 4e-4, 8e-4, 1e-3]
    assert wide["widened"]["lrs"] == [1e-4, 8e-4, 1e-3]
    assert wide["widened"]["moved"] == {"bbc_news": ["crammed", "random init"]}
    dev = make_splits("bbc_news", CONFIG.dev_fraction, max_train=CONFIG.max_train, max_eval=CONFIG.max_eval).dev
    for row in ("crammed", "random init"):
        ours, theirs = wide["tasks"]["bbc_news"]["models"][row], whole["tasks"]["bbc_news"]["models"][row]
        assert ours["lr"] == theirs["lr"] == 8e-4  # the tie with 1e-3 goes to the lower rate, as in one sweep
        assert ours["dev"] == theirs["dev"]
        assert ours["test"] == theirs["test"] and len(ours["test"]["scores"]) == 3  # the added seed trained too
        assert ours["before_widening"] == {"lr": 4e-4, "test": narrow["tasks"]["bbc_news"]["models"][row]["test"]}
        curve = ours["label_efficiency"]  # the curve's seeds (the study's), at the new rate
        assert curve["8"]["scores"] == pytest.approx([0.3 + 0.0008, 0.31 + 0.0008])
        assert curve["32"]["scores"] == ours["test"]["scores"][:2]
        assert wide["average"][row] == whole["average"][row]
    # trained: the new rates on dev for each row, nothing else on dev
    dev_runs = sorted((c[0], c[3]) for c in widening if c[2] == dev)
    assert dev_runs == sorted((scratch, lr) for scratch in (False, True) for lr in (1e-4, 8e-4, 1e-3))
    assert json.loads((tmp_path / "wide.json").read_text()) == wide


def test_a_borrowing_study_takes_its_widened_controls_from_their_source(
    tiny_cramming_run, tmp_path, rate_dependent_scores
):
    runs = {"again": tiny_cramming_run}
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "first.json", progress=False)
    run_study(runs, CONFIG, out=tmp_path / "second.json", progress=False, controls_from=tmp_path / "first.json")
    with pytest.raises(ValueError, match=r"random init: borrowed from .*first.json, which has not been widened"):
        widen_sweep(tmp_path / "second.json", runs, [8e-4], progress=False)
    first = widen_sweep(tmp_path / "first.json", {"crammed": tiny_cramming_run}, [8e-4], out=tmp_path / "wide1.json",
                        progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="which has not been widened to"):  # widened, but to another grid
        widen_sweep(tmp_path / "second.json", runs, [1e-3], progress=False, controls_from=tmp_path / "wide1.json")
    trained = len(rate_dependent_scores)
    second = widen_sweep(tmp_path / "second.json", runs, [8e-4], progress=False, controls_from=tmp_path / "wide1.json")
    then, now = first["tasks"]["bbc_news"]["models"], second["tasks"]["bbc_news"]["models"]
    assert now["random init"] == then["random init"] | {"borrowed": True}  # taken over, not trained again
    assert not any(scratch for scratch, *_ in rate_dependent_scores[trained:])
    assert now["again"]["lr"] == 8e-4 and now["again"]["test"] == then["crammed"]["test"]
    assert second["widened"]["controls_from"] == str(tmp_path / "wide1.json")
    assert second["average"]["random init"] == first["average"]["random init"]


@pytest.mark.parametrize(
    "lrs, message",
    [([4e-4], "got \\[0.0004\\]"), ([8e-4, 8e-4], "each once"), ([-1e-3], "positive"), ([], "give new")],
)
def test_rates_already_swept_or_not_rates_are_refused(tiny_cramming_run, tmp_path, lrs, message, rate_dependent_scores):
    run_study(
        {"crammed": tiny_cramming_run}, replace(CONFIG, label_sizes=()), out=tmp_path / "one.json", progress=False
    )
    with pytest.raises(ValueError, match=message):
        widen_sweep(tmp_path / "one.json", {"crammed": tiny_cramming_run}, lrs, progress=False)


def test_the_runs_must_be_the_studys_own(tiny_cramming_run, tmp_path, rate_dependent_scores):
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "one.json", progress=False)
    with pytest.raises(ValueError, match="give exactly those"):
        widen_sweep(tmp_path / "one.json", {"other": tiny_cramming_run}, [8e-4], progress=False)
    study = json.loads((tmp_path / "one.json").read_text())
    study["config"]["lrs"] = [8e-4, 4e-4]
    (tmp_path / "unsorted.json").write_text(json.dumps(study))
    with pytest.raises(ValueError, match="not in rising order"):
        widen_sweep(tmp_path / "unsorted.json", {"crammed": tiny_cramming_run}, [1e-3], progress=False)
