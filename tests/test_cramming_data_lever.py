"""The data lever (cramming/studies/data_lever.py): each treatment does what it says, and a tiny study records
what the lesson's table needs."""

import io
import json
import math

import numpy as np
import pytest
import torch

from llmedu.cramming.__main__ import main
from llmedu.cramming.data import deduplicate
from llmedu.cramming.studies.data_lever import (
    TREATMENTS,
    InOrderBatches,
    _deduplicated,
    filter_by_compression,
    gap,
    prevalence_order,
    prevalence_scores,
    remove_seen,
    run_data_lever,
    threshold_for_share,
)
from llmedu.cramming.studies.final import DATA_LEVER, data_lever_gaps, data_lever_table
from llmedu.data.packing import MLMBatches
from llmedu.tokenizers import WordPieceTokenizer

LONG = "a line long enough to count as a repeated line when it comes back"  # >= MIN_LINE_CHARS


def test_dedup_removes_exact_duplicates_across_corpora_as_one_pass_over_all_would():
    corpora = {
        "a": ["first document\n" + LONG, "second document"],
        "b": ["first   document\n" + LONG, "third document\n" + LONG + "\nstill here", "fourth"],
    }
    kept, counts = _deduplicated(corpora)
    assert kept == {"a": corpora["a"], "b": ["third document\nstill here", "fourth"]}
    assert counts["duplicate_documents"] == 1 and counts["repeated_lines"] == 1
    together, _ = deduplicate([d for ds in corpora.values() for d in ds])
    assert [d for ds in kept.values() for d in ds] == together


def test_the_filter_drops_exactly_the_documents_at_or_above_the_threshold():
    rates = np.array([0.30, 0.45, 0.38, 0.45, 0.50, 0.29])
    chars = np.array([100, 100, 100, 100, 100, 500])  # 1000 characters
    assert filter_by_compression(rates, 0.45) == [0, 2, 5]  # 0.45 itself is dropped: tokens < t * chars are kept
    assert filter_by_compression(rates, 0.451) == [0, 1, 2, 3, 5]
    # the lowest threshold whose dropped documents hold the share: 10% is the 0.50 document alone, 20% adds one
    # document of 0.45, and ties go together (so 0.45 drops 30%)
    assert threshold_for_share(rates, chars, 0.10) == 0.50
    assert threshold_for_share(rates, chars, 0.15) == 0.45
    kept = filter_by_compression(rates, threshold_for_share(rates, chars, 0.15))
    assert 1 - chars[kept].sum() / chars.sum() == pytest.approx(0.30)
    with pytest.raises(ValueError, match="must be in \\(0, 1\\), got 1.5"):
        threshold_for_share(rates, chars, 1.5)


def test_the_sort_puts_rows_of_common_tokens_first_by_their_mean_unigram_log_probability():
    rows = torch.tensor([[5, 6, 7, 8], [1, 1, 1, 2], [1, 2, 1, 2], [9, 9, 5, 6]])  # (4, 4); 1 is the commonest
    counts = torch.bincount(rows.flatten(), minlength=10).double()
    by_hand = [sum(math.log2((counts[t] + 1) / (16 + 10)) for t in row) / 4 for row in rows.tolist()]
    assert prevalence_scores(rows, 10).tolist() == pytest.approx(by_hand)
    assert prevalence_order(rows, 10).tolist() == [1, 2, 3, 0]  # smoothed counts' geometric means 5.4, 4.9, 3, 2.4
    scores = prevalence_scores(rows, 10)[prevalence_order(rows, 10)]
    assert (scores[:-1] >= scores[1:]).all()


def test_in_order_batches_read_the_rows_in_their_order_and_mask_them_as_mlm_batches_do():
    tokenizer = WordPieceTokenizer().train("the cat sat on the mat and the dog sat on the log " * 20, 30)
    rows = torch.randint(5, tokenizer.vocab_size, (6, 8))  # (6, 8): ordinary tokens only
    batches = InOrderBatches(rows, 2, tokenizer, seed=3)
    shuffled = MLMBatches(rows, 2, tokenizer, seed=3)
    for i in range(5):  # two epochs and a half: the order starts again
        batch = batches(i)
        rows_read = rows[2 * (i % 3) : 2 * (i % 3) + 2]
        picked = batch["labels"] != -100
        assert torch.equal(batch["labels"][picked], rows_read[picked])
        assert torch.equal(batch["input_ids"][~picked], rows_read[~picked])
        assert torch.equal(picked, shuffled(i)["labels"] != -100)  # the same masks as the shuffled reader's


def test_held_out_text_that_the_training_text_holds_is_left_out_but_repeats_within_it_stay():
    train = ["some training text\n" + LONG, "a document seen whole"]
    held_out = [
        "a  document seen whole",
        "fresh start\n" + LONG + "\nfresh end",
        "own line twice, " + LONG[:20] * 2,
    ] * 2
    kept, counts = remove_seen(held_out, train)
    assert kept == ["fresh start\nfresh end", held_out[2]] * 2
    assert counts["seen_documents"] == 2 and counts["seen_lines"] == 2
    assert counts["chars_after"] == sum(map(len, kept)) < counts["chars_before"]


def runs(losses_by_seed):
    losses = list(losses_by_seed.values())
    return {"runs": [{"seed": s, "val_loss": v} for s, v in losses_by_seed.items()], "losses": losses,
            "mean": float(np.mean(losses)), "std": float(np.std(losses, ddof=1))}  # fmt: skip


def test_the_gap_is_paired_by_seed_since_seed_s_starts_every_treatment_from_the_same_weights():
    # the seeds spread by 0.1 nats, the treatment moves every seed by about -0.02: pairing cancels the spread
    base = runs({0: 5.00, 1: 5.10, 2: 5.20})
    row = runs({2: 5.18, 0: 4.99, 1: 5.07})  # listed in another order: matched by seed, not by position
    d = [-0.01, -0.03, -0.02]
    expected_se = float(np.std(d, ddof=1)) / math.sqrt(3)  # 0.0058; the two-sample error would be 0.072
    got = gap(row, base)
    assert got["diff"] == -0.02 and got["se"] == round(expected_se, 4) and got["n"] == 3
    assert got["t"] == round(-0.02 / expected_se, 2)
    two_sample = math.sqrt(base["std"] ** 2 / 3 + row["std"] ** 2 / 3)
    assert got["se"] < two_sample / 10


def test_the_paired_gap_uses_the_seeds_both_rows_hold_and_refuses_fewer_than_two():
    base = runs({0: 5.0, 1: 5.1, 2: 5.2})
    assert gap(runs({1: 5.0, 2: 5.2, 7: 9.9}), base)["n"] == 2
    with pytest.raises(ValueError, match="at least 2 seeds in common, got \\[1\\]"):
        gap(runs({1: 5.0, 7: 9.9}), base)


def test_the_lessons_table_pairs_the_recorded_runs_by_seed():
    results = json.loads(DATA_LEVER.read_text())
    gaps = data_lever_gaps(results)
    base = {r["seed"]: r["val_loss"] for r in results["rows"]["baseline"]["runs"]}
    for name, g in gaps.items():
        d = [r["val_loss"] - base[r["seed"]] for r in results["rows"][name]["runs"]]
        assert g["diff"] == pytest.approx(np.mean(d)) and g["se"] == pytest.approx(np.std(d, ddof=1) / math.sqrt(3))
        assert g["dof"] == 2 and 0 < g["p"] < 1
    assert round(gaps["dedup"]["se"], 4) == 0.0012  # the two-sample error of the same runs is 0.0060
    table = data_lever_table(results)
    assert "-0.0020 +- 0.0012" in table and "+0.0018 +- 0.0011" in table


def test_a_tiny_study_records_what_the_lesson_needs(tmp_path):
    out, progress = tmp_path / "lever.json", io.StringIO()
    results = run_data_lever(
        out, steps=4, seeds=(0, 1), max_chars=20_000, tokenizer_chars=20_000, evals=2, stream=progress
    )
    assert [line.split()[:3] for line in progress.getvalue().splitlines() if line.startswith("[seed")] == [
        ["[seed", str(seed) + "]", name] for seed in (0, 1) for name in TREATMENTS
    ]  # a line per run
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))  # plain data, as written
    assert list(results["rows"]) == list(TREATMENTS)
    assert {"date", "machine", "torch", "git_commit", "command", "wall_seconds"} <= set(results["provenance"])
    assert results["config"]["comparison"].startswith("equal optimizer steps")
    assert results["config"]["steps"] == 4 and results["config"]["seeds"] == [0, 1]
    assert results["held_out"]["rows_scored"] > 0
    rows = results["rows"]
    tokens = {run["train_tokens"] for row in rows.values() for run in row["runs"]}
    assert tokens == {4 * 16 * 128}  # equal steps, equal tokens: TINY_SHAPE reads 16 rows of 128 a step
    base = rows["baseline"]
    for name, row in rows.items():
        assert row["n"] == len(row["losses"]) == 2 and [r["seed"] for r in row["runs"]] == [0, 1]
        assert (
            row["losses"]
            == [r["val_loss"] for r in row["runs"]]
            == [r["val_history"][-1]["val_loss"] for r in row["runs"]]
        )
        assert row["mean"] == pytest.approx(np.mean(row["losses"]), abs=1e-4)
        assert row["std"] == pytest.approx(np.std(row["losses"], ddof=1), abs=1e-4)
        assert {"documents", "chars", "tokens", "rows", "rows_by_corpus", "passes"} <= set(row)
        if name != "baseline":
            assert row["vs_baseline"] == gap(row, base)
    assert "vs_baseline" not in base  # a row is not compared with itself
    assert rows["dedup"]["chars"] <= base["chars"]
    dropped = results["filter"]["dropped_char_share"]
    assert dropped >= results["filter"]["target_share"] == 0.1
    assert rows["dedup+filter"]["chars"] == rows["dedup"]["chars"] - sum(
        results["filter"]["dropped_chars_by_corpus"].values()
    )
    assert dropped == pytest.approx(1 - rows["dedup+filter"]["chars"] / rows["dedup"]["chars"], abs=1e-4)
    sort = rows["dedup+filter+sort"]
    assert {k: sort[k] for k in ("chars", "rows")} == {k: rows["dedup+filter"][k] for k in ("chars", "rows")}
    assert sum(sort["read_by_corpus"].values()) == min(4 * 16, sort["rows"])


def test_the_command_line_refuses_bad_settings_before_reading_any_text(tmp_path, capsys):
    out = tmp_path / "lever.json"
    for bad, says in (
        (["--seeds", "1"], "give at least two different seeds"),
        (["--seeds", "1", "1"], "give at least two different seeds"),
        (["--drop-share", "1.5"], "must be in (0, 1), got 1.5"),
        (["--steps", "2", "--evals", "3"], "1 <= evals <= steps"),
        (["--steps", "0"], "--steps must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            main(["data-lever", "--out", str(out), *bad])
        assert says in capsys.readouterr().err
        assert not out.exists()
