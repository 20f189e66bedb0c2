"""The pretraining data, prepared in one step before the clock starts: a tokenizer, packed rows, counts.

    data = prepare_data(crammed(), CORPORA, max_chars=100_000, dedup=True)
    data.tokenizer, data.train, data.validation  # (n_rows, seq_len) int64 rows each
    data.dedup  # what deduplication removed from each split (None without it)

The rules of the game (Geiping & Goldstein 2022, sec. 2): the tokenizer and the packing happen before
the budget's clock starts. ``prepare_data`` learns the WordPiece vocabulary (``data.packing``), reads
each split, optionally deduplicates it, packs it into rows as long as the model's positions, and caches
the rows (with the deduplication's counts beside them), so a second run, a resume or a study reads them
back in seconds. The validation split holds out a tenth of ``max_chars`` (``held_out_chars``).

Deduplication: exact duplicate documents and repeated lines, counted. Repeated text is read more than
once per pass, so it costs budget and teaches the model to recite
(Lee et al. 2022, "Deduplicating Training Data Makes Language Models Better", sec. 4-5: exact and
near duplicates in C4 and the Pile; Rae et al. 2021, Gopher, appendix A.1.1, drop documents with
many repeated lines). Cramming (sec. 4.4) deduplicates its Pile slice before the clock starts; so
does this, as part of the data preparation, outside the budget.

Two rules, in this order, over all corpora together (so a copy in another corpus counts):

1. a document whose text, with runs of white space squeezed, equals an earlier one is dropped;
2. a line of at least ``min_line_chars`` characters (stripped) that appeared earlier is dropped.
   Short lines are kept: a speaker's name ("HAMLET:") or "Amen." repeat by nature, not by copying.
   A document left with no line is dropped too.

The validation split is deduplicated against the train split as well (``against``: the train split's
first ``held_out_chars`` characters of each corpus): a held-out loss measured on text the model trained
on would flatter it.

Left out: near duplicates (MinHash, suffix arrays: Lee et al.'s other two methods), and filtering
by quality. The WordPiece vocabulary is learnt from the raw text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..data.cache import cache_dir
from ..data.packing import pack, packed_rows, read_documents, train_tokenizer
from ..tokenizers import WordPieceTokenizer
from .recipe import Recipe

__all__ = ["CORPORA", "PretrainData", "prepare_data", "packed_data", "held_out_chars", "deduplicate", "MIN_LINE_CHARS"]

CORPORA = ("wikipedia", "shakespeare", "kjv", "speeches", "tweets", "vader")
MIN_LINE_CHARS = 30  # shorter lines may repeat: names, "Amen.", stage directions


class PretrainData(NamedTuple):
    """What a run trains and is measured on: the data preparation's one result."""

    tokenizer: WordPieceTokenizer
    train: torch.Tensor  # (n_rows, seq_len) int64: the packed training rows
    validation: torch.Tensor  # (n_rows, seq_len) int64: the held-out rows
    dedup: dict | None  # {"train": counts, "validation": counts} of ``deduplicate``; None without it

    @property
    def corpus_tokens(self) -> int:
        """The training split's packed token positions: what one pass over the data reads."""
        return self.train.numel()


def held_out_chars(max_chars: int | None, seq_len: int) -> int | None:
    """Characters of each corpus's validation split that a run holds out: a tenth of ``max_chars``, at least
    20 rows' worth; all of it when ``max_chars`` is None."""
    return None if max_chars is None else max(max_chars // 10, 20 * seq_len)


def prepare_data(
    recipe: Recipe,
    corpora: Sequence[str] = CORPORA,
    max_chars: int | None = None,
    tokenizer_chars: int = 400_000,
    progress: bool = True,
    dedup: bool = False,
) -> PretrainData:
    """The work done before the clock starts: the tokenizer learnt, then ``packed_data`` (all cached)."""
    if progress:
        print(
            f"Preparing the data; the budget clock has not started. A WordPiece vocabulary of "
            f"{recipe.model.vocab_size} from {', '.join(corpora)}, then the text packed into rows "
            f"(both cached: a minute or two the first time, seconds after).",
            flush=True,
        )
    tokenizer = train_tokenizer(corpora, recipe.model.vocab_size, sample_chars=tokenizer_chars, progress=progress)
    return packed_data(tokenizer, corpora, recipe.model.max_seq_len, max_chars, dedup, progress)


def packed_data(
    tokenizer: WordPieceTokenizer,
    corpora: Sequence[str],
    seq_len: int,
    max_chars: int | None = None,
    dedup: bool = False,
    progress: bool = False,
) -> PretrainData:
    """The train and held-out rows of the corpora with a given tokenizer (a saved run's, or one just learnt)."""
    val_chars = held_out_chars(max_chars, seq_len)
    if not dedup:
        train = packed_rows(tokenizer, corpora, "train", seq_len, max_chars, progress=progress)
        validation = packed_rows(tokenizer, corpora, "validation", seq_len, val_chars, progress=progress)
        return PretrainData(tokenizer, train, validation, None)
    train, train_counts = deduplicated_rows(tokenizer, corpora, "train", seq_len, max_chars)
    validation, val_counts = deduplicated_rows(tokenizer, corpora, "validation", seq_len, val_chars)
    return PretrainData(tokenizer, train, validation, {"train": train_counts, "validation": val_counts})


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


def deduplicated_rows(
    tokenizer: WordPieceTokenizer,
    corpora: Sequence[str],
    split: str,
    seq_len: int,
    max_chars: int | None = None,
    min_line_chars: int = MIN_LINE_CHARS,
    cache: Path | None = None,
) -> tuple[torch.Tensor, dict]:
    """(rows, counts): ``packing.packed_rows`` of the deduplicated text, (n_rows, seq_len) int64, and what
    ``deduplicate`` removed; both cached (.npy and .json), so the text is read once."""
    vocab = hashlib.sha256(json.dumps(tokenizer.vocab, sort_keys=True).encode()).hexdigest()
    spec = dict(c=list(corpora), split=split, t=seq_len, m=max_chars, vocab=vocab, dedup=min_line_chars, v=1)
    name = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    path = (cache or cache_dir() / "packing") / f"dedup-rows-{split}-{name}.npy"
    counts_path = path.with_suffix(".counts.json")
    if path.is_file() and counts_path.is_file():
        rows = torch.from_numpy(np.load(path, allow_pickle=False).astype(np.int64))
        return rows, json.loads(counts_path.read_text())
    documents = read_documents(corpora, split, max_chars)
    against = read_documents(corpora, "train", max_chars) if split != "train" else ()
    kept, counts = deduplicate(documents, min_line_chars, against)
    ids = [tokenizer.encode(d, add_special_tokens=False) for d in kept]
    rows = pack(ids, seq_len, tokenizer.vocab["[CLS]"], tokenizer.vocab["[SEP]"])  # (n_rows, seq_len)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = counts_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(counts))
    tmp.replace(counts_path)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, rows.numpy().astype(np.int32 if tokenizer.vocab_size >= 2**15 else np.int16))
    tmp.replace(path)  # atomic, and last: a killed run leaves no half-written file, no rows without counts
    return rows, counts
