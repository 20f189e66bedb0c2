"""MiniLM added to a finished study: the row a study of its own would hold, a journal that survives stopping."""

import json
from dataclasses import replace

import pytest
import torch

from llmedu.cramming.evaluate import make_splits
from llmedu.cramming.studies.minilm_row import ROW, add_minilm
from llmedu.cramming.studies.more_seeds import add_seeds
from llmedu.cramming.studies.study import StudyConfig, run_study
from llmedu.cramming.studies.widen_sweep import widen_sweep
from llmedu.hardware.probe import machine_summary

CONFIG = StudyConfig(tasks=("rotten_tomatoes", "bbc_news"), lrs=(1e-4, 4e-4, 8e-4), seeds=(0, 1), label_sizes=(8, None),
                     epochs=1, max_train=32, max_eval=16, minilm_finetune=False)  # fmt: skip
DEV = {"rotten_tomatoes": {1e-4: 0.7, 4e-4: 0.7, 8e-4: 0.5}, "bbc_news": {1e-4: 0.6, 4e-4: 0.8, 8e-4: 0.7}}
CHOSEN = {"rotten_tomatoes": 1e-4, "bbc_news": 4e-4}  # rotten_tomatoes: a tie, to the lower rate


@pytest.fixture
def scripted(monkeypatch):
    """MiniLM's and our fine-tunes scored from a script (dev by ``DEV``; test by the rate, the seed, the train size
    and its labels, so a wrong rate, seed or label slice shows). MiniLM's calls are recorded as (task, split, lr, seed, n)."""
    splits = {t: make_splits(t, CONFIG.dev_fraction, max_train=32, max_eval=16) for t in CONFIG.tasks}
    named = {s.dev: (t, "dev") for t, s in splits.items()} | {s.test: (t, "test") for t, s in splits.items()}
    calls, stop_at = [], set()

    def minilm_scorer(settings=None):
        def score(train, test, lr, seed):
            task, split = named[test]
            if (task, split) in stop_at:
                raise KeyboardInterrupt(f"stopped at {task} {split}")
            calls.append((task, split, lr, seed, len(train)))
            if split == "dev":
                return DEV[task][lr]
            return 0.6 + 100 * lr + seed / 100 + len(train) / 1e4 + sum(train.labels) / 1e6  # the labels: which slice

        return score

    def finetune_scorer(folder, from_scratch=False, settings=None):
        return lambda train, test, lr, seed: 0.5 + lr + seed / 100 + len(train) / 1e4 + from_scratch / 10

    def minilm_features():  # MiniLM's probe row, from two cheap features instead of the model
        return (lambda texts: torch.tensor([[len(t), t.count(" ")] for t in texts], dtype=torch.float32)), None

    monkeypatch.setattr("llmedu.cramming.studies.study.minilm_features", minilm_features)
    for module in ("study", "minilm_row"):
        monkeypatch.setattr(f"llmedu.cramming.studies.{module}.minilm_scorer", minilm_scorer)
    monkeypatch.setattr("llmedu.cramming.studies.study.finetune_scorer", finetune_scorer)
    return calls, stop_at


def _expected_calls(tasks, n=32):
    """The fine-tunes a study runs for one row: every rate on dev (seed 0), the chosen rate on test with every seed
    (0, 1 and the added 2), the label curve's slice of 8 with the study's own seeds (all labels: the test runs)."""
    dev = [(t, "dev", lr, 0, n) for t in tasks for lr in CONFIG.lrs]
    test = [(t, "test", CHOSEN[t], s, n) for t in tasks for s in (0, 1, 2)]
    curve = [(t, "test", CHOSEN[t], s, 8) for t in tasks for s in (0, 1)]
    return sorted(dev + test + curve)


def _without_seconds(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "seconds"}


def test_the_added_row_is_the_row_of_a_study_that_fine_tuned_minilm_itself(tiny_cramming_run, tmp_path, scripted):
    calls, _ = scripted
    runs = {"crammed": tiny_cramming_run}
    run_study(runs, CONFIG, out=tmp_path / "probe_only.json", progress=False)
    before = add_seeds(tmp_path / "probe_only.json", runs, [2], out=tmp_path / "study.json", progress=False)
    calls.clear()
    journal = tmp_path / "journal.json"
    added = add_minilm(tmp_path / "study.json", journal, out=tmp_path / "added.json", progress=False)
    assert sorted(calls) == _expected_calls(CONFIG.tasks)
    run_study(runs, replace(CONFIG, minilm_finetune=True), out=tmp_path / "whole.json", progress=False)
    whole = add_seeds(tmp_path / "whole.json", runs, [2], progress=False)  # MiniLM fine-tuned from the start
    for task in CONFIG.tasks:
        ours, theirs = added["tasks"][task]["models"], whole["tasks"][task]["models"]
        assert list(ours) == list(theirs)  # the row where a study puts it
        assert _without_seconds(ours[ROW]) == _without_seconds(theirs[ROW])
        assert ours[ROW]["lr"] == CHOSEN[task] and len(set(ours[ROW]["test"]["scores"])) == 3
        assert {k: v for k, v in ours.items() if k != ROW} == before["tasks"][task]["models"]  # the rest untouched
    assert added["average"] == whole["average"] and list(added["average"]) == list(whole["average"])
    assert added["config"] == whole["config"] and added["config"]["minilm_finetune"]
    assert added["added_minilm"] | {"seconds": None} == {"journal": str(journal), "trained": 16, "read": 0,
                                                         "seconds": None, "at_edge": {"rotten_tomatoes": 1e-4}}  # fmt: skip
    assert json.loads((tmp_path / "added.json").read_text()) == added
    runs_journaled = json.loads(journal.read_text())["runs"]
    assert len(runs_journaled) == 16 and not list(tmp_path.glob("*.part"))
    assert {run["machine"] for run in runs_journaled.values()} == {machine_summary()}  # each run names its machine
    # the same command again reads every score back from the journal and trains nothing
    calls.clear()
    again = add_minilm(tmp_path / "study.json", journal, out=tmp_path / "again.json", progress=False)
    assert calls == [] and again["added_minilm"]["trained"] == 0 and again["added_minilm"]["read"] == 16
    assert again["tasks"] == added["tasks"] and again["average"] == added["average"]
    with pytest.raises(ValueError, match=f"has a '{ROW}' row already"):
        add_minilm(tmp_path / "added.json", journal, progress=False)
    from llmedu.cramming.__main__ import main  # the same from the command line

    cli = main(["add-minilm", "--study", str(tmp_path / "study.json"), "--journal", str(journal),
                "--out", str(tmp_path / "cli.json")])  # fmt: skip
    assert cli["trained"] == 0 and cli["read"] == 16 and cli["average"][ROW] == round(added["average"][ROW]["mean"], 4)
    assert json.loads((tmp_path / "cli.json").read_text())["tasks"] == added["tasks"]


def test_a_stopped_run_trains_only_what_its_journal_lacks(tiny_cramming_run, tmp_path, scripted):
    calls, stop_at = scripted
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "study.json", progress=False)
    journal, out = tmp_path / "journal.json", tmp_path / "added.json"
    stop_at.add(("bbc_news", "test"))  # stopped after bbc_news's dev sweep
    with pytest.raises(KeyboardInterrupt):
        add_minilm(tmp_path / "study.json", journal, out=out, progress=False)
    assert not out.exists()  # the study is written once, whole
    kept = json.loads(journal.read_text())["runs"]
    assert sorted((e["task"], e["scored_on"], e["lr"], e["seed"], e["train"]) for e in kept.values()) == sorted(calls)
    assert len(kept) == 3 + 2 + 2 + 3  # rotten_tomatoes's sweep, test seeds and curve; bbc_news's sweep
    stop_at.clear()
    calls.clear()
    resumed = add_minilm(tmp_path / "study.json", journal, out=out, progress=False)
    assert sorted(calls) == sorted((t, "test", 4e-4, s, n) for s, n in [(0, 32), (1, 32), (0, 8), (1, 8)]
                                   for t in ["bbc_news"])  # fmt: skip
    assert resumed["added_minilm"]["trained"] == 4 and resumed["added_minilm"]["read"] == 10
    calls.clear()
    once = add_minilm(tmp_path / "study.json", tmp_path / "fresh.json", out=tmp_path / "once.json", progress=False)
    assert len(calls) == 14 and once["tasks"] == resumed["tasks"] and once["average"] == resumed["average"]


def test_a_study_borrowing_its_controls_finds_minilm_in_the_journal(tiny_cramming_run, tmp_path, scripted):
    calls, _ = scripted
    runs = {"again": tiny_cramming_run}
    first = tmp_path / "first.json"
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=first, progress=False)
    run_study(runs, CONFIG, out=tmp_path / "second.json", progress=False, controls_from=first)
    journal = tmp_path / "journal.json"
    one = add_minilm(first, journal, out=tmp_path / "first_added.json", progress=False)
    calls.clear()
    two = add_minilm(tmp_path / "second.json", journal, out=tmp_path / "second_added.json", progress=False)
    assert calls == [] and two["added_minilm"]["trained"] == 0  # the same protocol and splits: every run journaled
    assert two["tasks"]["bbc_news"]["models"][ROW] == one["tasks"]["bbc_news"]["models"][ROW]
    assert two["added_minilm"]["read"] == one["added_minilm"]["trained"] == 14


def test_journals_of_other_fine_tunes_and_bad_files_are_refused(tiny_cramming_run, tmp_path, scripted):
    calls, _ = scripted
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "study.json", progress=False)
    run_study({"crammed": tiny_cramming_run}, replace(CONFIG, epochs=2), out=tmp_path / "two.json", progress=False)
    add_minilm(tmp_path / "two.json", tmp_path / "journal.json", progress=False)  # fine-tunes of 2 epochs
    calls.clear()
    with pytest.raises(ValueError, match=r"journal.json journals other fine-tunes \(settings: .*'epochs': 2"):
        add_minilm(tmp_path / "study.json", tmp_path / "journal.json", progress=False)
    (tmp_path / "broken.json").write_text('{"kind": "llmedu fine-tune journal", "runs": {')  # cut short
    with pytest.raises(ValueError, match="broken.json is not a fine-tune journal"):
        add_minilm(tmp_path / "study.json", tmp_path / "broken.json", progress=False)
    (tmp_path / "other.json").write_text(json.dumps({"runs": {}}))
    with pytest.raises(ValueError, match="other.json is not a fine-tune journal"):
        add_minilm(tmp_path / "study.json", tmp_path / "other.json", progress=False)
    journal = json.loads((tmp_path / "journal.json").read_text())
    (tmp_path / "old_torch.json").write_text(json.dumps(journal | {"torch": "1.0"}))
    with pytest.raises(ValueError, match=r"old_torch.json journals other fine-tunes \(torch: 1.0 there"):
        add_minilm(tmp_path / "two.json", tmp_path / "old_torch.json", progress=False)
    with pytest.raises(ValueError, match="another file than the journal"):
        add_minilm(tmp_path / "study.json", tmp_path / "journal.json", out=tmp_path / "journal.json")
    assert calls == []  # nothing trained for any refusal


def test_an_edited_or_textual_journal_score_is_refused_naming_entry_and_file(tiny_cramming_run, tmp_path, scripted):
    """A hand-edited dev score would move the chosen rate (rotten_tomatoes: 1e-4 by a tie); the entry's digest
    refuses it, as it refuses a score stored as a string, before anything is trained."""
    calls, _ = scripted
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "study.json", progress=False)
    journal_file = tmp_path / "journal.json"
    add_minilm(tmp_path / "study.json", journal_file, progress=False)
    journal = json.loads(journal_file.read_text())
    key = next(k for k, e in journal["runs"].items() if e["scored_on"] == "dev" and e["lr"] == 8e-4)
    assert journal["runs"][key]["task"] == "rotten_tomatoes" and journal["runs"][key]["sha256"]
    for name, score in (("edited.json", 0.99), ("text.json", "0.99")):
        runs = journal["runs"] | {key: journal["runs"][key] | {"score": score}}
        (tmp_path / name).write_text(json.dumps(journal | {"runs": runs}))
        calls.clear()
        what = "differs from the digest" if name == "edited.json" else "holds the score '0.99', not a number"
        with pytest.raises(ValueError, match=rf"{name}: entry '{key}' {what}"):
            add_minilm(tmp_path / "study.json", tmp_path / name, progress=False)
        assert calls == []


def test_the_recorded_journal_is_checked_entry_by_entry(tmp_path):
    """The recorded journal carries a digest per entry (added after its runs, from the entries as committed) and
    loads checked; the same journal without them reads back only when asked, with a warning."""
    from llmedu.cramming.studies.minilm_row import load_journal
    from llmedu.cramming.studies.report import RECORDED

    path = RECORDED.with_name("cramming_minilm_journal_cpu.json")
    recorded = json.loads(path.read_text())
    identity = {k: v for k, v in recorded.items() if k not in ("kind", "runs", "provenance")}
    assert len(load_journal(path, identity)["runs"]) == 62
    for entry in recorded["runs"].values():
        del entry["sha256"]
    old = tmp_path / "journal.json"
    old.write_text(json.dumps(recorded))
    with pytest.raises(ValueError, match=r"journal.json: 62 entries record no digest"):
        load_journal(old, identity)
    with pytest.warns(RuntimeWarning, match="read unchecked"):
        assert len(load_journal(old, identity, allow_unchecked=True)["runs"]) == 62


def _tampered(tmp_path, name: str, change) -> str:
    study = json.loads((tmp_path / "study.json").read_text())
    change(study)
    (tmp_path / name).write_text(json.dumps(study))
    return tmp_path / name


def test_splits_made_another_way_are_refused_before_any_fine_tune(tiny_cramming_run, tmp_path, scripted, monkeypatch):
    """Splits drawn with another seed hold the same counts: only their digests tell them from the study's."""
    calls, _ = scripted
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "study.json", progress=False)
    monkeypatch.setattr(
        "llmedu.cramming.studies.study.make_splits",
        lambda task, fraction, seed, **caps: make_splits(task, fraction, 1, **caps),
    )
    with pytest.raises(ValueError, match="rotten_tomatoes: the splits made here .* are not the ones"):
        add_minilm(tmp_path / "study.json", tmp_path / "journal.json", progress=False)
    assert calls == [] and not (tmp_path / "journal.json").exists()


def test_a_study_that_is_not_finished_or_not_on_its_splits_is_refused(tiny_cramming_run, tmp_path, scripted):
    calls, _ = scripted
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "study.json", progress=False)
    refusals = {
        "bbc_news: the splits made here .* are not the ones": lambda s: s["tasks"]["bbc_news"]["digests"].update(
            dev="0"
        ),
        "records no digests of the bbc_news splits": lambda s: s["tasks"]["bbc_news"].pop("digests"),
        "not a finished study": lambda s: s["tasks"].pop("bbc_news"),
        "not a finished study ": lambda s: s["average"].pop("random init"),
        "holds another number of test scores": lambda s: s.update(added_seeds={"seeds": [2], "seconds": {}}),
        "without MiniLM's rows": lambda s: s["config"].update(minilm=False),
    }
    for i, (message, change) in enumerate(refusals.items()):
        with pytest.raises(ValueError, match=message.strip()):
            add_minilm(_tampered(tmp_path, f"bad{i}.json", change), tmp_path / "journal.json", progress=False)
    assert calls == [] and not (tmp_path / "journal.json").exists()  # refused before anything trained
    import fcntl  # a second writer of the same journal is refused while the first holds it

    with open(tmp_path / "journal.json.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ValueError, match="another process is writing .*journal.json"):
            add_minilm(tmp_path / "study.json", tmp_path / "journal.json", progress=False)
    assert calls == []


def test_more_seeds_and_widening_refuse_a_study_with_the_added_row(tiny_cramming_run, tmp_path, scripted):
    runs = {"crammed": tiny_cramming_run}
    run_study(runs, CONFIG, out=tmp_path / "study.json", progress=False)
    add_minilm(tmp_path / "study.json", tmp_path / "journal.json", out=tmp_path / "added.json", progress=False)
    with pytest.raises(ValueError, match="holds a MiniLM row that add-minilm added, its runs journaled in"):
        add_seeds(tmp_path / "added.json", runs, [2], progress=False)
    with pytest.raises(ValueError, match="holds a MiniLM row that add-minilm added"):
        widen_sweep(tmp_path / "added.json", runs, [1e-3], out=tmp_path / "wide.json", progress=False)
    with pytest.raises(ValueError, match="add-minilm added its MiniLM row: borrow from the study it was added to"):
        run_study(runs, CONFIG, progress=False, controls_from=tmp_path / "added.json")


def test_a_stop_while_writing_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    from llmedu.cramming.studies.study import write_results

    out = tmp_path / "journal.json"
    write_results(out, {"runs": {"a": 1}})

    def stopped(src, dst):
        raise KeyboardInterrupt("stopped between writing and replacing")

    monkeypatch.setattr("llmedu.cramming.studies.study.os.replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        write_results(out, {"runs": {"a": 1, "b": 2}})
    assert json.loads(out.read_text()) == {"runs": {"a": 1}}  # the new version never half-replaced the old


def test_a_stopped_command_says_how_to_go_on():
    from llmedu.cramming.__main__ import stopped_message

    assert "run the same command to continue" in stopped_message(["add-minilm", "--study", "s.json"])
    assert "--resume" in stopped_message(["pretrain", "--budget", "1m"])
    assert "--resume" not in stopped_message(["widen-sweep", "--lrs", "1e-3"])  # it starts over from the study
