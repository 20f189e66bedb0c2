"""More seeds for a finished study: the same numbers as a study run with them from the start, and refusals."""

import json
import shutil
from dataclasses import replace

import pytest

from llmedu.cramming.studies.more_seeds import add_seeds
from llmedu.cramming.studies.study import FINGERPRINT, StudyConfig, run_study

CONFIG = StudyConfig(tasks=("bbc_news",), lrs=(4e-4,), seeds=(0,), label_sizes=(), epochs=1, max_train=32,
                     max_eval=16, minilm=False)  # fmt: skip


def test_added_seeds_score_what_a_study_with_them_scores(tiny_cramming_run, tmp_path, seed_dependent_scores):
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "one.json", progress=False)
    added = add_seeds(
        tmp_path / "one.json", {"crammed": tiny_cramming_run}, [1, 2], out=tmp_path / "added.json", progress=False
    )
    whole = run_study({"crammed": tiny_cramming_run}, replace(CONFIG, seeds=(0, 1, 2)), progress=False)
    rows = added["added_seeds"]["rows"]
    assert rows == ["crammed", "random init"] and added["added_seeds"]["seeds"] == [1, 2]
    for row in rows:
        ours, theirs = (
            added["tasks"]["bbc_news"]["models"][row]["test"],
            whole["tasks"]["bbc_news"]["models"][row]["test"],
        )
        assert ours == theirs and len(set(ours["scores"])) == 3, row
        assert added["average"][row] == whole["average"][row]
    probe = added["tasks"]["bbc_news"]["models"]["crammed, linear probe"]["test"]["scores"]
    assert len(probe) == 1  # deterministic rows keep their one score
    assert json.loads((tmp_path / "added.json").read_text()) == added
    from llmedu.cramming.__main__ import main  # the same from the command line

    cli = main(["more-seeds", "--study", str(tmp_path / "one.json"), "--runs", f"crammed={tiny_cramming_run}", "--seeds", "1",
                "2", "--out", str(tmp_path / "cli.json")])  # fmt: skip
    from_cli = json.loads((tmp_path / "cli.json").read_text())
    assert from_cli["added_seeds"].pop("seconds") and added["added_seeds"].pop("seconds")  # timings differ
    assert from_cli == added and cli["out"] == str(tmp_path / "cli.json")
    with pytest.raises(ValueError, match=r"already has \[0, 1, 2\], got \[2, 3\]"):
        add_seeds(tmp_path / "added.json", {"crammed": tiny_cramming_run}, [2, 3], progress=False)


def test_a_borrowing_study_takes_its_controls_new_seeds_from_their_source(
    tiny_cramming_run, tmp_path, seed_dependent_scores
):
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "first.json", progress=False)
    run_study(
        {"again": tiny_cramming_run},
        CONFIG,
        out=tmp_path / "second.json",
        progress=False,
        controls_from=tmp_path / "first.json",
    )
    with pytest.raises(ValueError, match="random init: borrowed from .*first.json.*add them there first"):
        add_seeds(tmp_path / "second.json", {"again": tiny_cramming_run}, [1], progress=False)
    first = add_seeds(
        tmp_path / "first.json", {"crammed": tiny_cramming_run}, [1], out=tmp_path / "first+1.json", progress=False
    )
    with pytest.raises(ValueError, match="first.json, which does not hold seeds"):  # the recorded source: still seed 0
        add_seeds(tmp_path / "second.json", {"again": tiny_cramming_run}, [1], progress=False)
    second = add_seeds(
        tmp_path / "second.json",
        {"again": tiny_cramming_run},
        [1],
        progress=False,
        controls_from=tmp_path / "first+1.json",
    )
    assert second["added_seeds"]["controls_from"] == str(tmp_path / "first+1.json")
    then, now = first["tasks"]["bbc_news"]["models"], second["tasks"]["bbc_news"]["models"]
    assert now["random init"]["test"] == then["random init"]["test"]  # taken over, not trained again
    assert now["again"]["test"] == then["crammed"]["test"]  # same weights, same seeds: trained again, same scores


def test_the_runs_must_be_the_studys_own(tiny_cramming_run, tmp_path):
    run_study({"crammed": tiny_cramming_run}, CONFIG, out=tmp_path / "one.json", progress=False)
    with pytest.raises(ValueError, match="give exactly those"):
        add_seeds(tmp_path / "one.json", {"other": tiny_cramming_run}, [1], progress=False)
    other = tmp_path / "other"
    shutil.copytree(tiny_cramming_run, other)
    summary = json.loads((other / "summary.json").read_text())
    (other / "summary.json").write_text(json.dumps(summary | {"steps": summary["steps"] + 1}))
    with pytest.raises(ValueError, match="not the run the study measured"):
        add_seeds(tmp_path / "one.json", {"crammed": other}, [1], progress=False)
    other_splits = json.loads((tmp_path / "one.json").read_text())
    other_splits["tasks"]["bbc_news"]["digests"]["test"] = "0" * 16
    (tmp_path / "other_splits.json").write_text(json.dumps(other_splits))
    with pytest.raises(ValueError, match="bbc_news: the splits made here .* are not the ones"):
        add_seeds(tmp_path / "other_splits.json", {"crammed": tiny_cramming_run}, [1], progress=False)
    moved = json.loads((tmp_path / "one.json").read_text())
    moved["tasks"]["bbc_news"]["models"][FINGERPRINT]["test"]["mean"] += 3 / 16  # 3 of 16: another tokenizer or shape
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    with pytest.raises(ValueError, match="random-init probe scores"):
        add_seeds(tmp_path / "moved.json", {"crammed": tiny_cramming_run}, [1], progress=False)


def test_the_recorded_five_seed_studies_extend_the_three_seed_ones():
    """Lesson 25's five-seed files: the first three seeds and everything else are the recorded studies', the
    hour's control is the half-hour's (borrowed), and the gaps read as the lesson says."""
    from llmedu.cramming.studies.report import RECORDED, RECORDED_FIVE_SEEDS, RECORDED_HOUR, headline, load_study

    for three, five in ((RECORDED, RECORDED_FIVE_SEEDS["30 min"]), (RECORDED_HOUR, RECORDED_FIVE_SEEDS["60 min"])):
        before, after = load_study(three), load_study(five)
        assert after["added_seeds"]["seeds"] == [3, 4] and after["added_seeds"]["rows"] == ["crammed", "random init"]
        for task, entry in before["tasks"].items():
            for row, result in entry["models"].items():
                extended = after["tasks"][task]["models"][row]
                assert {k: v for k, v in extended.items() if k != "test"} == {
                    k: v for k, v in result.items() if k != "test"
                }
                n = 5 if row in after["added_seeds"]["rows"] else 3
                assert (
                    extended["test"]["scores"][:3] == result["test"]["scores"] and len(extended["test"]["scores"]) == n
                )
    half, hour = (load_study(RECORDED_FIVE_SEEDS[k]) for k in ("30 min", "60 min"))
    for task in half["tasks"]:
        assert (
            hour["tasks"][task]["models"]["random init"]["test"] == half["tasks"][task]["models"]["random init"]["test"]
        )
    paired = headline(hour)["paired"]
    assert paired["dof"] == 4 and 0.01 < paired["p"] < 0.02 and paired["interval95"][0] < 0.03 < paired["interval95"][1]
