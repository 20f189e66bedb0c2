"""Raw text -> a WordPiece vocabulary -> packed rows of token ids -> masked-LM batches.

The data side of BERT pretraining (Devlin et al. 2019, sec. 3.1 and appendix A.1) as Cramming runs
it (Geiping & Goldstein 2022, sec. 4.4): every step of the preparation happens once, before the
clock starts, and is cached under ``cache_dir()/packing``.

1. ``train_tokenizer``: a WordPiece vocabulary learnt from a sample of the corpora.
2. ``pack``: all documents encoded, joined into one stream with ``[SEP]`` after each document, and
   cut into rows of exactly ``seq_len`` tokens, each opening with ``[CLS]``. No row is padded, so no
   compute is spent on ``[PAD]``; a row may hold the end of one document and the start of the next
   (RoBERTa's "FULL-SENTENCES", Liu et al. 2019, sec. 4.2).
3. ``mask_tokens``: choose ``rate`` of the ordinary tokens; of those, ``mask`` become ``[MASK]``,
   ``random`` become a random token, the rest stay as they are (BERT's 80/10/10). The labels are the
   original ids at the chosen positions and -100 (ignored by the loss) everywhere else.
4. ``MLMBatches``: ``batches(i)`` is the i-th micro-batch, drawn and masked with a generator seeded
   by (seed, i), so a resumed run sees exactly the batches an uninterrupted one would ("dynamic
   masking": every epoch masks a row afresh, Liu et al. 2019, sec. 4.1).

Left out: sentence-pair inputs and next-sentence prediction, whole-word masking, deduplication and
filtering of the corpus (Cramming sec. 4.4 sorts and filters its data; ours is small and clean).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..tokenizers import WordPieceTokenizer
from .cache import cache_dir
from .corpora import load_documents

__all__ = ["train_tokenizer", "read_documents", "pack", "packed_rows", "mask_tokens", "MLMBatches"]

_FORMAT = "v1"  # bump when the packing changes, so that stale cached rows are not reused


def _key(**fields) -> str:
    return hashlib.sha256(json.dumps({"format": _FORMAT, **fields}, sort_keys=True).encode()).hexdigest()[:16]


def read_documents(corpora: Sequence[str], split: str, max_chars: int | None) -> list[str]:
    """Documents of each corpus in turn; with ``max_chars``, at most that many characters per corpus."""
    if not corpora:
        raise ValueError("name at least one corpus")
    documents = []
    for name in corpora:
        budget = max_chars if max_chars is not None else float("inf")
        for doc in load_documents(name, split):
            if budget <= 0:
                break
            documents.append(doc[: int(min(len(doc), budget))])
            budget -= len(documents[-1])
    return documents


def train_tokenizer(
    corpora: Sequence[str],
    vocab_size: int,
    sample_chars: int = 400_000,
    cache: Path | None = None,
    progress: bool = False,
) -> WordPieceTokenizer:
    """A WordPiece tokenizer trained on the first ``sample_chars`` of each corpus's train split (cached)."""
    path = (cache or cache_dir() / "packing") / f"wordpiece-{_key(c=list(corpora), v=vocab_size, s=sample_chars)}.json"
    if path.is_file():
        return WordPieceTokenizer.load(path)
    text = "\n\n".join(read_documents(corpora, "train", sample_chars))
    tokenizer = WordPieceTokenizer().train(text, vocab_size, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(path)
    return tokenizer


def pack(documents: Sequence[list[int]], seq_len: int, cls_id: int, sep_id: int) -> torch.Tensor:
    """Documents of ids (no specials) -> (n_rows, seq_len): [CLS] + seq_len-1 tokens of the stream.

    The stream is doc_0 [SEP] doc_1 [SEP] ...; its tail that does not fill a row is dropped.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 ([CLS] and one token), got {seq_len}")
    stream = np.fromiter((t for doc in documents for t in (*doc, sep_id)), dtype=np.int64)
    body = seq_len - 1
    n_rows = len(stream) // body
    rows = stream[: n_rows * body].reshape(n_rows, body)  # (n_rows, seq_len - 1)
    cls = np.full((n_rows, 1), cls_id, dtype=np.int64)
    return torch.from_numpy(np.concatenate([cls, rows], axis=1))  # (n_rows, seq_len)


def packed_rows(
    tokenizer: WordPieceTokenizer,
    corpora: Sequence[str],
    split: str,
    seq_len: int = 128,
    max_chars: int | None = None,
    cache: Path | None = None,
    progress: bool = True,
) -> torch.Tensor:
    """(n_rows, seq_len) int64 rows of ``split`` of the corpora, packed with ``pack`` (cached as .npy)."""
    vocab_hash = hashlib.sha256(json.dumps(tokenizer.vocab, sort_keys=True).encode()).hexdigest()
    key = _key(c=list(corpora), split=split, t=seq_len, m=max_chars, vocab=vocab_hash)
    path = (cache or cache_dir() / "packing") / f"rows-{split}-{key}.npy"
    if path.is_file():
        return torch.from_numpy(np.load(path, allow_pickle=False).astype(np.int64))
    documents = read_documents(corpora, split, max_chars)
    ids = [
        tokenizer.encode(d, add_special_tokens=False)
        for d in tqdm(documents, desc=f"tokenize {split}", unit="doc", disable=not progress)
    ]
    rows = pack(ids, seq_len, tokenizer.vocab["[CLS]"], tokenizer.vocab["[SEP]"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, rows.numpy().astype(np.int32 if tokenizer.vocab_size >= 2**15 else np.int16))
    tmp.replace(path)  # atomic: a killed run leaves no half-written cache file
    return rows


def mask_tokens(
    ids: torch.Tensor,
    rate: float,
    mask_id: int,
    vocab_size: int,
    special_ids: Sequence[int],
    generator: torch.Generator,
    mask: float = 0.8,
    random: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, T) -> (inputs, labels): BERT's masking; labels are -100 where nothing is predicted."""
    if not 0 < rate < 1:
        raise ValueError(f"the masking rate must be in (0, 1), got {rate}")
    if mask < 0 or random < 0 or mask + random > 1:
        raise ValueError(f"mask={mask} and random={random} must be non-negative and sum to at most 1")
    special = torch.isin(ids, torch.tensor(list(special_ids), device=ids.device))  # (B, T)
    chosen = (torch.rand(ids.shape, generator=generator) < rate).to(ids.device) & ~special  # (B, T)
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    draw = torch.rand(ids.shape, generator=generator).to(ids.device)  # one draw decides mask/random/keep
    to_mask = chosen & (draw < mask)
    to_random = chosen & (draw >= mask) & (draw < mask + random)
    randoms = torch.randint(vocab_size, ids.shape, generator=generator).to(ids.device)
    inputs = torch.where(to_mask, torch.full_like(ids, mask_id), ids)
    inputs = torch.where(to_random, randoms, inputs)
    return inputs, labels


@dataclass
class MLMBatches:
    """``batches(i)`` -> {"input_ids", "labels"}: the i-th micro-batch, the same on every call.

    Rows are visited in a fresh random order each epoch; each row is masked anew each time.
    """

    rows: torch.Tensor  # (n_rows, seq_len)
    batch_size: int
    tokenizer: WordPieceTokenizer
    rate: float = 0.15
    mask: float = 0.8
    random: float = 0.1
    seed: int = 0

    def __post_init__(self):
        if self.rows.dim() != 2:
            raise ValueError(f"rows must be (n_rows, seq_len), got shape {tuple(self.rows.shape)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if len(self.rows) < self.batch_size:
            raise ValueError(
                f"the corpus is too small for one batch: {len(self.rows)} rows of {self.rows.shape[1]} "
                f"tokens, batch size {self.batch_size}; use more text or a smaller batch"
            )
        self.per_epoch = len(self.rows) // self.batch_size  # the last incomplete batch of an epoch is dropped
        v = self.tokenizer.vocab
        self.special_ids = [v[t] for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]") if t in v]
        self._order_epoch, self._order = -1, None

    def __call__(self, i: int) -> dict[str, torch.Tensor]:
        epoch, index = divmod(i, self.per_epoch)
        if epoch != self._order_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order, self._order_epoch = torch.randperm(len(self.rows), generator=g), epoch
        ids = self.rows[self._order[index * self.batch_size : (index + 1) * self.batch_size]]  # (B, T)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * i + 1)
        inputs, labels = mask_tokens(
            ids,
            self.rate,
            self.tokenizer.vocab["[MASK]"],
            self.tokenizer.vocab_size,
            self.special_ids,
            g,
            self.mask,
            self.random,
        )
        return {"input_ids": inputs, "labels": labels}
