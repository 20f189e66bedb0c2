"""The data side of the capstone: passes over the data, deduplication, time to target, the third task."""

import json

import pytest

from llmedu.cramming.data import deduplicate
from llmedu.cramming.pretrain import PretrainRun, passes_over_data, pretrain
from llmedu.cramming.recipe import TINY_SHAPE, crammed
from llmedu.cramming.target import time_to_target
from llmedu.data.tweet_sentiment import TWEET_LABELS, load_tweet_sentiment

TINY = crammed(**{**TINY_SHAPE, "micro_batch": 8})


def test_passes_over_the_data_arithmetic():
    assert passes_over_data(tokens_seen=300, corpus_tokens=100) == 3.0
    assert passes_over_data(0, 100) == 0.0
    with pytest.raises(ValueError, match="corpus_tokens >= 1"):
        passes_over_data(10, 0)


def test_a_run_states_its_passes_and_records_the_held_out_loss(tmp_path):
    """3 steps of 1 micro-batch of 8 x 128 tokens: 3,072 tokens seen, over the packed train rows."""
    run = PretrainRun(TINY, None, max_steps=3, corpora=["kjv"], max_chars=100_000)  # enough held-out rows
    s = pretrain(tmp_path / "a", run, tokenizer_chars=30_000, progress=False, eval_batches=1, eval_every=2)
    assert s["tokens_seen"] == 3 * 8 * 128 == s["tokens_this_run"]
    assert s["corpus_tokens"] % 128 == 0 and s["corpus_tokens"] > 0  # whole packed rows
    assert s["passes"] == pytest.approx(s["tokens_seen"] / s["corpus_tokens"], abs=1e-3)  # rounded to 3 places
    assert [e["step"] for e in s["val_history"]] == [2] and s["eval_every"] == 2
    assert s["val_history"][0]["elapsed"] <= s["elapsed_seconds"]  # evaluation time is not on the clock
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["passes"] == s["passes"]
    # a resumed run counts the tokens of its earlier part too
    again = pretrain(tmp_path / "a", run, resume=True, tokenizer_chars=30_000, progress=False, eval_batches=1)
    assert again["steps_this_run"] == 0 and again["tokens_this_run"] == 0 and again["tokens_seen"] == s["tokens_seen"]
    with pytest.raises(ValueError, match="eval_every"):
        pretrain(tmp_path / "b", run, eval_every=0)


def test_a_deduplicated_run_reports_what_went(tmp_path):
    run = PretrainRun(TINY, None, max_steps=1, corpora=["speeches"], max_chars=60_000, dedup=True)
    s = pretrain(tmp_path, run, tokenizer_chars=30_000, progress=False, eval_batches=1)
    counts = s["dedup"]["train"]
    assert counts["chars_after"] <= counts["chars_before"] and counts["documents"] > 0
    assert json.loads((tmp_path / "run.json").read_text())["dedup"] is True
    assert PretrainRun.from_dict({**run.to_dict(), "dedup": False}).differences(run) == {"dedup": (False, True)}


def test_dedup_removes_injected_duplicates():
    line = "And it came to pass in those days, that there went out a decree"
    docs = [
        f"first\n{line}\nshort\nshort",
        "a   second document,\nwith its own text of some length",
        "a second document, with its own text of some length",  # the second again, spaces changed
        f"third\n{line}\nmore words in the third document",  # the long line repeats: dropped
        line,  # only the repeated line: nothing left
    ]
    kept, counts = deduplicate(docs, min_line_chars=30)
    assert kept == [docs[0], docs[1], "third\nmore words in the third document"]
    assert counts["duplicate_documents"] == 1 and counts["repeated_lines"] == 2 and counts["emptied"] == 1
    assert "short\nshort" in kept[0]  # short lines may repeat
    # the validation split against the train split: anything seen in train goes
    held, counts = deduplicate([line, "new text that nobody has seen before today"], against=docs[:1])
    assert held == ["new text that nobody has seen before today"] and counts["emptied"] == 1
    with pytest.raises(ValueError, match="min_line_chars"):
        deduplicate(docs, min_line_chars=0)


HISTORY = [
    {"step": 50, "elapsed": 10.0, "val_loss": 7.1},
    {"step": 100, "elapsed": 21.0, "val_loss": 6.4},
    {"step": 150, "elapsed": 30.5, "val_loss": 5.9},
    {"step": 200, "elapsed": 41.0, "val_loss": 6.0},
]


def test_time_to_target_reads_the_first_evaluation_at_or_below_it():
    assert time_to_target(HISTORY, 6.4) == {"reached": True, "seconds": 21.0, "step": 100, "resolution_seconds": 11.0}
    assert time_to_target(HISTORY, 6.0)["seconds"] == 30.5  # the first hit, not the last
    assert time_to_target(HISTORY, 8.0)["resolution_seconds"] == 10.0  # from the start of training
    missed = time_to_target(HISTORY, 5.0)
    assert missed == {"reached": False, "seconds": None, "step": None, "best_loss": 5.9}
    with pytest.raises(ValueError, match="eval_every"):
        time_to_target([], 5.0)
    with pytest.raises(ValueError, match="positive"):
        time_to_target(HISTORY, -1.0)


def test_the_tweet_task_is_split_once_three_ways_labelled():
    train, train_y = load_tweet_sentiment("train")
    test, test_y = load_tweet_sentiment("validation")
    assert not set(train) & set(test) and len(set(train)) == len(train)
    assert set(train_y) == set(test_y) == {0, 1, 2} and len(TWEET_LABELS) == 3
    assert 0.08 < len(test) / (len(train) + len(test)) < 0.12  # about 10% by the hash
    assert load_tweet_sentiment("validation") == (test, test_y)
    with pytest.raises(ValueError, match="split"):
        load_tweet_sentiment("test")
