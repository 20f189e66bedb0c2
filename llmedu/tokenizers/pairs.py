"""Pair counts kept up to date while merging: the bookkeeping behind BPE and WordPiece training.

Both trainers start from words cut into symbols and repeatedly glue one adjacent pair into a new
symbol. The naive way recounts every pair of every word after each merge: O(corpus) per merge.
But a merge only changes the words that contain the merged pair, so we keep

* ``counts[pair]``: occurrences of each adjacent pair, weighted by word frequency;
* ``where[pair]``: the words that (may) contain it, an inverted index;
* ``symbol_counts[symbol]``: occurrences of each symbol (WordPiece's score needs them),

and after a merge we only visit ``where[pair]``, subtracting each such word's old pairs and adding
its new ones. This is the trick of Sennrich et al.'s reference code and of every fast trainer.
``where`` is allowed to go stale (a word may no longer contain a pair it is listed under); a stale
entry costs one wasted look, never a wrong count.
"""

from __future__ import annotations

from collections import Counter, defaultdict

__all__ = ["merge_pair", "PairCounts"]

Pair = tuple[int, int]


def merge_pair(ids: list[int], pair: Pair, new_id: int) -> list[int]:
    """Replace every non-overlapping occurrence of ``pair`` in ``ids`` (left to right) by ``new_id``."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


class PairCounts:
    """Unique words (as lists of symbol ids) with their frequencies, and live pair statistics."""

    def __init__(self, words: dict[tuple[int, ...], int]):
        self.words = [list(w) for w in words]
        self.freqs = list(words.values())
        self.counts: Counter[Pair] = Counter()
        self.symbol_counts: Counter[int] = Counter()
        self.where: defaultdict[Pair, set[int]] = defaultdict(set)
        for i, (word, freq) in enumerate(zip(self.words, self.freqs)):
            for symbol in word:
                self.symbol_counts[symbol] += freq
            for pair in zip(word, word[1:]):
                self.counts[pair] += freq
                self.where[pair].add(i)

    def merge(self, pair: Pair, new_id: int) -> dict[Pair, int]:
        """Merge ``pair`` into ``new_id`` everywhere; return the pairs whose count changed, with new counts."""
        delta: Counter[Pair] = Counter()
        for i in self.where.pop(pair, ()):
            word, freq = self.words[i], self.freqs[i]
            merged = merge_pair(word, pair, new_id)
            if len(merged) == len(word):
                continue  # a stale entry of the index
            for old in zip(word, word[1:]):
                delta[old] -= freq
            for new in zip(merged, merged[1:]):
                delta[new] += freq
                self.where[new].add(i)
            times = len(word) - len(merged)
            self.symbol_counts[pair[0]] -= times * freq
            self.symbol_counts[pair[1]] -= times * freq
            self.symbol_counts[new_id] += times * freq
            self.words[i] = merged
        changed = {}
        for p, d in delta.items():
            if d == 0:
                continue
            self.counts[p] += d
            changed[p] = self.counts[p]
            if self.counts[p] <= 0:
                del self.counts[p]
        self.counts.pop(pair, None)
        return changed
