"""The graders of lesson 01 pass the reference implementations and fail the usual mistakes."""

from __future__ import annotations

from collections import Counter

from llmedu.checks.tokenizers import (
    check_bpe_vs_wordpiece,
    check_count_pairs,
    check_count_segmentations,
    check_merge_pair,
    check_viterbi,
    check_wordpiece,
    viterbi_reference,
    wordpiece_reference,
)
from llmedu.tokenizers import UnigramTokenizer
from llmedu.tokenizers.pairs import merge_pair


def test_count_pairs_grader():
    assert check_count_pairs(lambda ids: Counter(zip(ids, ids[1:])))
    assert not check_count_pairs(lambda ids: Counter(set(zip(ids, ids[1:]))))  # counts each pair once
    assert not check_count_pairs(lambda ids: Counter(zip(ids, ids[2:])))


def test_merge_pair_grader():
    assert check_merge_pair(merge_pair)

    def no_skip(ids, pair, new_id):  # forgets to skip the second half of a merged pair: [1, 1, 1] -> [9, 9]
        out = []
        for i in range(len(ids)):
            if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
                out.append(new_id)
            elif not (i > 0 and (ids[i - 1], ids[i]) == pair):
                out.append(ids[i])
        return out

    assert not check_merge_pair(no_skip)
    assert not check_merge_pair(lambda ids, pair, new_id: 1 / 0)


def test_wordpiece_grader():
    assert check_wordpiece(wordpiece_reference)
    assert not check_wordpiece(lambda word, vocab: [word] if word in vocab else ["[UNK]"])

    def shortest_first(word, vocab):
        pieces, start = [], 0
        while start < len(word):
            for end in range(start + 1, len(word) + 1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in vocab:
                    pieces.append(piece)
                    start = end
                    break
            else:
                return ["[UNK]"]
        return pieces

    assert not check_wordpiece(shortest_first)


def test_viterbi_grader():
    assert check_viterbi(viterbi_reference)
    assert check_viterbi(lambda word, scores: UnigramTokenizer()._viterbi(word, scores))

    def greedy(word, scores):  # longest piece first is not the most likely segmentation
        return wordpiece_reference(word, set(scores), prefix="")

    assert not check_viterbi(greedy)


def test_bpe_vs_wordpiece_grader():
    # 'a' and 'b' are common alone, so their pair is frequent but unsurprising; 'q' and 'z' only occur together
    assert check_bpe_vs_wordpiece(lambda: {"ab": 10, "a": 50, "b": 50, "qz": 4})
    toy = {"low": 5, "lower": 2, "newest": 6, "widest": 3}  # Sennrich's corpus: both may merge ('s', 't') first
    res = check_bpe_vs_wordpiece(lambda: toy)
    assert not res and "both merge st first" in res.failure
    # 'aa' is the most frequent pair and, with WordPiece's '##' continuations kept apart from word starts, also
    # the best-scoring one: a grader that merged '##' into plain letters would wrongly accept this corpus
    assert not check_bpe_vs_wordpiece(lambda: {"aa": 5, "xy": 2})
    assert not check_bpe_vs_wordpiece(lambda: {"ab": 3})  # one pair: nothing to choose
    assert not check_bpe_vs_wordpiece(lambda: ["ab", "qz"])  # not {word: count}
    assert not check_bpe_vs_wordpiece(lambda: {"a": 3, "b": 2})  # no pair at all


def test_count_segmentations_grader():
    def count(word, vocab):
        ways = [1] + [0] * len(word)
        for end in range(1, len(word) + 1):
            ways[end] = sum(ways[s] for s in range(end) if word[s:end] in vocab)
        return ways[-1]

    assert check_count_segmentations(count)
    assert not check_count_segmentations(lambda word, vocab: 2 ** (len(word) - 1))  # ignores the vocabulary
    assert not check_count_segmentations(lambda word, vocab: int(wordpiece_reference(word, vocab, "") != ["[UNK]"]))
