"""The MoE lesson's study: its statistics, its guards, one tiny run, and the recorded result it wrote."""

import json
import math

import pytest
import torch

from llmedu.train.moe_study import RESULT, StudyConfig, common_direction, merge, summarise, train_one


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
