"""Byte-level byte-pair encoding, as in GPT-2 (Radford et al., 2019; BPE: Sennrich et al., 2016).

Text is first cut into chunks by GPT-2's regular expression (words with their leading space,
runs of digits, runs of punctuation, whitespace), so that no merge ever crosses a chunk. Each
chunk becomes its UTF-8 bytes, so the base alphabet is the 256 byte values and nothing is ever
unknown. Training then repeats, until the vocabulary is full:

    (a, b) = the most frequent adjacent pair in the corpus;  new symbol ab;  merge it everywhere

Ties between equally frequent pairs are broken by a stated rule, so training is deterministic:

``tie_break="ids"``    (the default) the pair of smaller ids, compared as (first id, second id). Hugging
                       Face ``tokenizers``' BpeTrainer uses this rule too, but in its own ids (special tokens
                       first, then the alphabet sorted by character), which follow byte order for letters and
                       digits, not for space or control bytes.
``tie_break="bytes"``  the lexicographically greater pair of byte strings (first token's bytes, then the
                       second's), the rule of course reference trainers such as Stanford CS336's.

Two trainers learn exactly the same merges under either rule:

``train_naive``  the loop above as written (minbpe's first version): recount every pair of every
                 chunk before each merge, O(corpus) per merge. The reference: plainly right.
``train``        the fast one: pair counts updated incrementally (``pairs.PairCounts``) and the best
                 pair found with a lazy max-heap, so a merge costs time in proportion to the chunks
                 it touches, not to the corpus. It must learn what ``train_naive`` learns (a test checks it).

Encoding replays the learned merges on each chunk, always applying the earliest-learned (lowest
rank) pair first, exactly as GPT-2's ``encoder.py`` does; so ``from_gpt2`` loads OpenAI's
published ``encoder.json`` + ``vocab.bpe`` and reproduces GPT-2's ids (the file formats are in
``bpe_files.py``).

What this leaves out: BPE-dropout, a cap on the length of a token, and the byte-to-unicode
trick except where it is needed to read and write GPT-2/Hugging Face files.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import regex
from tqdm.auto import tqdm

from .base import Tokenizer, as_texts, check_vocab_size, split_on_special, warn_if_short
from .bpe_files import bytes_to_unicode, hf_pipeline, load_gpt2
from .pairs import PairCounts, merge_pair

__all__ = ["BPETokenizer", "GPT2_PATTERN", "TIE_BREAKS", "bytes_to_unicode"]

TIE_BREAKS = ("ids", "bytes")

# Contractions, letters with an optional leading space, digits, other symbols, whitespace runs
# (all but the last space, which then starts the next word: '\s+(?!\S)').
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class BPETokenizer(Tokenizer):
    kind = "bpe"

    def __init__(self) -> None:
        super().__init__()
        self.pattern = regex.compile(GPT2_PATTERN)
        self.byte_ids: list[int] = list(range(256))  # id of each byte (GPT-2 orders them differently)
        self.merges: dict[tuple[int, int], int] = {}  # (a, b) -> id of ab, in the order learned
        self._build()

    # -- training: the reference, then the fast trainer ---------------------------------------
    def train_naive(
        self,
        texts: str | Iterable[str],
        vocab_size: int,
        special_tokens: Iterable[str] = ("<|endoftext|>",),
        tie_break: str = "ids",
    ) -> BPETokenizer:
        """The reference trainer: before each merge, count every adjacent pair of every chunk again."""
        words, special_tokens = self._start_training(texts, vocab_size, special_tokens)
        ties = _tie_order(tie_break, self.vocab)
        id_of = {bytes([b]): b for b in range(256)}  # token bytes -> id
        while len(id_of) < vocab_size - len(special_tokens):
            counts: Counter[tuple[int, int]] = Counter()
            for word, n in words.items():  # word: a chunk as a tuple of ids, n: how often it occurs
                for pair in zip(word, word[1:]):
                    counts[pair] += n
            if not counts:
                break  # every chunk is a single token: the corpus has nothing left to merge
            pair = min(counts, key=lambda p: (-counts[p], ties(p)))  # the most frequent; ties by the rule
            new = id_of.setdefault(self.vocab[pair[0]] + self.vocab[pair[1]], len(id_of))  # ('ab'+'c' = 'a'+'bc')
            self.merges[pair] = new
            self.vocab[new] = self.vocab[pair[0]] + self.vocab[pair[1]]
            merged: Counter[tuple[int, ...]] = Counter()
            for word, n in words.items():
                merged[tuple(merge_pair(list(word), pair, new))] += n
            words = merged
        return self._finish_training(special_tokens, vocab_size)

    def train(
        self,
        texts: str | Iterable[str],
        vocab_size: int,
        special_tokens: Iterable[str] = ("<|endoftext|>",),
        progress: bool = False,
        tie_break: str = "ids",
    ) -> BPETokenizer:
        """Learn ``vocab_size - 256 - len(special_tokens)`` merges from ``texts`` (the merges of ``train_naive``)."""
        words, special_tokens = self._start_training(texts, vocab_size, special_tokens)
        state = PairCounts(words)
        id_of = {bytes([b]): b for b in range(256)}  # token bytes -> id
        token_of = {b: bytes([b]) for b in range(256)}
        ties = _tie_order(tie_break, token_of)
        heap = [(-n, ties(pair), pair) for pair, n in state.counts.items()]  # a max-heap on count, then the rule
        heapq.heapify(heap)
        bar = tqdm(total=vocab_size - len(special_tokens) - 256, disable=not progress, desc="BPE merges", leave=False)
        while len(id_of) < vocab_size - len(special_tokens):
            while heap and state.counts.get(heap[0][2], 0) != -heap[0][0]:
                heapq.heappop(heap)  # an outdated entry: the pair's count has changed since
            if not heap:
                break  # every chunk is a single token: the corpus has nothing left to merge
            *_, pair = heapq.heappop(heap)
            merged = token_of[pair[0]] + token_of[pair[1]]
            if merged not in id_of:  # (it may be: 'ab'+'c' and 'a'+'bc' make the same token)
                id_of[merged] = len(id_of)
                token_of[id_of[merged]] = merged
                bar.update()
            self.merges[pair] = id_of[merged]
            for p, n in state.merge(pair, id_of[merged]).items():
                if n > 0:
                    heapq.heappush(heap, (-n, ties(p), p))
        bar.close()
        return self._finish_training(special_tokens, vocab_size)

    def _start_training(self, texts, vocab_size: int, special_tokens) -> tuple[dict[tuple[int, ...], int], list[str]]:
        """Forget any vocabulary; the corpus as {chunk's bytes: count}. Special tokens are cut out first."""
        texts, special_tokens = as_texts(texts), list(special_tokens)
        check_vocab_size(vocab_size, 256 + len(special_tokens), "256 bytes plus the special tokens")
        chunks: Counter[str] = Counter()
        for text in texts:
            for piece, special in split_on_special(text, dict.fromkeys(special_tokens, 0)):
                if not special:
                    chunks.update(self.pattern.findall(piece))
        self.byte_ids, self.merges, self.special_tokens = list(range(256)), {}, {}
        self._build()
        return {tuple(c.encode("utf-8")): n for c, n in chunks.items()}, special_tokens

    def _finish_training(self, special_tokens: list[str], vocab_size: int) -> BPETokenizer:
        first = 256 + len(set(self.merges.values()))  # the ids after the bytes and the learned tokens
        self.special_tokens = {t: first + k for k, t in enumerate(special_tokens)}
        self._build()
        warn_if_short(self, vocab_size)
        return self

    # -- encoding and decoding --------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece, special in split_on_special(text, self.special_tokens):
            if special:
                ids.append(self.special_tokens[piece])
                continue
            for chunk in self.pattern.findall(piece):
                ids.extend(self._encode_chunk(chunk))
        return ids

    def _encode_chunk(self, chunk: str) -> list[int]:
        if chunk in self._cache:
            return self._cache[chunk]
        ids = [self.byte_ids[b] for b in chunk.encode("utf-8")]
        while len(ids) >= 2:
            pair = min(zip(ids, ids[1:]), key=lambda p: self.ranks.get(p, float("inf")))
            if pair not in self.ranks:
                break  # no learned merge applies any more
            ids = merge_pair(ids, pair, self.merges[pair])
        if len(self._cache) < 200_000:
            self._cache[chunk] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        unknown = [i for i in ids if i not in self.vocab]
        if unknown:
            raise ValueError(f"id {unknown[0]} is not in the vocabulary (size {self.vocab_size})")
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> str:
        self._check_id(i)
        return self.vocab[i].decode("utf-8", errors="backslashreplace")

    # -- lookup tables ------------------------------------------------------------------------------
    def _build(self) -> None:
        """Derive the lookup tables from ``byte_ids``, ``merges`` and ``special_tokens``."""
        self.ranks = {pair: rank for rank, pair in enumerate(self.merges)}
        self.vocab: dict[int, bytes] = {i: bytes([b]) for b, i in enumerate(self.byte_ids)}
        for (a, b), new in self.merges.items():
            self.vocab[new] = self.vocab[a] + self.vocab[b]
        for token, i in self.special_tokens.items():
            self.vocab[i] = token.encode("utf-8")
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    # -- files: our JSON (``base.Tokenizer.save``), GPT-2's and Hugging Face's (``bpe_files.py``) ------
    @classmethod
    def from_gpt2(cls, encoder_json_path: str | Path, vocab_bpe_path: str | Path) -> BPETokenizer:
        """Load OpenAI's ``encoder.json`` (token -> id) and ``vocab.bpe`` (the merges, in rank order)."""
        return load_gpt2(cls(), encoder_json_path, vocab_bpe_path)

    def _hf_pipeline(self) -> dict:
        return hf_pipeline(self)

    def _state(self) -> dict:
        return {
            "pattern": GPT2_PATTERN,
            "byte_ids": self.byte_ids,
            "merges": [[a, b, new] for (a, b), new in self.merges.items()],
            "special_tokens": self.special_tokens,
        }

    @classmethod
    def _from_state(cls, state: dict) -> BPETokenizer:
        tok = cls()
        tok.byte_ids = list(state["byte_ids"])
        tok.merges = {(a, b): new for a, b, new in state["merges"]}
        tok.special_tokens = dict(state["special_tokens"])
        tok._build()
        return tok


class _Greater:
    """Orders byte-string pairs in reverse, so that a min-heap (or ``min``) yields the greatest first."""

    __slots__ = ("key",)

    def __init__(self, key: tuple[bytes, bytes]):
        self.key = key

    def __lt__(self, other: _Greater) -> bool:
        return self.key > other.key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Greater) and self.key == other.key


def _tie_order(tie_break: str, token_of: dict[int, bytes]):
    """The key that ranks equally frequent pairs, smallest first: the pair itself, or its bytes reversed."""
    if tie_break == "ids":
        return lambda pair: pair
    if tie_break == "bytes":
        return lambda pair: _Greater((token_of[pair[0]], token_of[pair[1]]))
    raise ValueError(f"tie_break={tie_break!r} is not a rule; use one of {TIE_BREAKS}")
