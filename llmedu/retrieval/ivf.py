"""The inverted file (IVF): search only the few clusters nearest to the query.

Jegou, Douze & Schmid 2011 (§4, "IVFADC"); Johnson, Douze & Jegou 2019. A coarse quantizer (k-means
with ``nlist`` centroids) splits the stored vectors into ``nlist`` lists; a query visits the
``nprobe`` lists whose centroids are nearest to it and scores only their vectors:

    cost per query ~ nlist * d  (find the lists)  +  (nprobe / nlist) * n * d  (score their vectors)

The price is recall: a true neighbour that sits in a list the query does not visit is missed;
``nprobe = nlist`` visits every list and is exact again.

The lists hold either the vectors themselves (IVF-Flat) or their PQ codes (IVF-PQ). As in FAISS,
PQ encodes the residual r = x - c(x), the vector minus its list's centroid, which is smaller than x
and so quantized more finely; ADC then scores

    ip:  q . x_hat = q . c + sum_j T_ip(q)[j, code_j]            (one table per query)
    l2:  ||q - x_hat||^2 = sum_j T_l2(q - c)[j, code_j]          (one table per query and list)

Search runs list by list (as FAISS does): all queries that probe list l are scored against it in
one matmul (or one table gather), and each query's running top-k is merged with the new scores.

Lists are assigned by L2 to the centroids for both metrics (FAISS would use the inner product for
an IP quantizer). Left out: FAISS's precomputed L2 tables, re-ranking with the full vectors, and
removal by id.
"""

from __future__ import annotations

import torch

from .exact import METRICS, check_k, check_vectors
from .kmeans import assign, kmeans
from .pq import ProductQuantizer

__all__ = ["IVFIndex"]


class IVFIndex:
    """``IVFIndex(d, nlist)`` is IVF-Flat; ``IVFIndex(d, nlist, pq_M=8, pq_nbits=8)`` is IVF-PQ."""

    def __init__(self, d: int, nlist: int, metric: str = "ip", pq_M: int | None = None, pq_nbits: int = 8):
        if not isinstance(d, int) or d < 1:
            raise ValueError(f"d must be a positive int, got {d!r}")
        if not isinstance(nlist, int) or nlist < 1:
            raise ValueError(f"nlist must be a positive int, got {nlist!r}")
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        self.d, self.nlist, self.metric = d, nlist, metric
        self.pq = ProductQuantizer(d, pq_M, pq_nbits) if pq_M is not None else None
        self.centroids: torch.Tensor | None = None  # (nlist, d)
        self.nprobe = 1
        self.reset()

    def reset(self) -> None:
        """Empty the lists (the trained centroids and codebooks stay)."""
        width = self.pq.M if self.pq else self.d
        dtype = torch.uint8 if self.pq else torch.float32
        self.lists = [torch.empty(0, width, dtype=dtype) for _ in range(self.nlist)]  # vectors or codes
        self.list_ids = [torch.empty(0, dtype=torch.long) for _ in range(self.nlist)]
        self.ntotal = 0

    @property
    def is_trained(self) -> bool:
        return self.centroids is not None and (self.pq is None or self.pq.is_trained)

    def nbytes(self) -> int:
        """Bytes of the stored vectors: 4 d per float32 vector, or ``pq.code_bytes()`` per PQ code, packed as
        FAISS stores them (our lists keep one uint8 per sub-code in memory: M bytes, a simplification).
        Ids, centroids and codebooks not counted."""
        if self.pq is not None:
            return self.ntotal * self.pq.code_bytes()
        return sum(v.numel() * v.element_size() for v in self.lists)

    def train(self, x, n_iter: int = 10, seed: int = 0) -> None:
        x = check_vectors(x, self.d, "training vectors")
        self.centroids = kmeans(x, self.nlist, n_iter=n_iter, seed=seed)
        if self.pq is not None:
            residuals = x - self.centroids[assign(x, self.centroids)]  # (n, d)
            self.pq.train(residuals, n_iter=n_iter, seed=seed + 1)

    def _check_trained(self) -> None:
        if not self.is_trained:
            raise RuntimeError(
                "the IVF index is not trained: call train(x) on representative vectors before add/search"
            )

    @torch.no_grad()
    def add(self, x, ids: torch.Tensor | None = None) -> None:
        """Append vectors; their ids are 0, 1, 2, ... in order of addition unless given."""
        self._check_trained()
        x = check_vectors(x, self.d)
        if ids is None:
            ids = torch.arange(self.ntotal, self.ntotal + len(x))
        elif len(ids) != len(x):
            raise ValueError(f"{len(ids)} ids for {len(x)} vectors")
        labels = assign(x, self.centroids)  # (n,)
        stored = self.pq.encode(x - self.centroids[labels]) if self.pq else x
        for l in labels.unique().tolist():
            rows = labels == l
            self.lists[l] = torch.cat([self.lists[l], stored[rows]])
            self.list_ids[l] = torch.cat([self.list_ids[l], ids[rows]])
        self.ntotal += len(x)

    def _list_scores(self, l: int, q: torch.Tensor, tables: torch.Tensor | None) -> torch.Tensor:
        """(nq_l, len(list l)): the scores of the queries q that probe list l."""
        stored = self.lists[l]
        if self.pq is None:
            dots = q @ stored.T
            if self.metric == "ip":
                return dots
            return (q * q).sum(1, keepdim=True) - 2 * dots + (stored * stored).sum(1)
        if self.metric == "ip":  # q . c_l + ADC(q) on the residual codes
            return (q @ self.centroids[l]).unsqueeze(1) + ProductQuantizer.adc(tables, stored)
        return ProductQuantizer.adc(self.pq.distance_tables(q - self.centroids[l], "l2"), stored)

    @torch.no_grad()
    def search(self, queries, k: int, nprobe: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, ids), each (nq, k), best first; a slot that found nothing has id -1."""
        self._check_trained()
        q = check_vectors(queries, self.d, "queries")
        check_k(k, self.ntotal)
        nprobe = self.nprobe if nprobe is None else nprobe
        if not isinstance(nprobe, int) or not 1 <= nprobe <= self.nlist:
            raise ValueError(f"nprobe must be an int from 1 to nlist={self.nlist}, got {nprobe!r}")
        largest = self.metric == "ip"
        worst = float("-inf") if largest else float("inf")
        best_s = torch.full((len(q), k), worst)  # (nq, k) running top-k
        best_i = torch.full((len(q), k), -1, dtype=torch.long)
        c = self.centroids
        probes = ((c * c).sum(1) - 2 * q @ c.T).topk(nprobe, dim=1, largest=False).indices  # (nq, nprobe)
        tables = self.pq.distance_tables(q, "ip") if (self.pq and largest) else None  # (nq, M, ksub)
        for l in probes.unique().tolist():
            if len(self.list_ids[l]) == 0:
                continue
            rows = (probes == l).any(1).nonzero().squeeze(1)  # the queries that visit list l
            s = self._list_scores(l, q[rows], tables[rows] if tables is not None else None)  # (nq_l, len_l)
            ids = self.list_ids[l].expand(len(rows), -1)
            merged_s = torch.cat([best_s[rows], s], dim=1)
            merged_i = torch.cat([best_i[rows], ids], dim=1)
            top = merged_s.topk(k, dim=1, largest=largest)
            best_s[rows] = top.values
            best_i[rows] = merged_i.gather(1, top.indices)
        return best_s, best_i
