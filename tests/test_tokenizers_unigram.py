"""Unigram LM: Viterbi against brute force, sampling against exact probabilities, training against
the Unigram trainer of Hugging Face ``tokenizers``, and the export to ``transformers``."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
from transformers import PreTrainedTokenizerFast

from llmedu.checks.tokenizers import hard_strings, viterbi_reference
from llmedu.data import load_corpus
from llmedu.tokenizers import UnigramTokenizer
from llmedu.tokenizers.unigram import metaspace_words


def toy() -> UnigramTokenizer:
    """A hand-made model: a few pieces with log-probabilities."""
    scores = {
        "▁": -3.0,
        "t": -4.0,
        "h": -4.5,
        "e": -3.5,
        "▁t": -5.0,
        "he": -5.5,
        "▁the": -2.0,
        "▁th": -6.0,
        "r": -4.0,
        "re": -5.0,
        "er": -5.0,
        "her": -6.5,
        "▁there": -7.5,
        "a": -3.9,
    }
    tok = UnigramTokenizer()
    tok._set_vocab(["<unk>", *scores], [0.0, *scores.values()], {"<unk>": 0})
    return tok


def test_metaspace_words_match_hugging_face():
    from tokenizers.pre_tokenizers import Metaspace

    hf = Metaspace(replacement="▁", prepend_scheme="always", split=True)
    for s in ["Hello world", " a  b", "a\nb c", "", "   ", *hard_strings()]:
        assert metaspace_words(s) == [w for w, _ in hf.pre_tokenize_str(s)], s


def test_viterbi_is_the_most_likely_segmentation():
    tok = toy()
    scores = {p: s for p, s in zip(tok.pieces[1:], tok.scores[1:])}
    for word in ["▁the", "▁there", "▁her", "▁tea", "▁three", "hehe", "▁thee", "▁hear"]:
        assert tok._viterbi(word, scores) == viterbi_reference(word, scores), word
    assert tok.tokens("the there") == ["▁the", "▁the", "re"]  # -2.0 - 5.0 beats '▁there' at -7.5
    assert tok.encode("thxxe") == [tok.index["▁th"], 0, tok.index["e"]]  # "xx": one <unk>


def test_sampling_follows_p_to_the_alpha():
    tok = toy()
    scores = {p: s for p, s in zip(tok.pieces[1:], tok.scores[1:])}
    word, alpha, n = "▁there", 0.5, 4000
    exact = {}
    for cuts in itertools.product([0, 1], repeat=len(word) - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [len(word)]
        pieces = tuple(word[a:b] for a, b in zip(bounds, bounds[1:]))
        if all(p in scores for p in pieces):
            exact[pieces] = math.exp(alpha * sum(scores[p] for p in pieces))
    total = sum(exact.values())
    drawn = Counter(tuple(tok.id_to_token(i) for i in tok.sample("there", alpha=alpha, seed=s)) for s in range(n))
    assert set(drawn) <= set(exact)
    for pieces, weight in exact.items():
        p = weight / total  # a binomial standard error is at most 0.008 for n=4000: allow 4 of them
        assert abs(drawn[pieces] / n - p) < 0.032, (pieces, drawn[pieces] / n, p)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("wikipedia")[:200_000], load_corpus("wikipedia", "validation")[:60_000]


@pytest.fixture(scope="module")
def trained(corpus):
    return UnigramTokenizer().train(corpus[0], 1500)


def test_compression_matches_hf_unigram_trainer(corpus, trained):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.Unigram())
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.train_from_iterator(
        [corpus[0]],
        trainers.UnigramTrainer(vocab_size=1500, special_tokens=["<unk>"], unk_token="<unk>", show_progress=False),
    )
    assert trained.vocab_size == hf.get_vocab_size() == 1500
    ours, theirs = len(trained.encode(corpus[1])), len(hf.encode(corpus[1]).ids)
    # Hard (Viterbi) EM against soft EM with a digamma M-step, and a different seed: at the same size
    # we must need at most 5% more tokens. (Measured: about 5% *fewer* here, 1.5% fewer on Shakespeare;
    # the lower bound only catches a broken count.)
    assert 0.85 < ours / theirs < 1.05, (ours, theirs)


def test_trained_round_trip_save_load_and_hf_export(corpus, trained, tmp_path):
    text = corpus[1][:30_000]
    seen = "".join(c for c in text if c in trained.index or c == " ")  # unseen characters become <unk>
    assert trained.decode(trained.encode(seen)) == seen
    assert trained.decode(trained.encode("Danneskjöld")) == "Danneskj<unk>ld"
    trained.save(tmp_path / "unigram.json")
    assert UnigramTokenizer.load(tmp_path / "unigram.json").encode(text) == trained.encode(text)
    trained.save_hf(tmp_path / "tokenizer.json")
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert len(fast) == trained.vocab_size
    for s in [text, *hard_strings()]:  # unknown characters included: runs of them are one <unk>
        assert fast(s)["input_ids"] == trained.encode(s), s


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="empty"):
        UnigramTokenizer().train(" \n ", 100)
    with pytest.raises(ValueError, match="smaller than the special tokens plus the characters"):
        UnigramTokenizer().train("abcdefghijklmnop", 8)
    with pytest.raises(RuntimeError, match="train it first"):
        UnigramTokenizer().encode("hello")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        toy().decode([99])
