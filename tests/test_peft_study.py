"""Lesson 19's protocol study (llmedu.peft.study), its report and the cost probe, on a tiny config."""

import json
import math
import statistics

import pytest
import torch

from llmedu.peft import study, study_report
from llmedu.peft.cost import step_cost
from llmedu.peft.probe import MeanPooledProbe

TINY = study.StudyConfig(
    layers=1,
    steps=2,
    batch_size=4,
    n_train=8,
    n_dev=8,
    n_test=16,
    seeds=(0, 1),
    n_rates=2,
    methods=("linear probe", "prefix tuning", "prefix (shifted)"),
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("study") / "tiny.json"
    return path, study.run_study(TINY, path, command="test")


def test_the_protocol_picks_the_rate_on_dev_and_scores_every_seed_on_test(tiny):
    path, result = tiny
    assert result["sizes"] == {"train": 8, "dev": 8, "test": 16}
    for name in ("linear probe", "prefix tuning"):
        row = result["methods"][name]
        assert row["rates"] == list(study.METHODS[name][1][:2])
        assert row["lr"] == max(row["rates"], key=lambda lr: (row["dev"][str(lr)], -row["rates"].index(lr)))
        assert len(row["correct"]) == 2 and all(len(c) == 16 and set(c) <= {"0", "1"} for c in row["correct"])
        assert row["test"]["scores"] == [c.count("1") / 16 for c in row["correct"]]
    shifted = result["methods"]["prefix (shifted)"]
    assert shifted["same_rate_as"] == "prefix tuning" and shifted["lr"] == result["methods"]["prefix tuning"]["lr"]
    assert {"commit", "machine", "threads", "date", "command", "runs"} <= set(result["provenance"])
    assert result["provenance"]["runs"][-1]["wall_seconds"] > 0
    assert study_report.load(path)["methods"].keys() == result["methods"].keys()


def test_a_stopped_study_resumes_without_rerunning_what_it_holds(tiny, monkeypatch):
    path, result = tiny

    def fail(*args):
        raise AssertionError("a finished method was run again")

    monkeypatch.setattr(study, "run_method", fail)
    again = study.run_study(TINY, path, command="test")
    assert again["methods"] == result["methods"]


def test_an_existing_file_of_another_config_is_refused(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="another config"):
        study.run_study(study.StudyConfig(layers=1, steps=3, methods=("linear probe",)), path)


def test_a_borrowed_rate_needs_its_method_first():
    with pytest.raises(ValueError, match="reuses the rate of 'prefix tuning'"):
        study.run_method(TINY, {}, "prefix (shifted)", chosen={})


def test_an_unfinished_study_is_not_read_as_a_table(tiny, tmp_path):
    _, result = tiny
    cut = {**result, "methods": {k: v for k, v in result["methods"].items() if k != "prefix (shifted)"}}
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    with pytest.raises(ValueError, match="prefix \\(shifted\\)"):
        study_report.load(tmp_path / "cut.json")


def test_parts_of_different_configs_do_not_merge(tiny, tmp_path):
    path, result = tiny
    other = {**result, "config": {**result["config"], "steps": 99}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="different configs"):
        study_report.merge([path, tmp_path / "other.json"], tmp_path / "merged.json")


def _row(correct, k=None):
    scores = [c.count("1") / len(c) for c in correct]
    std = statistics.stdev(scores) if len(scores) > 1 else 0.0
    return {"mean": statistics.fmean(scores), "std": std, "k": k or len(correct), "correct": correct}


def test_the_difference_is_paired_over_snippets_and_adds_the_seed_spread():
    # A and B agree on 90 of 100 snippets; A alone is right on 8, B alone on 2: a 6-point gap.
    a = _row(["1" * 50 + "1" * 8 + "0" * 2 + "0" * 40] * 3)
    b = _row(["1" * 50 + "0" * 8 + "1" * 2 + "0" * 40] * 3)
    c = study_report.compare(a, b)
    d = [0.0] * 50 + [1.0] * 8 + [-1.0] * 2 + [0.0] * 40
    assert c["diff"] == pytest.approx(0.06)
    assert c["se_snippets"] == pytest.approx(statistics.stdev(d) / 10)
    assert c["se_seeds"] == 0.0  # every seed agrees
    unpaired = math.sqrt(0.58 * 0.42 / 100 + 0.52 * 0.48 / 100)  # what two independent test sets would give
    assert c["se"] < unpaired / 2
    # seeds that disagree add their spread: sqrt(sd_A^2/k_A + sd_B^2/k_B)
    a2 = _row(["1" * 60 + "0" * 40, "1" * 50 + "0" * 50, "1" * 55 + "0" * 45])
    c2 = study_report.compare(a2, b)
    assert c2["se_seeds"] == pytest.approx(a2["std"] / math.sqrt(3))
    assert c2["se"] == pytest.approx(math.hypot(c2["se_seeds"], c2["se_snippets"]))


def test_rows_of_different_test_splits_are_refused():
    with pytest.raises(ValueError, match="16 and 8"):
        study_report.compare(_row(["1" * 16]), _row(["1" * 8]))


class _Encoder(torch.nn.Module):
    def forward(self, input_ids, attention_mask):
        return type("Out", (), {"last_hidden_state": input_ids[..., None].float().expand(-1, -1, 3)})()


def test_the_probe_averages_the_real_tokens_only_and_keeps_its_encoder_in_eval_mode():
    model = torch.nn.Module()
    model.bert, model.classifier = _Encoder(), torch.nn.Identity()
    probe = MeanPooledProbe(model).train()
    assert probe.training and not probe.encoder.training
    ids, mask = torch.tensor([[2, 4, 9, 9]]), torch.tensor([[1, 1, 0, 0]])  # two real tokens, then padding
    assert probe(input_ids=ids, attention_mask=mask).logits.tolist() == [[3.0, 3.0, 3.0]]  # not [CLS]'s 2


def test_step_cost_counts_what_trains_and_needs_two_steps():
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(10, 4).requires_grad_(False), torch.nn.Linear(4, 2)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = embed, head

        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"logits": self.head(self.embed(input_ids).mean(1))})()

    batch = lambda i: (torch.randint(0, 10, (2, 3)), torch.ones(2, 3), torch.tensor([0, 1]))  # noqa: E731
    cost = step_cost(Tiny(), base_total=50, batch=batch, steps=3)
    assert cost["trainable"] == 10 and cost["percent"] == pytest.approx(20.0)
    assert cost["step_range"][0] <= cost["step_s"] <= cost["step_range"][1] and cost["file_bytes"] > 40
    with pytest.raises(ValueError, match="at least 2"):
        step_cost(Tiny(), base_total=50, batch=batch, steps=1)


def test_the_t_quantile_matches_the_tables():
    for df, t in [(1, 12.7062), (2, 4.3027), (10, 2.2281), (1e6, 1.9600)]:
        assert study_report.t_quantile(0.975, df) == pytest.approx(t, abs=1e-3)
    with pytest.raises(ValueError, match="df >= 1"):
        study_report.t_quantile(0.975, 0.5)


def test_a_gap_carried_by_three_seeds_needs_the_t_quantile_at_welch_df_not_two_standard_errors():
    n = 400  # A's three seeds score 60, 70, 80%; B is 50% on every seed
    a = _row(["1" * x + "0" * (n - x) for x in (240, 280, 320)])
    b = _row(["1" * 200 + "0" * 200] * 3)
    c = study_report.compare(a, b)
    v_seeds, v_snippets = a["std"] ** 2 / 3, c["se_snippets"] ** 2
    assert c["df"] == pytest.approx((v_seeds + v_snippets) ** 2 / (v_seeds**2 / 2 + v_snippets**2 / (n - 1)))
    assert 2 < c["df"] < 3 and c["t_crit"] == pytest.approx(study_report.t_quantile(0.975, c["df"]))
    assert c["ratio"] > 3 and not c["resolved"]  # over 3 SE, resolved by the old fixed 2-SE rule; not at df ~ 2.4
    # the same gap from snippets alone (every seed agrees) has df n - 1 and a critical value near 1.96
    a1 = _row(["1" * 50 + "1" * 8 + "0" * 2 + "0" * 40] * 3)
    b1 = _row(["1" * 50 + "0" * 8 + "1" * 2 + "0" * 40] * 3)
    c1 = study_report.compare(a1, b1)
    assert c1["df"] == pytest.approx(99) and c1["t_crit"] == pytest.approx(1.984, abs=1e-3)
    assert c1["resolved"] == (abs(c1["ratio"]) >= c1["t_crit"])


def test_the_sweep_lines_mark_a_tie_and_a_choice_at_the_edge_of_the_grid():
    study_ = {
        "methods": {
            "flat": {"rates": [1e-3, 3e-3], "dev": {"0.001": 0.6, "0.003": 0.6}, "lr": 1e-3},
            "rising": {"rates": [1e-3, 3e-3, 1e-2], "dev": {"0.001": 0.6, "0.003": 0.7, "0.01": 0.8}, "lr": 1e-2},
            "inside": {"rates": [1e-3, 3e-3, 1e-2], "dev": {"0.001": 0.6, "0.003": 0.8, "0.01": 0.7}, "lr": 3e-3},
            "borrowed": {"same_rate_as": "inside", "lr": 3e-3},
        }
    }
    lines = study_report.sweeps(study_).splitlines()[1:]
    assert "tie" in lines[0] and "[0.001 60.0%]" in lines[0]
    assert "edge: the top of the grid" in lines[1] and "[0.01 80.0%]" in lines[1]
    assert "tie" not in lines[2] and "edge" not in lines[2]
    assert "the rate of inside" in lines[3]
