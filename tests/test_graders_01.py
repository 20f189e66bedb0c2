"""Lesson 01's graders: each passes a right answer, and fails a plausible wrong value and a right value
reached the wrong way (by running the library's trainer, by listing instead of counting, by treating a word's
first character and its '##' continuation as one symbol, by forgetting that continuations carry '##')."""

from __future__ import annotations

import itertools

from llmedu.checks.tokenizers import (
    TIE_TEXTS,
    check_bpe_vs_wordpiece,
    check_count_segmentations,
    check_greedy_failure,
    check_tie_break,
)
from llmedu.tokenizers import BPETokenizer


# -- exercise 1: predict the first merges under each tie rule ---------------------------------
def test_tie_break_accepts_the_merges_worked_out_by_hand():
    assert check_tie_break(lambda: {"ids": ["bc", "abc", " bc"], "bytes": ["bc", "abc", "bcbc"]})


def test_tie_break_fails_one_answer_for_both_rules():
    assert not check_tie_break(lambda: {"ids": ["bc", "abc", " bc"], "bytes": ["bc", "abc", " bc"]})


def test_tie_break_fails_the_smaller_pair_of_bytes():
    # "bytes" read as the *smaller* byte strings: (b" ", b"bc") < (b"abc", b"abc") < (b"bc", b"bc")
    assert not check_tie_break(lambda: {"ids": ["bc", "abc", " bc"], "bytes": ["bc", "abc", " bc"][:2] + [" bc"]})


def test_tie_break_fails_the_right_merges_from_the_library_trainer():
    def run_the_trainer():
        out = {}
        for rule in ("ids", "bytes"):
            tok = BPETokenizer().train(TIE_TEXTS, 259, special_tokens=(), tie_break=rule)
            out[rule] = [tok.id_to_token(new) for new in tok.merges.values()]
        return out

    assert run_the_trainer() == {"ids": ["bc", "abc", " bc"], "bytes": ["bc", "abc", "bcbc"]}  # right values
    assert not check_tie_break(run_the_trainer)


# -- exercise 2: a word the vocabulary spells but greedy longest-match turns into [UNK] --------
def test_greedy_failure_accepts_a_real_case():
    assert check_greedy_failure(lambda: ({"ab", "a", "##bc"}, "abc"))  # greedy takes "ab", then no "##c"


def test_greedy_failure_fails_a_word_nothing_can_spell():
    assert not check_greedy_failure(lambda: ({"ab", "a", "##b"}, "abz"))  # [UNK], but rightly so


def test_greedy_failure_fails_continuations_without_their_marks():
    # "a" + "bc" looks like a spelling only if continuations need no "##": BERT's do
    assert not check_greedy_failure(lambda: ({"ab", "a", "bc"}, "abc"))


def test_greedy_failure_fails_a_word_greedy_handles():
    assert not check_greedy_failure(lambda: ({"a", "##b", "##c"}, "abc"))


# -- exercise 3: a corpus on which BPE's and WordPiece's first merges differ ------------------
def test_bpe_vs_wordpiece_accepts_a_pair_of_rare_parts():
    # BPE merges a frequent pair ("ab" or "ac", 10 each); WordPiece "x" + "##y", whose parts never appear apart
    assert check_bpe_vs_wordpiece(lambda: {"ab": 10, "ac": 10, "xy": 4})


def test_bpe_vs_wordpiece_fails_a_corpus_with_one_pair():
    assert not check_bpe_vs_wordpiece(lambda: {"ab": 1})


def test_bpe_vs_wordpiece_fails_a_corpus_that_differs_only_without_the_prefix():
    # with "b" and "##b" as one symbol WordPiece would merge "ab" or "bc" first; with them apart, as the
    # trainer keeps them, both merge "b" + "##b" first
    assert not check_bpe_vs_wordpiece(lambda: {"abc": 4, "bbb": 5})


# -- exercise 4: count segmentations ----------------------------------------------------------
def _count(word, vocab):
    ways = [1] + [0] * len(word)
    for end in range(1, len(word) + 1):
        ways[end] = sum(ways[start] for start in range(end) if word[start:end] in vocab)
    return ways[-1]


def test_count_segmentations_accepts_dynamic_programming():
    assert check_count_segmentations(_count)


def test_count_segmentations_fails_counting_the_pieces():
    assert not check_count_segmentations(lambda word, vocab: sum(p in vocab for p in _substrings(word)))


def _substrings(word):
    return {word[i:j] for i in range(len(word)) for j in range(i + 1, len(word) + 1)}


def test_count_segmentations_fails_listing_every_segmentation():
    def listing(word, vocab):  # right on short words, ~5e7 segmentations on the 30-character one
        n = 0
        for cuts in itertools.product([False, True], repeat=max(len(word) - 1, 0)):
            pieces, start = [], 0
            for i, cut in enumerate(cuts, 1):
                if cut:
                    pieces.append(word[start:i])
                    start = i
            pieces.append(word[start:])
            n += all(p in vocab for p in pieces)
        return n

    assert listing("unable", {"un", "able", "u", "n", "a", "b", "l", "e"}) == _count(
        "unable", {"un", "able", "u", "n", "a", "b", "l", "e"}
    )
    result = check_count_segmentations(listing)
    assert not result and "count, do not list" in result.failure
