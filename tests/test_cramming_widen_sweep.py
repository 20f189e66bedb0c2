"""Widening a finished study's sweep: the same rows as a study run with the wider grid, and refusals."""

import json
from dataclasses import replace

import pytest

from llmedu.cramming.evaluate import make_splits
from llmedu.cramming.studies.more_seeds import add_seeds
from llmedu.cramming.studies.study import StudyConfig, run_study
from llmedu.cramming.studies.widen_sweep import widen_sweep

CONFIG = StudyConfig(tasks=("rotten_tomatoes", "bbc_news"), lrs=(4e-4,), seeds=(0, 1), label_sizes=(8, None), epochs=1,
                     max_train=32, max_eval=16, minilm=False)  # fmt: skip
NEW = [1e-3, 8e-4, 1e-4]  # out of order on purpose: the grid is sorted
# dev accuracy by (task, from scratch) and rate. bbc_news: the pretrained row's new 1e-4 ties its 4e-4 (the lower
# rate wins: a move down), random init's 8e-4 beats all (a move up); rotten_tomatoes: neither moves (the
# pretrained row's 1e-3 only ties its 4e-4).
DEV = {
    ("bbc_news", False): {1e-4: 0.2, 4e-4: 0.2, 8e-4: 0.1, 1e-3: 0.1},
    ("bbc_news", True): {1e-4: 0.1, 4e-4: 0.2, 8e-4: 0.4, 1e-3: 0.3},
    ("rotten_tomatoes", False): {1e-4: 0.1, 4e-4: 0.3, 8e-4: 0.2, 1e-3: 0.3},
    ("rotten_tomatoes", True): {1e-4: 0.1, 4e-4: 0.3, 8e-4: 0.2, 1e-3: 0.2},
}
MOVED = {("bbc_news", "crammed"): 1e-4, ("bbc_news", "random init"): 8e-4}


@pytest.fixture
def scripted_scores(monkeypatch):
    """Fine-tunes scored from a script: dev by ``DEV``, test by the rate, the seed and the train size (so a moved
    rate, each seed and each label slice show). Every call is recorded as (from scratch, split, lr, seed, n)."""
    dev = {make_splits(t, CONFIG.dev_fraction, max_train=32, max_eval=16).dev: t for t in CONFIG.tasks}
    calls, fail_on = [], set()

    def finetune_scorer(folder, from_scratch=False, settings=None):
        def score(train, test, lr, seed):
            split = f"{dev[test]} dev" if test in dev else "test"
            if split in fail_on:
                raise RuntimeError(f"stopped at {split}")
            calls.append((from_scratch, split, lr, seed, len(train)))
            base = DEV[dev[test], from_scratch][lr] if test in dev else 0.5 + lr
            return base + seed / 100 + len(train) / 1e4

        return score

    monkeypatch.setattr("llmedu.cramming.studies.study.finetune_scorer", finetune_scorer)
    return calls, fail_on


def _without(row: dict, *keys) -> dict:
    return {k: v for k, v in row.items() if k not in keys}


def test_a_widened_study_holds_what_a_study_with_the_wide_grid_holds(tiny_cramming_run, tmp_path, scripted_scores):
    calls, _ = scripted_scores
    runs = {"crammed": tiny_cramming_run}
    run_study(runs, CONFIG, out=tmp_path / "narrow.json", progress=False)
    narrow = add_seeds(tmp_path / "narrow.json", runs, [2], out=tmp_path / "narrow3.json", progress=False)
    calls.clear()
    wide = widen_sweep(tmp_path / "narrow3.json", runs, NEW, out=tmp_path / "wide.json", progress=False)
    widening = list(calls)
    run_study(runs, replace(CONFIG, lrs=(1e-4, 4e-4, 8e-4, 1e-3)), out=tmp_path / "whole.json", progress=False)
    whole = add_seeds(tmp_path / "whole.json", runs, [2], progress=False)  # the wide grid from the start
    assert wide["config"]["lrs"] == whole["config"]["lrs"] == [1e-4, 4e-4, 8e-4, 1e-3]
    assert wide["widened"] | {"seconds": None} == {
        "lrs": [1e-4, 8e-4, 1e-3],
        "rows": ["crammed", "random init"],
        "moved": {"rotten_tomatoes": [], "bbc_news": ["crammed", "random init"]},
        "seconds": None,
    }
    for task in CONFIG.tasks:
        for row in ("crammed", "random init"):
            ours, before = wide["tasks"][task]["models"][row], narrow["tasks"][task]["models"][row]
            theirs = whole["tasks"][task]["models"][row]
            assert _without(ours, "seconds", "before_widening") == _without(theirs, "seconds"), (task, row)
            if (task, row) in MOVED:
                assert ours["lr"] == MOVED[task, row] and len(set(ours["test"]["scores"])) == 3
                assert ours["before_widening"] == {"lr": 4e-4, "test": before["test"]}
            else:  # nothing trained again: the row as it was, but for its dev scores at the new rates
                assert _without(ours, "dev") == _without(before, "dev") and "before_widening" not in ours
    assert wide["average"] == whole["average"] and list(wide["average"]) == list(narrow["average"])
    assert json.loads((tmp_path / "wide.json").read_text()) == wide
    # what trained: each row's new rates on each dev split; on test, only the moved rows: all three seeds on
    # the whole train split, and the label curve's slice of 8 with the study's two seeds (its all-labels point
    # is the first two test scores, not trained again)
    dev_runs = sorted(c[:3] for c in widening if c[1] != "test")
    assert dev_runs == sorted(
        (s, f"{t} dev", lr) for t in CONFIG.tasks for s in (False, True) for lr in [1e-4, 8e-4, 1e-3]
    )
    test_runs = sorted((c[0], c[2], c[3], c[4]) for c in widening if c[1] == "test")
    n = whole["tasks"]["bbc_news"]["sizes"]["train"]
    expected = [(row == "random init", lr, seed, size) for (_, row), lr in MOVED.items()
                for seed, size in [(0, n), (1, n), (2, n), (0, 8), (1, 8)]]  # fmt: skip
    assert test_runs == sorted(expected)
    from llmedu.cramming.__main__ import main  # the same from the command line

    cli = main(["widen-sweep", "--study", str(tmp_path / "narrow3.json"), "--runs", f"crammed={tiny_cramming_run}",
                "--lrs", *map(str, NEW), "--out", str(tmp_path / "cli.json")])  # fmt: skip
    from_cli = json.loads((tmp_path / "cli.json").read_text())
    assert from_cli["widened"].pop("seconds") and wide["widened"].pop("seconds")  # timings differ
    assert from_cli == wide and cli["moved"] == wide["widened"]["moved"]
    with pytest.raises(ValueError, match="was widened already"):
        widen_sweep(tmp_path / "wide.json", runs, [3e-3], progress=False)


def test_a_stopped_widening_leaves_a_file_that_says_so(tiny_cramming_run, tmp_path, scripted_scores):
    _, fail_on = scripted_scores
    runs = {"crammed": tiny_cramming_run}
    study = run_study(runs, CONFIG, out=tmp_path / "narrow.json", progress=False)
    fail_on.add("bbc_news dev")
    with pytest.raises(RuntimeError, match="stopped at bbc_news dev"):
        widen_sweep(tmp_path / "narrow.json", runs, NEW, out=tmp_path / "part.json", progress=False)
    part = json.loads((tmp_path / "part.json").read_text())
    assert part["widened"]["unfinished"] and list(part["widened"]["moved"]) == ["rotten_tomatoes"]
    assert set(part["average"]) == set(study["average"]) - {"crammed", "random init"}  # no half-widened average
    assert part["config"]["lrs"] == [4e-4] and part["tasks"]["bbc_news"] == study["tasks"]["bbc_news"]
    with pytest.raises(ValueError, match="was widened already"):
        widen_sweep(tmp_path / "part.json", runs, NEW, progress=False)


def test_a_borrowing_study_takes_its_widened_controls_from_their_source(tiny_cramming_run, tmp_path, scripted_scores):
    calls, _ = scripted_scores
    runs = {"again": tiny_cramming_run}
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "first.json", progress=False)
    run_study(runs, CONFIG, out=tmp_path / "second.json", progress=False, controls_from=tmp_path / "first.json")
    calls.clear()
    with pytest.raises(ValueError, match=r"random init: borrowed from .*first.json, which has not been widened"):
        widen_sweep(tmp_path / "second.json", runs, NEW, progress=False)
    assert calls == []  # refused before anything trained
    first = widen_sweep(tmp_path / "first.json", {"crammed": tiny_cramming_run}, NEW, out=tmp_path / "wide1.json",
                        progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="which has not been widened to"):  # widened, but to another grid
        widen_sweep(tmp_path / "second.json", runs, [1e-3], progress=False, controls_from=tmp_path / "wide1.json")
    tampered = json.loads((tmp_path / "wide1.json").read_text())
    tampered["tasks"]["bbc_news"]["models"]["random init"]["before_widening"]["test"]["scores"][1] += 0.01
    (tmp_path / "tampered.json").write_text(json.dumps(tampered))
    with pytest.raises(ValueError, match="bbc_news, random init: .*tampered.json held other dev or test scores"):
        widen_sweep(tmp_path / "second.json", runs, NEW, progress=False, controls_from=tmp_path / "tampered.json")
    add_seeds(tmp_path / "wide1.json", {"crammed": tiny_cramming_run}, [2], out=tmp_path / "more.json", progress=False)
    with pytest.raises(ValueError, match=r"holds the test seeds \[0, 1, 2\], this study \[0, 1\]"):
        widen_sweep(tmp_path / "second.json", runs, NEW, progress=False, controls_from=tmp_path / "more.json")
    calls.clear()
    second = widen_sweep(tmp_path / "second.json", runs, NEW, progress=False, controls_from=tmp_path / "wide1.json")
    then, now = first["tasks"]["bbc_news"]["models"], second["tasks"]["bbc_news"]["models"]
    assert now["random init"] == then["random init"] | {"borrowed": True}  # taken over, not trained again
    assert calls and not any(scratch for scratch, *_ in calls)
    assert now["again"] == then["crammed"]  # same weights, same scripted scores
    assert second["widened"]["controls_from"] == str(tmp_path / "wide1.json")
    assert second["average"]["random init"] == first["average"]["random init"]


@pytest.mark.parametrize(
    "lrs, message",
    [([4e-4], r"got \[0.0004\]"), ([8e-4, 8e-4], "each once"), ([-1e-3], "positive"), ([float("nan")], "positive"),
     ([], "give new")],
)  # fmt: skip
def test_rates_already_swept_or_not_rates_are_refused(tiny_cramming_run, tmp_path, lrs, message, scripted_scores):
    run_study(
        {"crammed": tiny_cramming_run}, replace(CONFIG, label_sizes=()), out=tmp_path / "one.json", progress=False
    )
    with pytest.raises(ValueError, match=message):
        widen_sweep(tmp_path / "one.json", {"crammed": tiny_cramming_run}, lrs, progress=False)


def test_the_runs_and_scores_must_be_the_studys_own(tiny_cramming_run, tmp_path, scripted_scores):
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "one.json", progress=False)
    with pytest.raises(ValueError, match="give exactly those"):
        widen_sweep(tmp_path / "one.json", {"other": tiny_cramming_run}, [8e-4], progress=False)
    study = json.loads((tmp_path / "one.json").read_text())
    unsorted = json.loads(json.dumps(study))
    unsorted["config"]["lrs"] = [8e-4, 4e-4]
    (tmp_path / "unsorted.json").write_text(json.dumps(unsorted))
    with pytest.raises(ValueError, match="to another file than .*one.json: a stopped widening starts again from it"):
        widen_sweep(tmp_path / "one.json", {"crammed": tiny_cramming_run}, [1e-3], out=tmp_path / "one.json")
    with pytest.raises(ValueError, match="not in rising order"):
        widen_sweep(tmp_path / "unsorted.json", {"crammed": tiny_cramming_run}, [1e-3], progress=False)
    study["added_seeds"] = {"seeds": [2], "rows": ["crammed", "random init"], "seconds": {}}  # a stopped more-seeds
    (tmp_path / "short.json").write_text(json.dumps(study))
    with pytest.raises(ValueError, match=r"rotten_tomatoes, crammed: .*short.json holds another number of test"):
        widen_sweep(tmp_path / "short.json", {"crammed": tiny_cramming_run}, [1e-3], progress=False)


def test_another_split_on_the_last_task_is_refused_before_any_fine_tune(tiny_cramming_run, tmp_path, scripted_scores):
    """The digests of every task are checked first: a mismatch on bbc_news (the second task) must not cost the
    rotten_tomatoes fine-tunes that come before it, in a widening or in more seeds."""
    calls, _ = scripted_scores
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "one.json", progress=False)
    study = json.loads((tmp_path / "one.json").read_text())
    study["tasks"]["bbc_news"]["digests"]["train"] = "0" * 16
    (tmp_path / "other.json").write_text(json.dumps(study))
    calls.clear()
    with pytest.raises(ValueError, match="bbc_news: the splits made here .* are not the ones .*other.json"):
        widen_sweep(tmp_path / "other.json", {"crammed": tiny_cramming_run}, [1e-3], progress=False)
    with pytest.raises(ValueError, match="bbc_news: the splits made here .* are not the ones .*other.json"):
        add_seeds(tmp_path / "other.json", {"crammed": tiny_cramming_run}, [5], progress=False)
    assert calls == []
    del study["tasks"]["bbc_news"]
    (tmp_path / "short.json").write_text(json.dumps(study))
    with pytest.raises(ValueError, match="short.json holds no results for bbc_news"):
        add_seeds(tmp_path / "short.json", {"crammed": tiny_cramming_run}, [5], progress=False)
    assert calls == []
