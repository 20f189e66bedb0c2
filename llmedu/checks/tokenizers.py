"""Graders for the exercises of lesson 01 (tokenizers), and the hard strings every tokenizer must survive.

    check_count_pairs(count_pairs)    count_pairs(ids) -> {(a, b): n}: adjacent pairs, as BPE counts them
    check_merge_pair(merge_pair)      merge_pair(ids, pair, new_id) -> ids: one BPE merge
    check_wordpiece(encode_word)      encode_word(word, vocab) -> pieces: greedy longest match, or ['[UNK]']
    check_viterbi(segment)            segment(word, scores) -> pieces: the most likely unigram segmentation
    check_bpe_vs_wordpiece(corpus)    corpus() -> {word: count} on which BPE's first merge differs from
                                      WordPiece's (a design question: build the case)
    check_count_segmentations(count)  count(word, vocab) -> how many ways the word cuts into vocab pieces
                                      (the lattice Viterbi searches, summed instead of maximised; listing
                                      them runs out of a budget of executed lines)
    check_tie_break(predict)          predict() -> {"ids": [...], "bytes": [...]}: the first merges of
                                      TIE_TEXTS under each tie rule, predicted without running a trainer
    check_greedy_failure(case)        case() -> (vocab, word): a word the vocabulary can spell that greedy
                                      longest-match still turns into [UNK]

Each compares your function with the reference in ``llmedu.tokenizers`` on a few cases chosen to
catch the usual slips (overlapping pairs, a pair at the very end, a word with no match...).
"""

from __future__ import annotations

import inspect
import itertools
import json.decoder
import math
import random
import sys
import textwrap
from collections import Counter
from pathlib import Path

from ..tokenizers import BPETokenizer
from ..tokenizers.pairs import merge_pair as _merge_pair
from .core import Grader, call_watching

__all__ = [
    "check_count_pairs",
    "check_merge_pair",
    "check_wordpiece",
    "check_viterbi",
    "check_bpe_vs_wordpiece",
    "check_count_segmentations",
    "check_tie_break",
    "check_greedy_failure",
    "TIE_TEXTS",
    "first_merges",
    "hard_strings",
    "varied_text",
    "wordpiece_reference",
    "viterbi_reference",
]


def hard_strings() -> list[str]:
    """Short strings that break careless tokenizers: unicode, emoji, whitespace runs, numbers, code."""
    return [
        "Hello world",
        "",
        " ",
        "  leading and trailing  ",
        "tabs\tand\nnewlines\r\n\n\n   runs",
        "naïve café, Ångström, São Paulo, Zürich, ĳ ǅ ﬁ ß İstanbul",
        "Ελληνικά, русский язык, עברית, العربية",
        "中文文本的分词：每个汉字。日本語の文章、カタカナ。한국어 문장입니다.",
        "हिन्दी भाषा, தமிழ்",
        "emoji 😀🎉👍🏽 👩‍👩‍👧‍👦 🇯🇵 and ⚡️",
        "3.14159 -42 1e-9 2026-11-21 0xDEADBEEF 1,234,567.89 ½ ² ٣",
        "def f(x):\n    return {'a': [1, 2]}  # comment\n\tif x != y: pass",
        "it's we'll they're I'M DON'T o'clock",
        "e-mail: someone@example.com, https://example.org/a?b=c&d=e#f",
        "ALLCAPS camelCase snake_case kebab-case",
        "\u00a0non\u00a0breaking\u2003em\u3000ideographic\u2028line\u2029para",
        "zero\u200bwidth\u200djoiner\ufeffbom",
        "control\x07chars\x1b[0m and \x00 null",
        "combining e\u0301 a\u0308 n\u0303",
        "x" * 120 + " " + "ab" * 70,
        "...!!!???---___***",
        "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    ]


def varied_text() -> str:
    """About 120 KB for parity tests: real prose, Python source, numbers, the hard strings, whitespace runs."""
    from ..data import load_corpus

    rng = random.Random(0)

    def number() -> str:  # an integer, a decimal or a date
        return rng.choice(
            [
                str(rng.randrange(10 ** rng.randrange(1, 12))),
                f"{rng.uniform(-1e4, 1e4):.{rng.randrange(6)}f}",
                f"{rng.randrange(1900, 2100)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}",
            ]
        )

    numbers = " ".join(number() for _ in range(1500))
    parts = [
        load_corpus("wikipedia", "validation")[:45_000],
        load_corpus("shakespeare", "validation")[:20_000],
        load_corpus("kjv", "validation")[:8_000],
        inspect.getsource(json.decoder),
        inspect.getsource(textwrap)[:12_000],
        numbers,
        *hard_strings() * 20,
        "\n\n\n\t \t  \r\n" * 50,
        " " * 37 + "end",
    ]
    return "\n".join(parts)


# -- the exercises ----------------------------------------------------------------------------
def check_count_pairs(count_pairs) -> object:
    """``count_pairs(ids)`` returns a dict {(a, b): occurrences of a followed by b}."""
    g = Grader("check_count_pairs")
    rng = random.Random(0)
    cases = [[], [7], [1, 2], [1, 1, 1, 1], [1, 2, 3, 1, 2], [rng.randrange(5) for _ in range(200)]]
    for ids in cases:
        got = g.call(count_pairs, list(ids))
        got = dict(got) if isinstance(got, (dict, Counter)) else got
        g.compare(f"ids={ids if len(ids) < 10 else '200 random ids'}", got, dict(Counter(zip(ids, ids[1:]))))
    return g.result()


def check_merge_pair(merge_pair) -> object:
    """``merge_pair(ids, pair, new_id)`` replaces each occurrence of ``pair``, left to right, by ``new_id``."""
    g = Grader("check_merge_pair")
    cases = [
        ([1, 2, 3, 1, 2], (1, 2), 9),
        ([1, 1, 1], (1, 1), 9),
        ([1, 1, 1, 1], (1, 1), 9),
        ([3, 1, 2], (1, 2), 9),
        ([1, 2], (2, 1), 9),
        ([], (1, 2), 9),
        ([5], (5, 5), 9),
        ([2, 1, 2, 1, 2], (1, 2), 7),
    ]
    for ids, pair, new_id in cases:
        expected = _merge_pair(ids, pair, new_id)
        g.compare(f"ids={ids}, pair={pair}", g.call(merge_pair, list(ids), pair, new_id), expected)
    return g.result()


def wordpiece_reference(word: str, vocab: set[str], prefix: str = "##") -> list[str]:
    """Greedy longest-match-first over ``vocab``; ['[UNK]'] if some position has no match."""
    pieces, start = [], 0
    while start < len(word):
        for end in range(len(word), start, -1):
            piece = word[start:end] if start == 0 else prefix + word[start:end]
            if piece in vocab:
                pieces.append(piece)
                start = end
                break
        else:
            return ["[UNK]"]
    return pieces


def check_wordpiece(encode_word) -> object:
    """``encode_word(word, vocab)`` cuts ``word`` into entries of the set ``vocab`` as BERT does."""
    g = Grader("check_wordpiece")
    vocab = {"un", "unaff", "##aff", "##able", "##a", "##ff", "##ble", "a", "b", "##b", "play", "##ing", "##s", "x"}
    for word in ["unaffable", "playing", "plays", "a", "ab", "abb", "unable", "xyz", "play", "bb"]:
        g.compare(f"word={word!r}", g.call(encode_word, word, set(vocab)), wordpiece_reference(word, vocab))
    return g.result()


def viterbi_reference(word: str, scores: dict[str, float]) -> list[str]:
    """The segmentation of ``word`` with the largest sum of ``scores``, by brute force (short words only)."""
    best, best_score = None, -math.inf
    for cuts in itertools.product([False, True], repeat=len(word) - 1):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                pieces.append(word[start:i])
                start = i
        pieces.append(word[start:])
        if all(p in scores for p in pieces):
            score = sum(scores[p] for p in pieces)
            if score > best_score:
                best, best_score = pieces, score
    return best


def check_viterbi(segment) -> object:
    """``segment(word, scores)`` returns the pieces of the most likely segmentation (log-probs add up)."""
    g = Grader("check_viterbi")
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
        "ther": -9.0,
    }
    for word in ["▁the", "▁there", "▁her", "▁tea", "▁three", "hehe", "▁", "a"]:
        expected = viterbi_reference(word, scores)
        g.compare(f"word={word!r}", g.call(segment, word, dict(scores)), expected)
    return g.result()


def first_merges(corpus: dict[str, int]) -> tuple[set[str], set[str]]:
    """The strings BPE and WordPiece would merge first on ``corpus`` (every tie), "##" left out.

    BPE: characters as symbols, the largest count(ab). WordPiece: a word's first character and its
    "##" continuations as different symbols (as ``llmedu.tokenizers.wordpiece`` keeps them), the largest
    count(ab) * log(count(ab) N / (count(a) count(b))), the likelihood gain of the lesson.
    """
    bpe_pairs: Counter[tuple[str, str]] = Counter()
    pairs: Counter[tuple[str, str]] = Counter()
    symbols: Counter[str] = Counter()
    for word, n in corpus.items():
        pieces = [word[0], *("##" + c for c in word[1:])] if word else []
        symbols.update({s: n * k for s, k in Counter(pieces).items()})
        for pair in zip(pieces, pieces[1:]):
            pairs[pair] += n
        for pair in zip(word, word[1:]):
            bpe_pairs[pair] += n
    if not pairs:
        return set(), set()
    total = sum(symbols.values())
    gain = {p: n * math.log(n * total / (symbols[p[0]] * symbols[p[1]])) for p, n in pairs.items()}
    top_count, top_gain = max(bpe_pairs.values()), max(gain.values())
    bpe = {a + b for (a, b), n in bpe_pairs.items() if n == top_count}
    wordpiece = {(a + b).replace("##", "") for (a, b), v in gain.items() if math.isclose(v, top_gain, rel_tol=1e-12)}
    return bpe, wordpiece


def check_bpe_vs_wordpiece(corpus) -> object:
    """``corpus()`` returns {word: count}; BPE's first merge (every tied one) must differ from WordPiece's."""
    g = Grader("check_bpe_vs_wordpiece")
    got = g.call(corpus)
    if g.failure is None:
        ok = isinstance(got, dict) and all(isinstance(w, str) and isinstance(n, int) and n > 0 for w, n in got.items())
        g.expect("the corpus", ok, f"expected a dict {{word: positive int count}}, got {got!r:.80}")
    if g.failure is None:
        bpe, wordpiece = first_merges(got)
        g.expect("the corpus has a pair of adjacent characters", bool(bpe), "no word has two characters")
        both = sorted(bpe & wordpiece)
        g.expect(
            "first merges",
            not both,
            f"both merge {both[0] if both else ''} first; BPE picks the most frequent pair, WordPiece the "
            "pair whose parts are rarely seen apart",
        )
    return g.result()


def _segmentations(word: str, vocab: set[str]) -> int:
    ways = [1] + [0] * len(word)  # ways[i]: cuts of word[:i]
    for end in range(1, len(word) + 1):
        ways[end] = sum(ways[start] for start in range(end) if word[start:end] in vocab)
    return ways[-1]


def check_count_segmentations(count) -> object:
    """``count(word, vocab)``: the number of ways to cut ``word`` into pieces that are all in ``vocab``."""
    g = Grader("check_count_segmentations")
    cases = [
        ("abc", {"a", "b", "c", "ab", "bc", "abc"}),
        ("aaaa", {"a", "aa"}),
        ("xyz", {"x", "y"}),
        ("unable", {"u", "n", "a", "b", "l", "e", "un", "able", "ab", "le", "unable", "na"}),
        ("a" * 30, {"a", "aa", "aaa"}),  # ~5e7 ways: enumerating them is not an option
    ]
    for word, vocab in cases:
        got = _call_with_budget(g, count, (word, set(vocab)), 200_000)
        g.compare(f"word={word!r}", got, _segmentations(word, vocab))
    return g.result()


class _OverBudget(Exception):
    pass


def _call_with_budget(g: Grader, fn, args: tuple, lines: int):
    """``g.call(fn, *args)``, stopped once it has executed ``lines`` lines of Python: counting ~5e7 segmentations
    by dynamic programming takes a few thousand lines, listing them one by one never ends."""
    left = [lines]

    def trace(frame, event, arg):
        if event == "line":
            left[0] -= 1
            if left[0] < 0:
                raise _OverBudget(f"still running after {lines:,} lines of Python: count, do not list")
        return trace

    sys.settrace(trace)
    try:
        return g.call(fn, *args)
    finally:
        sys.settrace(None)


TIE_TEXTS = ["abcabc", " bcbc"]  # GPT-2's pre-tokenizer keeps " bcbc" whole: the space starts the word


def check_tie_break(predict) -> object:
    """``predict()`` returns {"ids": [t1, t2, t3], "bytes": [...]}: the strings of the first three tokens that
    ``BPETokenizer().train(TIE_TEXTS, 259, special_tokens=())`` creates under each ``tie_break`` rule, worked out
    by hand: an answer that runs the library's trainer fails."""
    g = Grader("check_tie_break")
    got, called = call_watching(g, predict, (), Path(__file__).parent.parent / "tokenizers")
    g.expect("how the answer was found", called is None, f"it called {called}: predict the merges by hand")
    for rule in ("ids", "bytes"):
        tok = BPETokenizer().train(TIE_TEXTS, 256 + 3, special_tokens=(), tie_break=rule)
        expected = [tok.id_to_token(new) for new in tok.merges.values()]
        answer = got.get(rule) if isinstance(got, dict) else got
        g.compare(f'tie_break="{rule}", the first three merges', answer, expected)
    return g.result()


def _spellings(word: str, vocab: set[str]) -> int:  # WordPiece segmentations: "##" on every piece but the first
    ways = [1] + [0] * len(word)
    for end in range(1, len(word) + 1):
        ways[end] = sum(ways[i] for i in range(end) if (word[i:end] if i == 0 else "##" + word[i:end]) in vocab)
    return ways[-1]


def check_greedy_failure(case) -> object:
    """``case()`` returns (vocab, word): greedy longest-match gives ['[UNK]'], yet a WordPiece segmentation exists."""
    g = Grader("check_greedy_failure")
    got = g.call(case)
    ok = isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], str) and got[1]
    if g.expect("the answer", bool(ok), f"expected (a set of pieces, a non-empty word), got {got!r:.80}"):
        vocab, word = set(got[0]), got[1]
        g.expect(
            "greedy longest-match",
            wordpiece_reference(word, vocab) == ["[UNK]"],
            f"greedy cuts {word!r} into {wordpiece_reference(word, vocab)}, not [UNK]",
        )
        g.expect(
            "the vocabulary spells the word",
            _spellings(word, vocab) > 0,
            f"no segmentation of {word!r} exists (a piece after the first needs its '##'): [UNK] is "
            "then the right answer, not a failure of greed",
        )
    return g.result()
