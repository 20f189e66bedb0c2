"""The MoE lesson's study: its statistics, its guards, one tiny run, and the recorded result it wrote."""

import dataclasses
import json
import math

import pytest
import torch

from llmedu.models import TransformerConfig
from llmedu.models.config import MoEConfig
from llmedu.train.moe_study import (
    RESULT,
    StudyConfig,
    common_direction,
    imbalance,
    merge,
    paired_difference,
    run_study,
    summarise,
    t_two_sided_p,
    train_live,
    train_one,
)


def _runs(dense, moe):
    return [dict(model="dense", seed=i, held_out=v) for i, v in enumerate(dense)] + [
        dict(model="moe", seed=i, held_out=v) for i, v in enumerate(moe)
    ]


def test_summarise_gives_means_stds_and_the_standard_error_of_the_difference():
    s = summarise(_runs([2.0, 2.2, 2.4], [1.9, 2.0, 2.1]))
    assert s["dense"]["mean"] == pytest.approx(2.2) and s["dense"]["std"] == pytest.approx(0.2)  # n - 1
    assert s["moe"]["mean"] == pytest.approx(2.0) and s["moe"]["std"] == pytest.approx(0.1)
    assert s["difference"] == pytest.approx(-0.2)
    assert s["standard_error"] == pytest.approx(math.sqrt(0.04 / 3 + 0.01 / 3))


def test_summarise_refuses_a_single_seed():
    with pytest.raises(ValueError, match="at least 2 seeds"):
        summarise(_runs([2.0], [1.9, 2.0]))


def test_study_config_rejects_bad_values():
    with pytest.raises(ValueError, match="steps"):
        StudyConfig(steps=0)
    with pytest.raises(ValueError, match="warmup"):
        StudyConfig(steps=10, warmup=10)


def test_merge_refuses_different_configs_and_repeated_seeds(tmp_path):
    def part(name, config, seeds):
        path = tmp_path / name
        runs = [dict(model=m, seed=s, held_out=2.0 + s / 10) for s in seeds for m in ("dense", "moe")]
        path.write_text(json.dumps(dict(provenance=[{}], config=config, runs=runs)))
        return str(path)

    a, b = part("a.json", {"steps": 5}, [0]), part("b.json", {"steps": 5}, [1])
    assert len(merge([a, b])["runs"]) == 4
    with pytest.raises(ValueError, match="different configs"):
        merge([a, part("c.json", {"steps": 6}, [2])])
    with pytest.raises(ValueError, match="repeat"):
        merge([a, part("d.json", {"steps": 5}, [0])])


def test_common_direction_is_one_for_a_shared_direction_and_zero_without_one():
    v = torch.randn(16)
    assert common_direction(v.expand(10, 16) * torch.arange(1.0, 11.0)[:, None]) == pytest.approx(1.0)
    assert common_direction(torch.stack([v, -v, 2 * v, -2 * v]) + 1e-3) < 0.1  # the mean is ~0: no shared part


def test_a_tiny_run_trains_both_models_on_the_same_batches():
    cfg = StudyConfig(d_model=16, n_heads=2, n_layers=1, seq_len=16, batch=4, steps=3, warmup=1, eval_sequences=4)
    dense, moe = (train_one(cfg, moe, seed=0, log_every=2) for moe in (False, True))
    assert dense["tokens"] == moe["tokens"] == 3 * 4 * 16
    assert moe["parameters"] > dense["parameters"]  # 8 experts' weights...
    assert abs(moe["active_matmul"] - dense["active_matmul"]) <= 8 * 16  # ...and the FLOPs of one, plus the router
    assert [s for s, _ in dense["curve"]] == [0, 2] and math.isfinite(moe["held_out"])


def test_the_recorded_result_is_the_summary_of_its_runs():
    result = json.loads(RESULT.read_text())
    recorded, again = result["summary"], summarise(result["runs"])
    for key in ("difference", "standard_error"):
        assert recorded[key] == pytest.approx(again[key])
    for name in ("dense", "moe"):
        assert recorded[name] == pytest.approx(again[name])
    assert {(r["model"], r["seed"]) for r in result["runs"]} >= {(m, s) for m in ("dense", "moe") for s in range(3)}
    for p in result["provenance"]:
        assert {"command", "commit", "machine", "threads", "date"} <= set(p)


@pytest.mark.parametrize("t, dof", [(12.706, 1), (4.303, 2), (3.182, 3), (2.776, 4), (2.571, 5), (2.228, 10)])
def test_t_two_sided_p_matches_the_tables_5_percent_points(t, dof):
    assert t_two_sided_p(t, dof) == pytest.approx(0.05, abs=2e-4)
    assert t_two_sided_p(-t, dof) == t_two_sided_p(t, dof) and t_two_sided_p(0.0, dof) == pytest.approx(1.0)


def test_paired_difference_uses_the_per_seed_differences():
    # dense and MoE far apart between seeds, their differences close: the pairing removes the seed's share
    s = paired_difference(_runs([2.0, 2.2, 2.4], [1.9, 2.12, 2.28]))
    assert s["differences"] == pytest.approx([-0.1, -0.08, -0.12])
    assert s["mean"] == pytest.approx(-0.1) and s["dof"] == 2
    assert s["standard_error"] == pytest.approx(0.02 / math.sqrt(3))
    assert s["t"] == pytest.approx(-0.1 / (0.02 / math.sqrt(3)))
    assert s["p"] == pytest.approx(t_two_sided_p(s["t"], 2)) and s["p"] < 0.05
    assert s["standard_error"] < summarise(_runs([2.0, 2.2, 2.4], [1.9, 2.12, 2.28]))["standard_error"] / 5
    with pytest.raises(ValueError, match="at least 2 seeds"):
        paired_difference(_runs([2.0], [1.9]))


def test_run_study_names_the_commit_it_started_from(monkeypatch):
    import llmedu.train.moe_study as study

    trained = []  # HEAD moves while the study trains (others commit): the record must name the code that ran

    def train_one(cfg, moe, seed, data, log_every):
        trained.append(seed)
        return dict(model="moe" if moe else "dense", seed=seed, held_out=2.0, seconds=0.0)

    monkeypatch.setattr(study, "_commit", lambda: "a later commit" if trained else "the commit at the start")
    monkeypatch.setattr(study, "_data", lambda cfg: None)
    monkeypatch.setattr(study, "train_one", train_one)
    assert run_study(StudyConfig(), [0])["provenance"][0]["commit"] == "the commit at the start"


def test_train_live_records_every_layer_and_imbalance_reads_them():
    cfg = TransformerConfig(vocab_size=256, d_model=16, n_heads=2, n_layers=2, max_seq_len=8)
    cfg = dataclasses.replace(cfg, moe=MoEConfig(4, 1, 1.25, renormalize=False))
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    r = train_live(cfg, 3, lambda i: ids, ids, "cpu")
    assert r["loads"].shape == (3, 2, 4) and r["loads"].sum(-1).allclose(torch.ones(3, 2))
    assert len(r["lm"]) == len(r["dropped"]) == len(r["gate"]) == len(r["cos"]) == 3 and math.isfinite(r["valid"])
    loads = torch.tensor([[[0.7, 0.1, 0.1, 0.1], [0.25] * 4]] * 5)  # (steps, layers, E): layer 0 skewed
    first, second = imbalance(loads, last=2)
    assert first["starved"] == 3 and first["busiest"] == pytest.approx(0.7) and first["idlest"] == pytest.approx(0.1)
    assert second == dict(busiest=0.25, idlest=0.25, cv=0.0, starved=0)
