"""WordPiece, as in BERT (Devlin et al., 2019; the algorithm: Schuster & Nakajima, 2012; Wu et al., 2016).

Encoding has two stages:

1. BERT's *basic tokenizer* (``basic.py``): drop control characters, turn every whitespace into a space, put
   spaces around CJK ideographs (so Chinese is cut per character), strip accents (NFD, then drop
   the combining marks) and lower-case; then split on whitespace and cut every punctuation
   character out as a word of its own.
2. *Greedy longest-match-first* on each word: take the longest vocabulary entry that starts the
   word, then the longest ``##``-prefixed entry that continues it, and so on; if some position has
   no match, the whole word becomes ``[UNK]``.

``encode`` adds ``[CLS] ... [SEP]`` as BERT does. ``from_vocab`` reads a BERT ``vocab.txt`` and
then encodes exactly like ``transformers.BertTokenizerFast`` (the Rust ``BertNormalizer`` +
``BertPreTokenizer`` + ``WordPiece``), including which characters count as whitespace or control.

Training starts from single characters (``##``-prefixed when not word-initial) and repeatedly
merges the pair that most increases the likelihood of the corpus under a unigram model of the
symbols (Schuster & Nakajima, 2012). With N symbols in all, that gain is about

    count(ab) * log( count(ab) * N / (count(a) * count(b)) )

the pointwise mutual information of a and b, weighted by how often the pair occurs: the change in
log-likelihood when every occurrence of a b trades p(a) p(b) for p(ab) with the probabilities held
fixed. It is an approximation: it ignores that a and b lose those counts (and N shrinks), so it
overstates the gain of a pair that is rare beside its parts (c_a = c_b = 1000, k = 100 in N = 102,000:
232 by the formula, 142.5 exactly). Unlike BPE's
raw frequency, it prefers pairs whose parts are rarely seen apart. (The score often quoted,
count(ab) / (count(a) * count(b)), drops the weight, and so merges pairs of rare symbols first:
a single occurrence of two otherwise unseen characters gets the top score of 1.)

What this leaves out: Google's original trainer (which re-segments the corpus with a language
model); ``tokenizers``' WordPieceTrainer, which runs BPE instead; pairs of sentences and
token-type ids; offsets. The trainer scans all pairs for the best score at every merge (its pair
counts are incremental, the arg-max is not), so it is meant for small corpora.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from tqdm.auto import tqdm

from .base import Tokenizer, as_texts, check_vocab_size, split_on_special, warn_if_short
from .basic import basic_tokenize, normalize
from .pairs import PairCounts

__all__ = ["WordPieceTokenizer", "likelihood_gain"]

BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def likelihood_gain(state: PairCounts):
    """The key that ranks pairs for a WordPiece merge: the gain in log-likelihood, then the count, then ids."""
    counts, symbols = state.counts, state.symbol_counts
    total = sum(symbols.values())

    def key(pair):
        n = counts[pair]
        return n * math.log(n * total / (symbols[pair[0]] * symbols[pair[1]])), n, -pair[0], -pair[1]

    return key


# Hugging Face's WordPiece decoder tidies each decoded piece with these replacements (its ``cleanup``).
_CLEANUP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" do not", " don't"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class WordPieceTokenizer(Tokenizer):
    kind = "wordpiece"
    prefix = "##"

    def __init__(self, lowercase: bool = True, max_chars_per_word: int = 100) -> None:
        super().__init__()
        self.lowercase = lowercase
        self.max_chars_per_word = max_chars_per_word
        self.vocab: dict[str, int] = {}
        self.tokens_by_id: list[str] = []

    def _set_vocab(self, tokens: list[str]) -> None:
        if len(set(tokens)) != len(tokens):
            dup = next(t for t, n in Counter(tokens).items() if n > 1)
            raise ValueError(f"the vocabulary lists {dup!r} twice")
        missing = [t for t in ("[UNK]", "[CLS]", "[SEP]") if t not in tokens]
        if missing:
            raise ValueError(f"the vocabulary lacks the special token {missing[0]}")
        self.tokens_by_id = tokens
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.special_tokens = {t: self.vocab[t] for t in BERT_SPECIALS if t in self.vocab}
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens_by_id)

    @classmethod
    def from_vocab(cls, vocab_txt_path: str | Path, lowercase: bool = True) -> WordPieceTokenizer:
        """Read a BERT ``vocab.txt``: one token per line, the line number is the id."""
        try:
            tokens = Path(vocab_txt_path).read_text(encoding="utf-8").split("\n")
        except UnicodeDecodeError as err:
            raise ValueError(f"{vocab_txt_path} is not a UTF-8 vocab.txt: {err}") from None
        if tokens and tokens[-1] == "":
            tokens.pop()  # the newline that ends the file
        if any(t == "" or t != t.strip() for t in tokens):
            bad = next(n for n, t in enumerate(tokens, 1) if t == "" or t != t.strip())
            raise ValueError(f"{vocab_txt_path}, line {bad}: a token is empty or has surrounding whitespace")
        tok = cls(lowercase=lowercase)
        tok._set_vocab(tokens)
        return tok

    # -- encoding -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self.vocab:
            raise RuntimeError("this tokenizer has no vocabulary yet: train it or use from_vocab")
        ids = []
        for piece, special in split_on_special(text, self.special_tokens):
            if special:
                ids.append(self.special_tokens[piece])
                continue
            for word in basic_tokenize(normalize(piece, self.lowercase)):
                ids.extend(self._encode_word(word))
        return [self.vocab["[CLS]"], *ids, self.vocab["[SEP]"]] if add_special_tokens else ids

    def _encode_word(self, word: str) -> list[int]:
        """Greedy longest-match-first; any position without a match makes the word [UNK]."""
        if word in self._cache:
            return self._cache[word]
        ids, start = [], 0
        if len(word) > self.max_chars_per_word:
            ids, start = [self.vocab["[UNK]"]], len(word)
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                if piece in self.vocab:
                    ids.append(self.vocab[piece])
                    start = end
                    break
            else:
                ids, start = [self.vocab["[UNK]"]], len(word)
        if len(self._cache) < 200_000:
            self._cache[word] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        """Glue ``##`` pieces to the piece before, a space before every other piece, then ``_CLEANUP``
        on each piece (what was lower-cased stays so).

        This is what Hugging Face's WordPiece decoder does: its clean-up runs on one piece at a time,
        so it glues punctuation but cannot join "can ' t" back into "can't" (BERT's pre-tokenizer cut
        it into three words; the text alone cannot say whether there were spaces around the ').
        """
        pieces = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"id {i} is not in the vocabulary (size {self.vocab_size})")
            token = self.tokens_by_id[i]
            piece = token[len(self.prefix) :] if token.startswith(self.prefix) else (" " if pieces else "") + token
            for before, after in _CLEANUP:
                piece = piece.replace(before, after)
            pieces.append(piece)
        return "".join(pieces)

    def id_to_token(self, i: int) -> str:
        self._check_id(i)
        return self.tokens_by_id[i]

    # -- training -----------------------------------------------------------------------------
    def train(
        self,
        texts: str | Iterable[str],
        vocab_size: int,
        special_tokens: Iterable[str] = BERT_SPECIALS,
        progress: bool = False,
    ) -> WordPieceTokenizer:
        """Learn a vocabulary of ``vocab_size`` entries: special tokens, characters, then merges."""
        texts, special_tokens = as_texts(texts), list(special_tokens)
        words: Counter[str] = Counter()
        for text in texts:
            words.update(basic_tokenize(normalize(text, self.lowercase)))
        alphabet = sorted({w[0] for w in words} | {self.prefix + c for w in words for c in w[1:]})
        tokens = special_tokens + alphabet
        check_vocab_size(vocab_size, len(tokens), "the special tokens plus the characters of the corpus")
        index = {t: i for i, t in enumerate(tokens)}
        state = PairCounts({(index[w[0]], *(index[self.prefix + c] for c in w[1:])): n for w, n in words.items()})
        bar = tqdm(total=vocab_size - len(tokens), disable=not progress, desc="WordPiece merges", leave=False)
        while len(tokens) < vocab_size and state.counts:
            a, b = max(state.counts, key=likelihood_gain(state))
            merged = tokens[a] + tokens[b][len(self.prefix) :]
            if merged not in index:  # (it may be: the same string reached from another pair)
                index[merged] = len(tokens)
                tokens.append(merged)
                bar.update()
            state.merge((a, b), index[merged])
        bar.close()
        self._set_vocab(tokens)
        warn_if_short(self, vocab_size)
        return self

    # -- saving -------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {"lowercase": self.lowercase, "max_chars_per_word": self.max_chars_per_word, "vocab": self.tokens_by_id}

    @classmethod
    def _from_state(cls, state: dict) -> WordPieceTokenizer:
        tok = cls(lowercase=state["lowercase"], max_chars_per_word=state["max_chars_per_word"])
        tok._set_vocab(list(state["vocab"]))
        return tok

    def _hf_pipeline(self) -> dict:
        """Hugging Face's BERT pipeline: its normalizer and pre-tokenizer, [CLS] A [SEP] (B [SEP]), WordPiece."""
        cls_, sep = ("[CLS]", self.vocab["[CLS]"]), ("[SEP]", self.vocab["[SEP]"])
        special = lambda t, type_id=0: {"SpecialToken": {"id": t, "type_id": type_id}}  # noqa: E731
        sequence = lambda s, type_id: {"Sequence": {"id": s, "type_id": type_id}}  # noqa: E731
        return {
            "normalizer": {
                "type": "BertNormalizer",
                "clean_text": True,
                "handle_chinese_chars": True,
                "strip_accents": None,
                "lowercase": self.lowercase,
            },
            "pre_tokenizer": {"type": "BertPreTokenizer"},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [special("[CLS]"), sequence("A", 0), special("[SEP]")],
                "pair": [special("[CLS]"), sequence("A", 0), special("[SEP]"), sequence("B", 1), special("[SEP]", 1)],
                "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in (cls_, sep)},
            },
            "decoder": {"type": "WordPiece", "prefix": self.prefix, "cleanup": True},
            "model": {
                "type": "WordPiece",
                "unk_token": "[UNK]",
                "continuing_subword_prefix": self.prefix,
                "max_input_chars_per_word": self.max_chars_per_word,
                "vocab": self.vocab,
            },
        }
