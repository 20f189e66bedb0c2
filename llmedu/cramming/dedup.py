"""Deduplicating the pretraining text: exact duplicate documents and repeated lines, counted.

Repeated text is read more than once per pass, so it costs budget and teaches the model to recite
(Lee et al. 2022, "Deduplicating Training Data Makes Language Models Better", sec. 4-5: exact and
near duplicates in C4 and the Pile; Rae et al. 2021, Gopher, appendix A.1.1, drop documents with
many repeated lines). Cramming (Geiping & Goldstein 2022, sec. 4.4) deduplicates its Pile slice
before the clock starts; so does this, as part of the data preparation, outside the budget.

Two rules, in this order, over all corpora together (so a copy in another corpus counts):

1. a document whose text, with runs of white space squeezed, equals an earlier one is dropped;
2. a line of at least ``min_line_chars`` characters (stripped) that appeared earlier is dropped.
   Short lines are kept: a speaker's name ("HAMLET:") or "Amen." repeat by nature, not by copying.
   A document left with no line is dropped too.

The validation split is deduplicated against the train split as well (``against``): a held-out
loss measured on text the model trained on would flatter it.

Left out: near duplicates (MinHash, suffix arrays: Lee et al.'s other two methods), and filtering
by quality. The WordPiece vocabulary is learnt from the raw text, as before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..data.cache import cache_dir
from ..data.packing import pack, read_documents
from ..tokenizers import WordPieceTokenizer

__all__ = ["deduplicate", "dedup_counts", "deduplicated_rows", "MIN_LINE_CHARS"]

MIN_LINE_CHARS = 30  # shorter lines may repeat: names, "Amen.", stage directions


def _key(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()[:16]


def deduplicate(
    documents: Sequence[str], min_line_chars: int = MIN_LINE_CHARS, against: Iterable[str] = ()
) -> tuple[list[str], dict]:
    """(kept documents, counts): exact duplicate documents and repeated long lines removed.

    ``against``: documents already kept elsewhere (the train split, for the validation split); their
    documents and lines count as seen, and none of them is returned.
    """
    if min_line_chars < 1:
        raise ValueError(f"min_line_chars must be at least 1, got {min_line_chars}")
    seen_docs, seen_lines = set(), set()

    def remember(doc: str) -> None:
        seen_docs.add(_key(" ".join(doc.split())))
        seen_lines.update(_key(s) for line in doc.splitlines() if len(s := line.strip()) >= min_line_chars)

    for doc in against:
        remember(doc)
    kept, counts = [], dict(documents=len(documents), duplicate_documents=0, lines=0, repeated_lines=0, emptied=0)
    for doc in documents:
        lines = doc.splitlines()
        counts["lines"] += len(lines)
        if _key(" ".join(doc.split())) in seen_docs:
            counts["duplicate_documents"] += 1  # its lines are not counted again as repeated lines
            continue
        seen_docs.add(_key(" ".join(doc.split())))
        out = []
        for line in lines:
            s = line.strip()
            if len(s) >= min_line_chars:
                k = _key(s)
                if k in seen_lines:
                    counts["repeated_lines"] += 1
                    continue
                seen_lines.add(k)
            out.append(line)
        if not any(line.strip() for line in out):
            counts["emptied"] += 1
            continue
        kept.append("\n".join(out))
    counts["chars_before"] = sum(len(d) for d in documents)
    counts["chars_after"] = sum(len(d) for d in kept)
    return kept, counts


def _kept(corpora: Sequence[str], split: str, max_chars: int | None, min_line_chars: int) -> tuple[list[str], dict]:
    documents = read_documents(corpora, split, max_chars)
    against = read_documents(corpora, "train", max_chars) if split != "train" else ()
    return deduplicate(documents, min_line_chars, against)


def dedup_counts(
    corpora: Sequence[str], split: str, max_chars: int | None = None, min_line_chars: int = MIN_LINE_CHARS
) -> dict:
    """What ``deduplicate`` removes from ``split`` of the corpora (a second or two: no tokenizing)."""
    return _kept(corpora, split, max_chars, min_line_chars)[1]


def deduplicated_rows(
    tokenizer: WordPieceTokenizer,
    corpora: Sequence[str],
    split: str,
    seq_len: int,
    max_chars: int | None = None,
    min_line_chars: int = MIN_LINE_CHARS,
    cache: Path | None = None,
) -> torch.Tensor:
    """``packing.packed_rows`` of the deduplicated text: (n_rows, seq_len) int64, cached as .npy."""
    vocab = hashlib.sha256(json.dumps(tokenizer.vocab, sort_keys=True).encode()).hexdigest()
    spec = dict(c=list(corpora), split=split, t=seq_len, m=max_chars, vocab=vocab, dedup=min_line_chars, v=1)
    name = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    path = (cache or cache_dir() / "packing") / f"dedup-rows-{split}-{name}.npy"
    if path.is_file():
        return torch.from_numpy(np.load(path, allow_pickle=False).astype(np.int64))
    kept, _ = _kept(corpora, split, max_chars, min_line_chars)
    ids = [tokenizer.encode(d, add_special_tokens=False) for d in kept]
    rows = pack(ids, seq_len, tokenizer.vocab["[CLS]"], tokenizer.vocab["[SEP]"])  # (n_rows, seq_len)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, rows.numpy().astype(np.int32 if tokenizer.vocab_size >= 2**15 else np.int16))
    tmp.replace(path)  # atomic: a killed run leaves no half-written file
    return rows
