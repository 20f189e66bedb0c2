"""Byte-level byte-pair encoding, as in GPT-2 (Radford et al., 2019; BPE: Sennrich et al., 2016).

Text is first cut into chunks by GPT-2's regular expression (words with their leading space,
runs of digits, runs of punctuation, whitespace), so that no merge ever crosses a chunk. Each
chunk becomes its UTF-8 bytes, so the base alphabet is the 256 byte values and nothing is ever
unknown. Training then repeats, until the vocabulary is full:

    (a, b) = the most frequent adjacent pair in the corpus;  new symbol ab;  merge it everywhere

Encoding replays the learned merges on each chunk, always applying the earliest-learned (lowest
rank) pair first, exactly as GPT-2's ``encoder.py`` does; so ``from_gpt2`` loads OpenAI's
published ``encoder.json`` + ``vocab.bpe`` and reproduces GPT-2's ids.

The pair counts are updated incrementally (``pairs.PairCounts``) and the best pair found with a
lazy max-heap, so a merge costs time in proportion to the words it touches, not to the corpus.
Ties between equally frequent pairs go to the smaller pair of ids.

What this leaves out: BPE-dropout, a cap on the length of a token, and the byte-to-unicode
trick except where it is needed to read and write GPT-2/Hugging Face files.
"""

from __future__ import annotations

import heapq
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import regex
from tqdm.auto import tqdm

from .base import Tokenizer, as_texts, check_vocab_size, split_on_special, warn_if_short
from .pairs import PairCounts, merge_pair

__all__ = ["BPETokenizer", "GPT2_PATTERN", "bytes_to_unicode"]

# Contractions, letters with an optional leading space, digits, other symbols, whitespace runs
# (all but the last space, which then starts the next word: '\s+(?!\S)').
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (a space is 'Ġ'), used in its vocabulary files."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class BPETokenizer(Tokenizer):
    kind = "bpe"

    def __init__(self) -> None:
        super().__init__()
        self.pattern = regex.compile(GPT2_PATTERN)
        self.byte_ids: list[int] = list(range(256))  # id of each byte (GPT-2 orders them differently)
        self.merges: dict[tuple[int, int], int] = {}  # (a, b) -> id of ab, in the order learned
        self._build()

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

    # -- training ---------------------------------------------------------------------------------
    def train(
        self,
        texts: str | Iterable[str],
        vocab_size: int,
        special_tokens: Iterable[str] = ("<|endoftext|>",),
        progress: bool = False,
    ) -> BPETokenizer:
        """Learn ``vocab_size - 256 - len(special_tokens)`` merges from ``texts``."""
        texts, special_tokens = as_texts(texts), list(special_tokens)
        check_vocab_size(vocab_size, 256 + len(special_tokens), "256 bytes plus the special tokens")
        chunks: Counter[str] = Counter()
        for text in texts:
            for piece, special in split_on_special(text, dict.fromkeys(special_tokens, 0)):
                if not special:
                    chunks.update(self.pattern.findall(piece))
        state = PairCounts({tuple(c.encode("utf-8")): n for c, n in chunks.items()})
        heap = [(-n, pair) for pair, n in state.counts.items()]  # a max-heap on count
        heapq.heapify(heap)
        self.byte_ids, self.merges, self.special_tokens = list(range(256)), {}, {}
        id_of = {bytes([b]): b for b in range(256)}  # token bytes -> id
        token_of = {b: bytes([b]) for b in range(256)}
        bar = tqdm(total=vocab_size - len(special_tokens) - 256, disable=not progress, desc="BPE merges", leave=False)
        while len(id_of) < vocab_size - len(special_tokens):
            while heap and state.counts.get(heap[0][1], 0) != -heap[0][0]:
                heapq.heappop(heap)  # an outdated entry: the pair's count has changed since
            if not heap:
                break  # every chunk is a single token: the corpus has nothing left to merge
            _, pair = heapq.heappop(heap)
            merged = token_of[pair[0]] + token_of[pair[1]]
            if merged not in id_of:  # (it may be: 'ab'+'c' and 'a'+'bc' make the same token)
                id_of[merged] = len(id_of)
                token_of[id_of[merged]] = merged
                bar.update()
            self.merges[pair] = id_of[merged]
            for p, n in state.merge(pair, id_of[merged]).items():
                if n > 0:
                    heapq.heappush(heap, (-n, p))
        bar.close()
        self.special_tokens = {t: len(id_of) + k for k, t in enumerate(special_tokens)}
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

    # -- GPT-2's published files --------------------------------------------------------------
    @classmethod
    def from_gpt2(cls, encoder_json_path: str | Path, vocab_bpe_path: str | Path) -> BPETokenizer:
        """Load OpenAI's ``encoder.json`` (token -> id) and ``vocab.bpe`` (the merges, in rank order)."""
        try:
            encoder = json.loads(Path(encoder_json_path).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{encoder_json_path} is not a GPT-2 encoder.json: {err}") from None
        if not isinstance(encoder, dict) or not all(isinstance(i, int) for i in encoder.values()):
            raise ValueError(f"{encoder_json_path} must map token strings to integer ids")
        if len(set(encoder.values())) != len(encoder):
            raise ValueError(f"{encoder_json_path} gives the same id to two tokens")
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        missing = [c for c in byte_of if c not in encoder]
        if missing:
            raise ValueError(
                f"{encoder_json_path} lacks the byte token {missing[0]!r}: every one of the 256 must be there"
            )
        tok = cls()
        tok.byte_ids = [encoder[c] for c in bytes_to_unicode().values()]
        lines = Path(vocab_bpe_path).read_text(encoding="utf-8").splitlines()
        if lines and lines[0].startswith("#version"):
            lines = lines[1:]
        for n, line in enumerate(lines, 1):
            parts = line.split(" ")
            if len(parts) != 2 or not all(parts):
                raise ValueError(f"{vocab_bpe_path}, merge {n}: expected two tokens separated by a space, got {line!r}")
            a, b = parts
            for t in (a, b, a + b):
                if t not in encoder:
                    raise ValueError(f"{vocab_bpe_path}, merge {n} ({line!r}): {t!r} is not in {encoder_json_path}")
            tok.merges[(encoder[a], encoder[b])] = encoder[a + b]
        reachable = set(tok.byte_ids) | set(tok.merges.values())
        # what no merge makes must be a special token, written <|...|> as GPT-2's <|endoftext|>; anything
        # else unreachable means a vocab.bpe cut short (its tokens would be matched as "special" text)
        stranded = [t for t, i in encoder.items() if i not in reachable and not re.fullmatch(r"<\|[^|]+\|>", t)]
        if stranded:
            raise ValueError(
                f"{len(stranded)} tokens of {encoder_json_path} are made by no merge of {vocab_bpe_path} "
                f"({len(tok.merges)} merges), the first {stranded[0]!r}: is {vocab_bpe_path} cut short?"
            )
        tok.special_tokens = {t: i for t, i in encoder.items() if i not in reachable}
        tok._build()
        return tok

    # -- saving --------------------------------------------------------------------------------
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

    def _hf_pipeline(self) -> dict:
        """Hugging Face's byte-level BPE: the same regex, bytes written with GPT-2's stand-ins."""
        char = bytes_to_unicode()
        name = {i: "".join(char[b] for b in self.vocab[i]) for i in self.vocab if i not in self.special_tokens.values()}
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        return {
            "pre_tokenizer": byte_level,
            "decoder": byte_level,
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {name[i]: i for i in sorted(name)},
                "merges": [[name[a], name[b]] for a, b in self.merges],
            },
        }
