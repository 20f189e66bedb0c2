"""The study report: the headline is the per-seed gap of task averages; bad files are clear errors."""

import json
import math

import matplotlib
import pytest

from llmedu.cramming.studies.report import (
    budget_table,
    headline,
    load_study,
    plot_label_efficiency,
    plot_pretraining,
    pretraining_table,
    reference_table,
    task_table,
)

matplotlib.use("Agg")


def _result(scores, lr=None, curve=None):
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (len(scores) - 1))
    r = {"lr": lr, "test": {"scores": scores, "mean": mean, "std": std}}
    if curve:
        r["label_efficiency"] = {k: {"scores": v, "mean": sum(v) / len(v)} for k, v in curve.items()}
    return r


STUDY = {
    "config": {},
    "pretraining": {
        "crammed": {
            "summary": {
                "steps": 100,
                "elapsed_seconds": 60.0,
                "tokens_seen": 2_000_000,
                "passes": 0.5,
                "corpus_tokens": 4_000_000,
                "val_loss": 5.2,
                "val_history": [
                    {"step": 50, "elapsed": 30.0, "val_loss": 6.0},
                    {"step": 100, "elapsed": 60.0, "val_loss": 5.2},
                ],
            },  # fmt: skip
            "unigram_cross_entropy": 6.4,
        }
    },
    "tasks": {
        "a": {
            "sizes": {"train": 200, "dev": 20, "test": 20},
            "models": {
                "crammed": _result([0.8, 0.7, 0.9], 4e-4, {"10": [0.5, 0.6, 0.5], "200": [0.8, 0.7, 0.9]}),
                "random init": _result([0.6, 0.6, 0.6], 8e-4, {"10": [0.5, 0.5, 0.5], "200": [0.6, 0.6, 0.6]}),
                "crammed, linear probe": _result([0.7, 0.7, 0.7]),
                "majority class": _result([0.5, 0.5, 0.5]),
            },
        },
        "b": {
            "sizes": {"train": 100, "dev": 20, "test": 20},
            "models": {
                "crammed": _result([0.6, 0.6, 0.7], 2e-4, {"100": [0.6, 0.6, 0.7]}),
                "random init": _result([0.6, 0.5, 0.6], 8e-4, {"100": [0.6, 0.5, 0.6]}),
                "crammed, linear probe": _result([0.5, 0.5, 0.5]),
                "majority class": _result([0.3, 0.3, 0.3]),
            },
        },
    },  # fmt: skip
    "average": {},
}


def test_headline_is_the_per_seed_gap_of_the_task_averages():
    h = headline(STUDY)
    # per seed: crammed (0.7, 0.65, 0.8), random (0.6, 0.55, 0.6): gaps 0.1, 0.1, 0.2
    assert h["gap_per_seed"] == pytest.approx([0.1, 0.1, 0.2])
    assert h["gap"] == pytest.approx(0.4 / 3) and h["gap_std"] == pytest.approx(math.sqrt(0.01 / 3))
    assert h["crammed"] == pytest.approx(2.15 / 3) and h["tasks"] == ["a", "b"]
    assert h["paired"]["mean"] == h["gap"] and h["paired"]["dof"] == 2  # the t-test of those three gaps
    with pytest.raises(KeyError, match="no model 'MiniLM-L6'"):
        headline(STUDY, pretrained="MiniLM-L6")
    unpaired = json.loads(json.dumps(STUDY))
    for task in unpaired["tasks"].values():
        task["models"]["crammed"]["test"]["scores"].append(0.7)  # a seed added to one row only
    with pytest.raises(ValueError, match="'crammed' has 4 seeds and 'random init' 3"):
        headline(unpaired)


def test_tables_show_every_model_and_the_chosen_rate():
    table = task_table(STUDY)
    assert "random init" in table and "80.0 +- 10.0 (4e-04)" in table and "majority class" in table
    assert "100 steps in 1.0 min, 2.0M tokens (0.50 passes over 4.00M)" in pretraining_table(STUDY)
    assert "held-out MLM loss 5.200 against the unigram line 6.400" in pretraining_table(STUDY)


def test_plots_draw_the_curves_and_the_calibration_lines():
    ax = plot_pretraining(STUDY)
    assert [round(y, 1) for y in ax.lines[0].get_ydata()] == [6.0, 5.2] and ax.lines[1].get_ydata()[0] == 6.4
    axes = plot_label_efficiency(STUDY)
    labels = [line.get_label() for line in axes[0].lines]
    assert labels[:2] == ["crammed", "random init"] and "majority class (200 labels)" in labels
    assert list(axes[0].lines[0].get_xdata()) == [10, 200]


def test_a_file_that_is_not_a_study_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no study results"):
        load_study(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_study(bad)
    bad.write_text(json.dumps({"config": {}, "tasks": {}}))
    with pytest.raises(ValueError, match="lacks pretraining, average"):
        load_study(bad)
    bad.write_text(json.dumps({"config": {}, "tasks": {}, "pretraining": {}, "average": {}}))
    with pytest.raises(ValueError, match="no finished task"):
        load_study(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(STUDY))
    assert load_study(good)["tasks"]["a"]["sizes"]["train"] == 200


def test_the_budget_table_reads_each_study_against_one_control():
    import copy

    longer = copy.deepcopy(STUDY)
    longer["pretraining"]["crammed"]["summary"] |= {"elapsed_seconds": 120.0, "tokens_seen": 4_000_000, "passes": 1.0}
    for task in longer["tasks"].values():  # every crammed score 0.05 higher: the gap grows by 5 points
        task["models"]["crammed"] = _result([x + 0.05 for x in task["models"]["crammed"]["test"]["scores"]])
    table = budget_table({"1 min": STUDY, "2 min": longer}).splitlines()
    assert table[2].split()[:6] == ["1", "min", "1.0", "2.0M", "0.50", "5.200"]
    # average per seed: (0.8 + 0.6) / 2, (0.7 + 0.6) / 2, (0.9 + 0.7) / 2 = 70, 65, 80 %; control 60, 55, 60;
    # gaps 10, 10, 20: mean 13.3, std 5.8
    assert table[2].endswith("71.7 +- 7.6    +13.3 +- 5.8")
    assert table[3].endswith("76.7 +- 7.6    +18.3 +- 5.8") and table[3].split()[2:5] == ["2.0", "4.0M", "1.00"]
    assert table[4].startswith("random init") and table[4].endswith("58.3 +- 2.9")

    other = copy.deepcopy(longer)
    other["tasks"]["a"]["models"]["random init"] = _result([0.5, 0.6, 0.6])
    with pytest.raises(ValueError, match="other 'random init' scores"):
        budget_table({"1 min": STUDY, "2 min": other})


def _with_reference(study: dict, scores: dict) -> dict:
    import copy

    study = copy.deepcopy(study)
    for task, row in scores.items():
        study["tasks"][task]["models"]["MiniLM-L6"] = _result(row, 1e-4)
    return study


def test_the_reference_table_puts_each_budget_between_random_init_and_minilm():
    import copy

    study = _with_reference(STUDY, {"a": [0.9, 0.9, 0.8], "b": [0.7, 0.8, 0.7]})
    longer = copy.deepcopy(study)
    for task in longer["tasks"].values():  # every crammed score 0.05 higher
        task["models"]["crammed"] = _result([x + 0.05 for x in task["models"]["crammed"]["test"]["scores"]])
    table = reference_table({"1 min": study, "2 min": longer}).splitlines()
    assert [line.split(",")[0].split()[0] for line in table[2:]] == ["random", "crammed", "crammed", "MiniLM-L6"]
    # per seed: crammed 70, 65, 80; random init 60, 55, 60; MiniLM 80, 85, 75 (%).
    # vs random init: gaps 10, 10, 20: mean 13.3, sd 5.77, se 3.33, t(2) 4.303: 13.3 +- 14.3
    # vs MiniLM: gaps -10, -20, 5: mean -8.3, sd 12.58, se 7.26: -8.3 +- 31.3
    words = [" ".join(line.split()) for line in table]
    assert words[2].endswith("56.7 +- 5.8 58.3 +- 2.9")  # no gaps on the floor's line
    assert words[3].endswith("71.7 +- 7.6 +13.3 [-1.0, +27.7] -8.3 [-39.6, +22.9]")
    assert words[4].endswith("76.7 +- 7.6 +18.3 [+4.0, +32.7] -3.3 [-34.6, +27.9]")
    # MiniLM vs random init: gaps 20, 30, 15: mean 21.7, sd 7.64, se 4.41: 21.7 +- 19.0
    assert words[5] == "MiniLM-L6 86.7 +- 5.8 73.3 +- 5.8 80.0 +- 5.0 +21.7 [+2.7, +40.6]"
    other = _with_reference(STUDY, {"a": [0.9, 0.9, 0.9], "b": [0.7, 0.8, 0.7]})
    with pytest.raises(ValueError, match="other 'MiniLM-L6' scores"):
        reference_table({"1 min": study, "2 min": other})
