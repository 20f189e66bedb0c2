"""A datastore of text chunks for retrieval: bytes as tokens, chunk + continuation as the value,
a frozen bag-of-words embedding as the key (RETRO, Borgeaud et al. 2022, §2.1-2.3, at course scale).

Every document is cut into chunks of ``m`` byte tokens. Entry j of a document stores

    key   = embed(chunk j)                       (used to find it)
    value = tokens of chunk j and chunk j + 1    (2m tokens: what the model is shown, RETRO's [N, F])

RETRO's keys are the mean of frozen BERT activations; ours are a frozen, training-free embedding:
the chunk's words, hashed into ``buckets`` slots, weighted by tf-idf (idf fitted once on the
first documents added), projected to ``dim`` dimensions by a fixed random Gaussian matrix
(Johnson-Lindenstrauss: inner products are kept approximately) and normalised. Two chunks that share
rare words get a high inner product. Any index of ``llmedu.retrieval`` holds the keys.

Adding documents later just adds entries: knowledge changes without a gradient step.
Left out: RETRO's chunk-level deduplication against the evaluation set, BERT keys, SCaNN.
"""

from __future__ import annotations

import math
import re
import zlib

import torch

from .exact import FlatIndex

__all__ = ["encode_bytes", "decode_bytes", "chunk_pairs", "BagOfWords", "ChunkStore"]

_WORD = re.compile(r"[a-z]+")


def encode_bytes(text: str) -> torch.Tensor:
    """UTF-8 bytes as token ids 0..255 (a 256-token vocabulary with no training)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode_bytes(ids: torch.Tensor) -> str:
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


def chunk_pairs(documents: list[str], m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 2m) byte tokens [c_j, c_(j+1)] for every pair of consecutive m-byte chunks, and (N,) document numbers.

    Consecutive rows overlap by m, so every byte after a document's first chunk is the second half of
    exactly one row."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"chunk length m must be a positive int (bytes per chunk), got {m!r}")
    values, docs = [], []
    for d, text in enumerate(documents):
        ids = encode_bytes(text)
        n = len(ids) // m - 1  # chunks that have a full next chunk
        if n > 0:
            values.append(ids[: (n + 1) * m].unfold(0, 2 * m, m))  # (n, 2m)
            docs.append(torch.full((n,), d))
    if not values:
        raise ValueError(f"no document is longer than two chunks of {m} bytes")
    return torch.cat(values), torch.cat(docs)


class BagOfWords:
    """Text -> (dim,) unit vector: hashed tf-idf of its lower-cased words, randomly projected."""

    def __init__(self, dim: int = 128, buckets: int = 1 << 14, seed: int = 0):
        self.dim, self.buckets = dim, buckets
        g = torch.Generator().manual_seed(seed)
        self.projection = torch.randn(buckets, dim, generator=g) / math.sqrt(dim)  # (buckets, dim)
        self.idf: torch.Tensor | None = None  # (buckets,)

    def _counts(self, texts: list[str]) -> torch.Tensor:
        """Sparse (n, buckets) word counts."""
        rows, cols = [], []
        for i, text in enumerate(texts):
            for word in _WORD.findall(text.lower()):
                rows.append(i)
                cols.append(zlib.crc32(word.encode()) % self.buckets)  # a stable hash, unlike hash()
        values = torch.ones(len(rows))
        shape = (len(texts), self.buckets)
        return torch.sparse_coo_tensor(torch.tensor([rows, cols]).view(2, -1), values, shape, check_invariants=False)

    def fit(self, texts: list[str]) -> None:
        """idf(w) = log(n / (1 + chunks containing w)), fitted once."""
        present = self._counts(texts).coalesce()
        df = torch.zeros(self.buckets).index_add_(0, present.indices()[1], torch.ones(present.values().shape))
        self.idf = torch.log(len(texts) / (1 + df)).clamp_min(0)

    def __call__(self, texts: list[str]) -> torch.Tensor:
        if self.idf is None:
            raise RuntimeError("the embedding has no idf yet: call fit(texts) first")
        counts = self._counts(texts).coalesce()
        tfidf = torch.sparse_coo_tensor(
            counts.indices(),
            counts.values().log1p() * self.idf[counts.indices()[1]],
            counts.shape,
            check_invariants=False,
        )
        x = torch.sparse.mm(tfidf, self.projection)  # (n, dim)
        return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


class ChunkStore:
    """Chunks of documents with their keys in an index; ``search`` returns their 2m-token values."""

    def __init__(self, m: int = 64, embedder: BagOfWords | None = None, index=None):
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"chunk length m must be a positive int, got {m!r}")
        self.m = m
        self.embedder = embedder or BagOfWords()
        self.index = index if index is not None else FlatIndex(self.embedder.dim, metric="ip")
        self.values = torch.empty(0, 2 * m, dtype=torch.uint8)  # (N, 2m) chunk + continuation
        self.doc_ids = torch.empty(0, dtype=torch.long)  # (N,) which document each entry came from

    def __len__(self) -> int:
        return len(self.values)

    def nbytes(self) -> int:
        """Index bytes plus the stored token bytes."""
        return self.index.nbytes() + self.values.numel()

    def chunk(self, documents: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, 2m) chunk + continuation tokens and (N,) document numbers: every full pair of chunks."""
        return chunk_pairs(documents, self.m)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Keys of the first m tokens of each row: (n, dim)."""
        return self.embedder([decode_bytes(row[: self.m]) for row in tokens])

    def add_documents(self, documents: list[str], doc_offset: int | None = None) -> None:
        values, docs = self.chunk(documents)
        if self.embedder.idf is None:
            self.embedder.fit([decode_bytes(v[: self.m]) for v in values])
        keys = self.embed(values)
        if hasattr(self.index, "is_trained") and not self.index.is_trained:
            self.index.train(keys)
        self.index.add(keys)
        offset = int(self.doc_ids.max()) + 1 if doc_offset is None and len(self.doc_ids) else (doc_offset or 0)
        self.values = torch.cat([self.values, values.to(torch.uint8)])
        self.doc_ids = torch.cat([self.doc_ids, docs + offset])

    def neighbour_ids(self, keys: torch.Tensor, k: int, exclude_docs: torch.Tensor | None = None) -> torch.Tensor:
        """(n, k) entry numbers of the nearest entries, best first; ``exclude_docs`` (n,) skips the entries of
        that document however many of the nearest they are. A slot with nothing to fill it is -1 (as in FAISS):
        the store holds fewer than k entries outside the document, or an IVF index's probed lists do."""
        n, depth = len(keys), min(k if exclude_docs is None else 5 * k, len(self))  # room for own-document hits
        if exclude_docs is not None and exclude_docs.shape != (n,):
            raise ValueError(f"exclude_docs must be one document number per key, (n,) = ({n},)")
        out = torch.full((n, k), -1, dtype=torch.long)  # (n, k)
        todo = torch.arange(n)  # the rows still searched for
        while len(todo):
            _, ids = self.index.search(keys[todo], depth)  # (r, depth), -1 where the index found nothing
            allowed = ids >= 0
            if exclude_docs is not None:
                allowed &= self.doc_ids[ids.clamp_min(0)] != exclude_docs[todo].unsqueeze(1)
            order = torch.sort((~allowed).int(), dim=1, stable=True).indices[:, :k]  # allowed hits first, ranks kept
            out[todo, : order.shape[1]] = torch.where(allowed.gather(1, order), ids.gather(1, order), -1)
            # too many hits excluded: search deeper, unless the store is exhausted or the index returned all it
            # can see (an IVF index's probed lists hold fewer than depth entries: deeper finds nothing more)
            short = (allowed.sum(1) < k) & (ids >= 0).all(1)
            if depth == len(self) or not short.any():
                break
            todo, depth = todo[short], min(2 * depth, len(self))
        return out

    def search(self, keys: torch.Tensor, k: int, exclude_docs: torch.Tensor | None = None) -> torch.Tensor:
        """(n, k, 2m) neighbour tokens, best first; ``exclude_docs`` (n,) skips entries of that document.

        Every key must find k neighbours: tokens have no "missing" value, and a made-up neighbour would be
        trained on as if retrieved. ``neighbour_ids`` shows which slots are empty (-1)."""
        ids = self.neighbour_ids(keys, k, exclude_docs)  # (n, k)
        missing = ids < 0
        if missing.any():
            row = int(missing.any(1).nonzero()[0])
            nprobe = getattr(self.index, "nprobe", None)
            hint = f"raise the IVF index's nprobe (now {nprobe}) or " if nprobe is not None else ""
            raise ValueError(
                f"{int(missing.any(1).sum())} of {len(ids)} keys found fewer than k={k} neighbours "
                f"{'outside their own document ' if exclude_docs is not None else ''}(the first is key {row}, "
                f"with {int((~missing[row]).sum())}): {hint}lower k, or add documents to the store"
            )
        return self.values[ids].long()  # (n, k, 2m)
