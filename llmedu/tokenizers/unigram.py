"""The unigram language-model tokenizer (Kudo, 2018), the default model of SentencePiece.

A unigram LM gives each piece x of the vocabulary a probability p(x), and a segmentation
x_1 ... x_m of a word the probability  p(x_1) * ... * p(x_m).  Encoding picks the most likely
segmentation with the Viterbi algorithm (a shortest path over the lattice of all pieces that
match inside the word). Training goes the other way, from a large vocabulary down:

1. *Seed*: every substring (up to 16 characters) of the corpus's words, with its frequency;
   keep the most frequent ones, and always every single character.
2. *EM*: segment the corpus with the current model (E: Viterbi, counting each piece used) and
   set p(x) = count(x) / total (M). We use this "hard" (Viterbi) EM; SentencePiece's soft EM
   counts every segmentation weighted by its probability.
3. *Prune*: for each piece, the loss in corpus log-likelihood if it were removed is about
   count(x) * (log p(x) - log p(best segmentation of x without x)); keep the 75% with the
   largest loss, and return to 2 until the vocabulary has the size asked for.

Words are made as SentencePiece and Hugging Face's ``Metaspace`` make them: every space becomes
'▁' and starts a new word (a '▁' is put in front of the text unless it starts with a space), so
decoding is ''.join(pieces) with '▁' back to ' '. ``sample`` draws a segmentation from
p(segmentation)^alpha instead of taking the best one: subword regularisation (Kudo, 2018, sec. 2.2).

What this leaves out: SentencePiece's text normalisation (NFKC), its suffix-array seeding, the
digamma (Bayesian) M-step and byte fallback; unknown characters become ``<unk>`` (runs of them
one ``<unk>``, as in Hugging Face).
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Iterable

from tqdm.auto import tqdm

from .base import Tokenizer, as_texts, check_vocab_size, split_on_special, warn_if_short

__all__ = ["UnigramTokenizer", "metaspace_words"]

SPACE = "\u2581"  # '▁'
UNK_PENALTY = 10.0  # an unknown character scores 10 nats below the rarest piece (as in Hugging Face)


def metaspace_words(text: str) -> list[str]:
    """Spaces become '▁', each of which starts a word: 'Hello world' -> ['▁Hello', '▁world']."""
    text = text.replace(" ", SPACE)
    if text and not text.startswith(SPACE):
        text = SPACE + text
    return re.findall(f"{SPACE}[^{SPACE}]*", text)


class UnigramTokenizer(Tokenizer):
    kind = "unigram"
    max_piece_length = 16

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[str] = []  # id -> piece (special tokens first)
        self.scores: list[float] = []  # id -> log p(piece); 0.0 for special tokens
        self._set_vocab([], [], {})

    def _set_vocab(self, pieces: list[str], scores: list[float], special_tokens: dict[str, int]) -> None:
        if len(pieces) != len(scores):
            raise ValueError(f"{len(pieces)} pieces but {len(scores)} scores: every piece needs its log-probability")
        outside = [t for t, i in special_tokens.items() if not (0 <= i < len(pieces) and pieces[i] == t)]
        if outside:
            raise ValueError(f"special token {outside[0]!r} is not at its id in the pieces")
        self.pieces, self.scores, self.special_tokens = pieces, scores, special_tokens
        specials = set(special_tokens.values())
        self.index = {p: i for i, p in enumerate(pieces) if i not in specials}  # piece -> id
        self.score_of = {p: scores[i] for p, i in self.index.items()}  # piece -> log p(piece)
        self.unk_id = special_tokens.get("<unk>")
        self.unk_score = min((s for i, s in enumerate(scores) if i not in specials), default=0.0) - UNK_PENALTY
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    # -- segmentation -------------------------------------------------------------------------
    def _lattice(self, word: str, scores: dict[str, float]):
        """For each end position, the pieces ending there: [(start, score, piece), ...].

        A character that is no piece gets an entry of its own with piece None (unknown).
        """
        ends = [[] for _ in range(len(word) + 1)]
        for start in range(len(word)):
            for end in range(start + 1, min(len(word), start + self.max_piece_length) + 1):
                piece = word[start:end]
                if piece in scores:
                    ends[end].append((start, scores[piece], piece))
            if word[start] not in scores:
                ends[start + 1].append((start, self.unk_score, None))  # an unknown character
        return ends

    def _viterbi(self, word: str, scores: dict[str, float]) -> list[str | None]:
        """The most likely segmentation of ``word`` (None marks an unknown character)."""
        ends = self._lattice(word, scores)
        best = [0.0] + [-math.inf] * len(word)  # best[i]: log-probability of the best cut of word[:i]
        back: list[tuple[int, str | None]] = [(0, None)] * (len(word) + 1)
        for end in range(1, len(word) + 1):
            for start, score, piece in ends[end]:
                if best[start] + score > best[end]:
                    best[end], back[end] = best[start] + score, (start, piece)
        pieces, end = [], len(word)
        while end > 0:
            start, piece = back[end]
            pieces.append(piece)
            end = start
        return pieces[::-1]

    def _sample(self, word: str, alpha: float, rng: random.Random) -> list[str | None]:
        """Forward filtering, backward sampling: a segmentation drawn from p(segmentation)^alpha."""
        ends = self._lattice(word, self.score_of)
        forward = [0.0] + [-math.inf] * len(word)  # log of the summed weight of all cuts of word[:i]
        for end in range(1, len(word) + 1):
            forward[end] = _logsumexp([forward[s] + alpha * score for s, score, _ in ends[end]])
        pieces, end = [], len(word)
        while end > 0:  # walk back, choosing each last piece in proportion to its weight
            weights = [math.exp(forward[s] + alpha * score - forward[end]) for s, score, _ in ends[end]]
            start, _, piece = rng.choices(ends[end], weights)[0]
            pieces.append(piece)
            end = start
        return pieces[::-1]

    def _to_ids(self, pieces: list[str | None]) -> list[int]:
        ids = []
        for piece in pieces:
            if piece is None:
                if self.unk_id is None:
                    raise ValueError("the text holds a character the vocabulary lacks, and there is no <unk>")
                if ids and ids[-1] == self.unk_id:
                    continue  # a run of unknown characters is one <unk>
                ids.append(self.unk_id)
            else:
                ids.append(self.index[piece])
        return ids

    def encode(self, text: str) -> list[int]:
        """The most likely segmentation of each word (Viterbi)."""
        return self._encode(text, lambda word: self._viterbi(word, self.score_of), cache=True)

    def sample(self, text: str, alpha: float = 0.1, seed: int | None = None) -> list[int]:
        """A random segmentation of each word, drawn with probability proportional to p(segmentation)^alpha.

        Small ``alpha`` flattens the distribution (alpha = 0: every segmentation equally likely);
        large ``alpha`` approaches ``encode``.
        """
        rng = random.Random(seed)
        return self._encode(text, lambda word: self._sample(word, alpha, rng), cache=False)

    def _encode(self, text: str, segment, cache: bool) -> list[int]:
        if not self.index:
            raise RuntimeError("this tokenizer has no vocabulary yet: train it first")
        ids = []
        for piece, special in split_on_special(text, self.special_tokens):
            if special:
                ids.append(self.special_tokens[piece])
                continue
            for word in metaspace_words(piece):
                if not cache:
                    ids.extend(self._to_ids(segment(word)))
                    continue
                if word not in self._cache:
                    self._cache[word] = self._to_ids(segment(word))
                ids.extend(self._cache[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"id {bad[0]} is not in the vocabulary (size {self.vocab_size})")
        text = "".join(self.pieces[i] for i in ids).replace(SPACE, " ")
        return text[1:] if text.startswith(" ") else text

    def id_to_token(self, i: int) -> str:
        self._check_id(i)
        return self.pieces[i]

    # -- training -----------------------------------------------------------------------------
    def train(
        self,
        texts: str | Iterable[str],
        vocab_size: int,
        special_tokens: Iterable[str] = ("<unk>",),
        seed_size: int | None = None,
        shrink: float = 0.75,
        em_steps: int = 2,
        progress: bool = False,
    ) -> UnigramTokenizer:
        """Seed, then alternate EM and pruning until ``vocab_size`` pieces (special tokens included).

        ``seed_size`` substrings start the search (by default ten times ``vocab_size``); each
        pruning round keeps the fraction ``shrink``; ``em_steps`` EM iterations run between rounds.
        """
        texts, special_tokens = as_texts(texts), list(special_tokens)
        words: Counter[str] = Counter()
        for text in texts:
            for piece, special in split_on_special(text, dict.fromkeys(special_tokens, 0)):
                if not special:
                    words.update(metaspace_words(piece))
        chars = {c for w in words for c in w}
        check_vocab_size(
            vocab_size, len(chars) + len(special_tokens), "the special tokens plus the characters of the corpus"
        )
        substrings: Counter[str] = Counter()
        for w, n in words.items():
            for i in range(len(w)):
                for j in range(i + 2, min(len(w), i + self.max_piece_length) + 1):
                    substrings[w[i:j]] += n
        seed = dict(substrings.most_common(seed_size or 10 * vocab_size))
        seed.update({c: sum(n * w.count(c) for w, n in words.items()) for c in chars})
        total = sum(seed.values())
        scores = {p: math.log(n / total) for p, n in seed.items()}
        self.unk_score = min(scores.values()) - UNK_PENALTY
        bar = tqdm(desc="Unigram vocabulary", total=len(scores), disable=not progress, leave=False)
        target = vocab_size - len(special_tokens)
        while True:
            for _ in range(em_steps):
                scores = self._em_step(words, scores, chars, min_size=target)
            if len(scores) <= target:
                break
            keep = max(target, int(len(scores) * shrink))
            bar.update(len(scores) - keep)
            scores = self._prune(words, scores, chars, keep)
        bar.close()
        ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
        self._set_vocab(
            special_tokens + [p for p, _ in ranked],
            [0.0] * len(special_tokens) + [s for _, s in ranked],
            {t: i for i, t in enumerate(special_tokens)},
        )
        warn_if_short(self, vocab_size)
        return self

    def _em_step(
        self, words: Counter[str], scores: dict[str, float], chars: set[str], min_size: int
    ) -> dict[str, float]:
        """E: count pieces in the Viterbi segmentations; M: normalise.

        Unused pieces drop out, unless that would leave fewer than ``min_size``: then the best of
        them stay, with a count of one half.
        """
        counts: Counter[str] = Counter({c: 0 for c in chars})
        for w, n in words.items():
            for piece in self._viterbi(w, scores):
                counts[piece] += n
        unused = sorted((p for p in scores if p not in counts), key=lambda p: (-scores[p], p))
        counts.update({p: 0 for p in unused[: max(0, min_size - len(counts))]})
        total = sum(counts.values())
        return {p: math.log(max(n, 0.5) / total) for p, n in counts.items()}

    def _prune(self, words: Counter[str], scores: dict[str, float], chars: set[str], keep: int) -> dict[str, float]:
        """Keep the ``keep`` pieces whose removal would cost the corpus the most log-likelihood."""
        counts: Counter[str] = Counter()
        for w, n in words.items():
            for piece in self._viterbi(w, scores):
                counts[piece] += n
        loss = {}
        for piece, score in scores.items():
            if piece in chars:
                loss[piece] = math.inf  # characters are never pruned: they guarantee coverage
                continue
            scores[piece] = -math.inf  # the best cut of the piece without the piece itself
            alternative = self._viterbi(piece, scores)
            scores[piece] = score
            loss[piece] = counts[piece] * (score - sum(scores[p] for p in alternative))
        kept = sorted(loss, key=lambda p: (-loss[p], p))[:keep]
        return {p: scores[p] for p in kept}

    # -- saving -------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {"pieces": self.pieces, "scores": self.scores, "special_tokens": self.special_tokens}

    @classmethod
    def _from_state(cls, state: dict) -> UnigramTokenizer:
        tok = cls()
        tok._set_vocab(list(state["pieces"]), list(state["scores"]), dict(state["special_tokens"]))
        return tok

    def _hf_pipeline(self) -> dict:
        """Hugging Face's Unigram model: Metaspace pieces and their log-probabilities."""
        metaspace = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "always", "split": True}
        return {
            "pre_tokenizer": metaspace,
            "decoder": metaspace,
            "model": {
                "type": "Unigram",
                "unk_id": self.unk_id,
                "byte_fallback": False,
                "vocab": [[p, s] for p, s in zip(self.pieces, self.scores)],
            },
        }


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top if top == -math.inf else top + math.log(sum(math.exp(v - top) for v in values))
