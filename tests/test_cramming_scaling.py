"""The scaling study: grids that keep their rules, counts of the built models, interpolation, the JSON and its errors."""

import json

import matplotlib
import pytest

from llmedu.cramming.__main__ import main
from llmedu.cramming.recipe import crammed
from llmedu.cramming.studies import budget_runs, scaling, scaling_grid
from llmedu.cramming.studies.budget_runs import StudyBudget, plan_evaluations
from llmedu.cramming.studies.scaling_grid import (
    BASES,
    GRIDS,
    PARAM_TOLERANCE,
    GridEntry,
    check_grid,
    parameter_counts,
    parse_entry,
)
from llmedu.cramming.studies.scaling_report import (
    common_tokens,
    load_scaling,
    loss_at_tokens,
    plot_scaling,
    scaling_table,
    scaling_verdict,
    size_and_shape_gaps,
)
from llmedu.models import MaskedLM
from llmedu.models.counting import count_parameters

matplotlib.use("Agg")

# the slice of text and the tokenizer sample of tests/test_cramming.py: its cached rows serve here too
SMOKE = ["--shape", "tiny", "--max-chars", "20000", "--tokenizer-chars", "30000"]


def _history(*points):
    return [{"step": 10 * i, "tokens": t, "elapsed": float(i), "val_loss": v} for i, (t, v) in enumerate(points, 1)]


def _results():
    """A hand-made study: two sizes, two shapes each; 'large' read the fewest tokens (1,000)."""

    def run(size, shape, history, tokens_per_s):
        return {
            "size": size,
            "shape": shape,
            "d_model": 8,
            "n_layers": 1,
            "n_heads": 1,
            "parameters": {"total": 200, "non_embedding": 100},
            "tokens_per_s": tokens_per_s,
            "tokens_seen": history[-1]["tokens"],
            "val_loss": history[-1]["val_loss"],
            "val_history": history,
        }

    return {
        "provenance": {"date": "2026-01-01"},
        "config": {"budget_seconds": 60.0, "reference": {"d_model": 8, "n_layers": 1, "non_embedding": 100}},
        "unigram_cross_entropy": 6.5,
        "runs": {
            "small-deep": run("small", "deep", _history((500, 7.0), (1500, 6.0), (3000, 5.5)), 50.0),
            "small-wide": run("small", "wide", _history((500, 7.2), (2500, 5.8)), 42.0),
            "large-deep": run("large", "deep", _history((400, 6.8), (1000, 5.6)), 17.0),
            "large-wide": run("large", "wide", _history((300, 6.9), (800, 5.9), (1200, 5.4)), 20.0),
        },
    }


def test_loss_at_a_common_token_count_is_interpolated_between_evaluations():
    history = _history((500, 7.0), (1500, 6.0), (3000, 5.5))
    assert loss_at_tokens(history, 1000) == pytest.approx(6.5)  # halfway from 7.0 to 6.0
    assert loss_at_tokens(history, 2000) == pytest.approx(6.0 - 0.5 / 3)
    assert loss_at_tokens(history, 500) == 7.0 and loss_at_tokens(history, 3000) == 5.5
    assert loss_at_tokens(history, 499) is None and loss_at_tokens(history, 3001) is None  # no extrapolation
    assert loss_at_tokens(list(reversed(history)), 1000) == pytest.approx(6.5)  # the order of the list is not trusted

    results = _results()
    assert common_tokens(results) == 1000  # the last evaluation of large-deep, which read the fewest tokens
    gaps = size_and_shape_gaps(results)
    # at 1,000 tokens: small 6.5 (deep) and 7.2 - 1.4 * 500 / 2000 = 6.85 (wide); large 5.6 and 5.9 - 0.5 * 0.5 = 5.65
    assert gaps["loss"]["small"] == pytest.approx({"deep": 6.5, "wide": 6.85})
    assert gaps["loss"]["large"] == pytest.approx({"deep": 5.6, "wide": 5.65})
    assert gaps["shape_spread"] == pytest.approx({"small": 0.35, "large": 0.05})
    assert gaps["size_steps"] == pytest.approx({"small -> large": (6.5 + 6.85) / 2 - (5.6 + 5.65) / 2})
    table = scaling_table(results)
    assert "loss @ 0.00M" in table and "6.850" in table and "5.650" in table and "large-deep" in table
    assert "6.500 nats" in table and "the run that read the fewest tokens" in table
    verdict = scaling_verdict(results)
    assert "differ by (nats): small 0.350, large 0.050" in verdict and "small -> large +1.050" in verdict
    assert "every shape gap smaller than every size step: yes" in verdict
    assert "lowest held-out loss large-wide (5.400" in verdict and "most tokens/s small-deep (50)" in verdict


def test_evaluations_are_placed_so_every_curve_reaches_below_the_common_token_count():
    plan = plan_evaluations({"slow": 10.0, "twice": 20.0, "fast": 100.0}, {"slow": 120, "twice": 240, "fast": 1200}, 12)
    assert plan == {"slow": 10, "twice": 10, "fast": 25}  # fast: 1200 * max(1/10, 1/4) / 12, capped at 4x the evals
    with pytest.raises(ValueError, match="evals must be >= 1"):
        plan_evaluations({"a": 1.0}, {"a": 10}, 0)


def test_the_names_lesson_25_imports_from_scaling_are_still_there():
    for name in ("GRIDS", "check_grid", "parameter_counts", "GridEntry", "parse_entry", "BASES", "PARAM_TOLERANCE"):
        assert getattr(scaling, name) is getattr(scaling_grid, name)
    for name in ("plan_evaluations", "probe_tokens_per_s", "StudyBudget"):
        assert getattr(scaling, name) is getattr(budget_runs, name)
    assert callable(scaling.run_scaling)


def test_a_study_budget_refuses_what_no_run_could_use():
    for kwargs, says in (
        (dict(budget_seconds=None), "give a budget in seconds, max_steps, or both"),
        (dict(budget_seconds=-1.0), "the budget must be a positive number of seconds, got -1.0"),
        (dict(budget_seconds=None, max_steps=0), "max_steps must be an int >= 1, got 0"),
        (dict(budget_seconds=5.0, eval_every=0), "eval_every must be an int >= 1, got 0"),
        (dict(budget_seconds=5.0, evals=0), "evals must be an int >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=says):
            StudyBudget(**kwargs)
    assert StudyBudget(5.0, corpora=["kjv"]).corpora == ("kjv",)


@pytest.mark.parametrize("shape", sorted(GRIDS))
def test_the_shapes_of_each_size_have_about_the_same_parameters(shape):
    counts = check_grid(GRIDS[shape], BASES[shape])
    sizes = list(dict.fromkeys(e.size for e in GRIDS[shape]))
    means = []
    for size in sizes:
        members = [counts[e.name]["non_embedding"] for e in GRIDS[shape] if e.size == size]
        assert len(members) == 2 and max(members) / min(members) - 1 <= PARAM_TOLERANCE
        means.append(sum(members) / 2)
        deep, wide = (e for e in GRIDS[shape] if e.size == size)
        assert deep.n_layers > wide.n_layers and deep.d_model < wide.d_model  # deep-narrow against shallow-wide
    assert all(b > 3 * a for a, b in zip(means, means[1:]))  # sizes a factor of about 4 apart


def test_parameter_counts_are_those_of_the_built_model():
    for entry in GRIDS["tiny"]:
        recipe = crammed(**{**BASES["tiny"], **entry.overrides()})
        model = MaskedLM(recipe.model)
        assert parameter_counts(recipe) == {
            "total": count_parameters(model),
            "non_embedding": count_parameters(model, embeddings=False),
        }


def test_a_grid_entry_that_breaks_the_rules_is_refused():
    with pytest.raises(ValueError, match="n_heads=3 does not divide d_model=64"):
        GridEntry("small", "deep", 64, 8, 3)
    with pytest.raises(ValueError, match="n_layers must be an int >= 1, got 0"):
        GridEntry("small", "deep", 64, 0, 2)
    with pytest.raises(ValueError, match="unknown grid entry 'medium-tall'.*small-deep, small-wide"):
        parse_entry("medium-tall", "cpu")
    with pytest.raises(ValueError, match="cannot read the grid entry"):
        parse_entry("huge=512,2", "cpu")
    assert parse_entry("huge-wide=512,2,16") == GridEntry("huge", "wide", 512, 2, 16)
    assert parse_entry("medium-deep") == GRIDS["cpu"][2]
    tiny = BASES["tiny"]
    with pytest.raises(ValueError, match="the shapes of size 'small' differ by .* more than the tolerance of 10%"):
        check_grid([GridEntry("small", "deep", 32, 8, 2), GridEntry("small", "wide", 64, 4, 2)], tiny)
    with pytest.raises(ValueError, match="names small-deep more than once"):
        check_grid([GRIDS["tiny"][0], GRIDS["tiny"][0]], tiny)
    with pytest.raises(ValueError, match="the grid is empty"):
        check_grid([], tiny)


def test_the_command_line_refuses_bad_input_before_running(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    for bad, says in (
        (["--grid", "small-tall"], "unknown grid entry 'small-tall'"),
        (["--grid", "small-deep=30,2,4"], "n_heads=4 does not divide d_model=30"),
        (["--grid", "small-deep", "small-wide=64,4,2"], "differ by"),
        (["--budget", "-5s"], "the budget must be positive, got '-5s'"),
        (["--budget", "0"], "the budget must be positive"),
        (["--evals", "0"], "--evals must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            main(["scaling", "--out", str(out), *SMOKE, *bad])
        assert says in capsys.readouterr().err
        assert not out.exists()


def test_a_smoke_study_writes_a_json_that_round_trips(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    printed = main(
        ["scaling", "--out", str(out), *SMOKE, "--budget", "60s", "--max-steps", "4", "--eval-every", "2"]
        + ["--eval-batches", "2", "--grid", "small-deep", "small-wide"]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == printed
    results = load_scaling(out)
    assert list(results["runs"]) == ["small-deep", "small-wide"] == list(printed["runs"])
    assert json.loads(json.dumps(results)) == results  # plain data
    assert results["config"]["budget_seconds"] == 60.0 and results["config"]["grid"][0]["d_model"] == 32
    assert results["provenance"]["command"].startswith("python -m llmedu.cramming scaling --out")
    assert {"date", "machine", "torch"} <= set(results["provenance"])
    assert 1.0 < results["unigram_cross_entropy"] < 7.0  # below ln(1024) = 6.93, the uniform guess
    for entry in GRIDS["tiny"][:2]:
        run = results["runs"][entry.name]
        model = MaskedLM(crammed(**{**BASES["tiny"], **entry.overrides()}).model)
        assert run["parameters"] == {
            "total": count_parameters(model),
            "non_embedding": count_parameters(model, embeddings=False),
        }
        assert run["steps"] == 4 and run["eval_every"] == 2 and run["flops_per_token"] > 0
        history = run["val_history"]
        assert [p["step"] for p in history] == [2, 4]  # the final evaluation is step 4's
        assert history[-1]["tokens"] == run["tokens_seen"] == 4 * 16 * 128  # TINY_SHAPE: 16 rows, no accumulation
        assert history[0]["tokens"] < history[1]["tokens"] and history[0]["elapsed"] < history[1]["elapsed"]
        assert history[-1]["val_loss"] == run["val_loss"]
    assert "small-deep" in scaling_table(results)
    plot_scaling(results)

    # files that are not a study's output are refused, each with what is wrong
    bad = tmp_path / "bad.json"
    with pytest.raises(FileNotFoundError, match="no scaling results here"):
        load_scaling(tmp_path / "missing.json")
    for text, says in (
        ("{not json", "is not JSON"),
        (json.dumps({"runs": {}}), "lacks provenance, config, unigram_cross_entropy"),
        (json.dumps({**results, "runs": {}}), "holds no finished run"),
        (json.dumps({**results, "runs": {"a": {"size": "s"}}}), "the run 'a' lacks shape, parameters"),
        (
            json.dumps({**results, "runs": {"a": {**results["runs"]["small-deep"], "val_history": [{"step": 1}]}}}),
            "the run 'a' has no held-out history",
        ),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match=says):
            load_scaling(bad)
