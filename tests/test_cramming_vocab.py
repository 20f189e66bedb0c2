"""The vocabulary study: its checks, a tiny end-to-end run whose numbers must relate, and the report's reading."""

import json
import math

import matplotlib
import pytest

from llmedu.cramming.__main__ import main
from llmedu.cramming.data import CORPORA, held_out_chars
from llmedu.cramming.pretrain import load_run
from llmedu.cramming.recipe import TINY_SHAPE, crammed
from llmedu.cramming.studies.scaling_grid import parameter_counts
from llmedu.cramming.studies.study import unigram_line
from llmedu.cramming.studies.vocab_report import load_vocab_study, plot_vocab, probe_mean, vocab_table, vocab_verdict
from llmedu.cramming.studies.vocab_study import (
    check_vocab_sizes,
    count_tokens,
    minimum_vocab,
    probe_tasks,
    run_vocab_study,
)
from llmedu.data.packing import read_documents
from llmedu.tokenizers import WordPieceTokenizer

matplotlib.use("Agg")

# the slice of text and the tokenizer sample of tests/test_cramming.py: its cached rows serve here too
SMOKE = ["--shape", "tiny", "--max-chars", "20000", "--tokenizer-chars", "30000"]


def test_the_smallest_vocabulary_is_the_trainers_alphabet():
    least = minimum_vocab(CORPORA, 30_000)
    text = "\n\n".join(read_documents(CORPORA, "train", 30_000))  # the sample train_tokenizer learns from
    assert WordPieceTokenizer().train(text, least).vocab_size == least  # specials and characters, no merge
    with pytest.raises(ValueError, match=f"ask for at least {least}"):
        WordPieceTokenizer().train(text, least - 1)


def test_bad_vocabulary_sizes_and_tasks_are_refused():
    least = minimum_vocab(CORPORA, 30_000)
    for sizes, says in (
        ([], "give at least one vocabulary size"),
        ([1024, 0], "must be an int >= 1, got 0"),
        ([1024, 2.5], "must be an int >= 1, got 2.5"),
        ([256, 1024, 256], "list 256 more than once"),
        ([1024, least - 1], f"vocabulary size {least - 1} is smaller than the special tokens plus the characters"),
    ):
        with pytest.raises(ValueError, match=says):
            check_vocab_sizes(sizes, CORPORA, 30_000)
    assert probe_tasks(CORPORA) == ("rotten_tomatoes", "bbc_news")  # tweet_sentiment is the tweets corpus
    assert "tweet_sentiment" in probe_tasks([c for c in CORPORA if c != "tweets"])
    with pytest.raises(ValueError, match="task 'tweet_sentiment' is the text of pretraining corpus"):
        run_vocab_study([256], 10.0, base=TINY_SHAPE, tokenizer_chars=30_000, tasks=["tweet_sentiment"])


def test_the_command_line_refuses_bad_input_before_running(tmp_path, capsys):
    out = tmp_path / "vocab.json"
    for bad, says in (
        (["--vocab", "50", "1024"], "vocabulary size 50 is smaller than the special tokens plus the characters"),
        (["--vocab", "1024", "1024"], "list 1024 more than once"),
        (["--vocab", "-8"], "must be an int >= 1, got -8"),
        (["--budget", "-5s"], "the budget must be positive, got '-5s'"),
        (["--budget", "0"], "the budget must be positive"),
        (["--max-steps", "0"], "max_steps must be an int >= 1, got 0"),
        (["--evals", "0"], "evals must be an int >= 1"),
        (["--probe-max-train", "0"], "--probe-max-train must be >= 1"),
        (["--tokenizer-chars", "0"], "--tokenizer-chars must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            main(["vocab", "--out", str(out), *SMOKE, *bad])
        assert says in capsys.readouterr().err
        assert not out.exists()


def test_a_smoke_study_records_numbers_that_relate(tmp_path, capsys):
    out, runs = tmp_path / "vocab.json", tmp_path / "runs"
    printed = main(
        ["vocab", "--out", str(out), *SMOKE, "--vocab", "256", "1024", "--budget", "60s", "--max-steps", "4"]
        + ["--evals", "2", "--eval-batches", "2", "--probe-max-train", "40", "--probe-max-eval", "20"]
        + ["--runs", str(runs)]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == printed
    results = load_vocab_study(out)
    assert json.loads(json.dumps(results)) == results  # plain data
    assert list(results["runs"]) == ["256", "1024"] == list(printed["runs"])
    assert results["provenance"]["command"].startswith("python -m llmedu.cramming vocab --out")
    config = results["config"]
    assert (
        config["vocab_sizes"] == [256, 1024] and config["base"]["d_model"] == 64 and "vocab_size" not in config["base"]
    )
    assert config["probe"]["tasks"] == ["rotten_tomatoes", "bbc_news"]
    assert config["probe"]["sizes"]["rotten_tomatoes"] == {"train": 40, "dev": 20}
    documents = read_documents(CORPORA, "validation", held_out_chars(20_000, 128))  # the held-out text
    for name, r in results["runs"].items():
        v = int(name)
        recipe, tokenizer = load_run(runs / f"vocab-{name}")
        assert r["vocab_size"] == v == tokenizer.vocab_size == recipe.model.vocab_size
        assert r["parameters"] == parameter_counts(crammed(**{**TINY_SHAPE, "vocab_size": v}))
        assert r["held_out"] == count_tokens(tokenizer, documents)
        assert r["tokens_per_char"] == pytest.approx(r["held_out"]["tokens"] / r["held_out"]["chars"], abs=1e-5)
        assert r["nats_per_char"] == pytest.approx(r["val_loss"] * r["tokens_per_char"], abs=1e-4)
        assert r["chars_per_s"] == pytest.approx(r["tokens_per_s"] / r["tokens_per_char"], rel=1e-4)
        assert r["tokens_seen"] == 4 * 16 * 128  # TINY_SHAPE: 16 rows of 128, no accumulation
        assert r["passes"] == pytest.approx(r["tokens_seen"] / r["corpus_tokens"], abs=1e-3)
        assert r["unigram_cross_entropy"] == pytest.approx(unigram_line(runs / f"vocab-{name}"), abs=1e-4)
        assert r["unigram_cross_entropy"] < math.log(v)  # below the uniform guess
        assert r["below_unigram"] == pytest.approx(r["unigram_cross_entropy"] - r["val_loss"], abs=1e-4)
        # placed by the speed probe (budget_runs.plan_runs): every eval_every steps, then the final evaluation
        steps = [p["step"] for p in r["val_history"]]
        assert steps[-1] == 4 and all(s % r["eval_every"] == 0 for s in steps[:-1]) and 1 <= r["eval_every"] <= 2
        assert r["val_history"][-1]["val_loss"] == r["val_loss"]
        for key in ("probe", "probe_control"):
            assert list(r[key]) == ["rotten_tomatoes", "bbc_news"] and all(0 <= a <= 1 for a in r[key].values())
    small, large = results["runs"]["256"], results["runs"]["1024"]
    assert large["tokens_per_char"] < small["tokens_per_char"]  # the same text in fewer tokens
    assert large["corpus_tokens"] < small["corpus_tokens"]  # so the same training text packs into fewer tokens
    assert large["parameters"]["total"] > small["parameters"]["total"]
    assert "256" in vocab_table(results) and "tokens per character" in vocab_verdict(results)
    plot_vocab(results)


def _run(vocab, tokens_per_char, tokens_per_s, loss, unigram, probe, control):
    return {
        "vocab_size": vocab,
        "parameters": {"total": 1000 + vocab, "non_embedding": 1000},
        "tokens_per_char": tokens_per_char,
        "tokens_per_s": tokens_per_s,
        "chars_per_s": tokens_per_s / tokens_per_char,
        "passes": 1.0,
        "val_loss": loss,
        "unigram_cross_entropy": unigram,
        "below_unigram": unigram - loss,
        "nats_per_char": loss * tokens_per_char,
        "probe": dict(zip(("a", "b"), probe)) if probe else None,
        "probe_control": dict(zip(("a", "b"), control)) if control else None,
    }


def _results(probe_4096=(0.75, 0.85), probe_16384=(0.74, 0.82)):
    """A hand-made study of three vocabularies; each task's dev split holds 1,000 examples."""
    sizes = {t: {"train": 9000, "dev": 1000} for t in ("a", "b")}
    return {
        "provenance": {"date": "2026-01-01"},
        "config": {"budget_seconds": 180.0, "max_steps": None, "probe": {"tasks": ["a", "b"], "sizes": sizes}},
        "runs": {  # deliberately out of order: the report sorts by vocabulary
            "4096": _run(4096, 0.30, 18_000, 6.0, 7.0, probe_4096, (0.60, 0.70)),
            "1024": _run(1024, 0.40, 20_000, 5.0, 5.8, (0.70, 0.80), (0.60, 0.70)),
            "16384": _run(16384, 0.25, 12_000, 7.0, 7.9, probe_16384, (0.62, 0.72)),
        },
    }


def test_the_table_and_the_verdict_read_the_numbers():
    results = _results()
    table = vocab_table(results)
    rows = [line.split() for line in table.splitlines()[2:5]]
    assert [r[0] for r in rows] == ["1024", "4096", "16384"]
    assert rows[0][1:3] == ["0.400", "2,024"] and rows[0][-3:] == ["2.000", "75.0", "65.0"]  # nats/char 5.0 x 0.4
    assert rows[1][5] == "60,000" and rows[1][-4] == "1.000"  # chars/s = 18,000 / 0.3; below the unigram line
    assert "a 75.0 / 60.0, b 85.0 / 70.0" in table

    verdict = vocab_verdict(results)
    assert "from 1024 to 16384: 0.400 -> 0.250 tokens per character (1.60x fewer" in verdict
    assert "tokens/s x0.60, characters/s x0.96" in verdict
    assert "characters read per second is highest at 4096 (60,000)" in verdict
    assert "nats per character falls at every step up in vocabulary" in verdict
    # per character: 0.8 x 0.4 = 0.32, 1.0 x 0.3 = 0.30, 0.9 x 0.25 = 0.225 (per token, 4096 would lead)
    assert "beyond its unigram line, per character (nats/char), falls at every step up" in verdict
    # 4096: 80.0%, 16384: 78.0%; noise of the difference sqrt(sum p(1-p)/1000)/2 in quadrature: 1.3 points
    assert "best probe 4096 (80.0%), 2.0 points above 16384: within 2 standard errors" in verdict
    assert "(one is 1.3 points: the binomial noise of the dev splits" in verdict
    assert "1024 +10.0, 4096 +15.0, 16384 +11.0; largest at 4096" in verdict
    assert "peaks at 4096, inside the range" in verdict and "does not separate them" in verdict

    clear = vocab_verdict(_results(probe_4096=(0.80, 0.90)))  # 85.0%: 7 points above 16384
    assert "best probe 4096 (85.0%), 7.0 points above 16384: beyond 2 standard errors" in clear
    assert "peaks at 4096" in clear and "does not separate" not in clear
    rising = vocab_verdict(_results(probe_16384=(0.82, 0.92)))
    assert "is best at the largest vocabulary tried (16384), in line with the paper" in rising
    assert "mean dev accuracy (%) rises at every step up in vocabulary" in rising
    falling = vocab_verdict(_results(probe_4096=(0.60, 0.70), probe_16384=(0.55, 0.65)))
    assert "is best at the smallest vocabulary tried (1024), against the paper's trend" in falling

    unprobed = _results()
    for r in unprobed["runs"].values():
        r["probe"] = r["probe_control"] = None
    assert "no linear probe recorded" in vocab_verdict(unprobed)
    assert probe_mean(unprobed["runs"]["1024"]) is None and probe_mean(results["runs"]["1024"]) == pytest.approx(0.75)
    plot_vocab(results)
    plot_vocab(unprobed)


def test_files_that_are_not_a_vocabulary_study_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    with pytest.raises(FileNotFoundError, match="no vocabulary study here"):
        load_vocab_study(tmp_path / "missing.json")
    results = _results()
    for text, says in (
        ("{not json", "is not JSON"),
        (json.dumps({"runs": {}}), "lacks provenance, config"),
        (json.dumps({**results, "runs": {}}), "holds no finished run"),
        (json.dumps({**results, "runs": {"a": {"vocab_size": 8}}}), "the run 'a' lacks parameters, tokens_per_char"),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match=says):
            load_vocab_study(bad)
    bad.write_text(json.dumps(results))
    assert load_vocab_study(bad) == results
