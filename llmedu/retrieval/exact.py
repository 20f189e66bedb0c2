"""Exact nearest-neighbour search: score every stored vector, keep the k best.

    inner product ("ip"):  s(q, x) = q . x                     larger is nearer
    squared L2   ("l2"):   d(q, x) = ||q||^2 - 2 q . x + ||x||^2  smaller is nearer

Both are one matmul ``Q X^T`` (nq, n) plus a top-k, which is what FAISS's ``IndexFlatIP`` and
``IndexFlatL2`` do (Johnson, Douze & Jegou 2019, "Billion-scale similarity search with GPUs", §3).
The cost is n * d multiply-adds per query: exact search is the oracle of every approximate index
here, and the baseline that IVF and PQ exist to beat. Queries go in blocks so that the (block, n)
score matrix stays small whatever n is.

The checks every index shares (a 2-D float matrix of the right width and finite values, 1 <= k <= stored vectors)
live here as ``check_vectors`` and ``check_k``.

Left out: FAISS's BLAS/SIMD kernels and its heap-based top-k for small k; removal by id.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["FlatIndex", "METRICS", "as_matrix", "check_vectors", "check_k", "recall_at_k"]

METRICS = ("ip", "l2")


def as_matrix(x, name: str = "vectors") -> torch.Tensor:
    """A float32 (n, d) tensor from a tensor or NumPy array, or a clear error."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D (n, d) matrix, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {x.dtype}")
    return x.detach().to(torch.float32).contiguous()


def check_vectors(x, d: int, name: str = "vectors") -> torch.Tensor:
    """``as_matrix`` plus: the width must be the index's dimension ``d``."""
    x = as_matrix(x, name)
    if x.shape[1] != d:
        raise ValueError(f"dimension mismatch: the index holds {d}-dimensional vectors, {name} have {x.shape[1]}")
    bad = ~torch.isfinite(x).all(dim=1)  # (n,): a NaN scores above every real vector in a top-k, inf too
    if bad.any():
        raise ValueError(
            f"{name} hold NaN or inf in {int(bad.sum())} of {len(x)} rows (the first is row {int(bad.nonzero()[0])}): "
            "such a vector would be the nearest (or farthest) of every query; drop or fix those rows first"
        )
    return x


def check_k(k: int, ntotal: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if k > ntotal:
        raise ValueError(f"k={k} is larger than the index, which holds {ntotal} vectors")
    return k


def _topk(scores: torch.Tensor, k: int, metric: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best columns of each row: largest scores for "ip", smallest distances for "l2"."""
    return scores.topk(k, dim=1, largest=metric == "ip", sorted=True)


class FlatIndex:
    """Stores the vectors as they are; ``search`` compares the query with every one of them."""

    def __init__(self, d: int, metric: str = "ip", block: int = 256):
        if not isinstance(d, int) or d < 1:
            raise ValueError(f"d must be a positive int, got {d!r}")
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block (queries scored at once) must be a positive int, got {block!r}")
        self.d, self.metric, self.block = d, metric, block
        self.vectors = torch.empty(0, d)  # (n, d)
        self.norms = torch.empty(0)  # (n,) squared norms, for l2

    @property
    def ntotal(self) -> int:
        return self.vectors.shape[0]

    def nbytes(self) -> int:
        """Bytes of the stored vectors (4 per float): the memory that IVF-PQ compresses."""
        return self.vectors.numel() * 4

    def add(self, x) -> None:
        x = check_vectors(x, self.d)
        self.vectors = torch.cat([self.vectors, x])
        self.norms = torch.cat([self.norms, (x * x).sum(1)])

    def reset(self) -> None:
        self.vectors, self.norms = torch.empty(0, self.d), torch.empty(0)

    def scores(self, q: torch.Tensor) -> torch.Tensor:
        """(nq, n): inner products, or squared L2 distances."""
        dots = q @ self.vectors.T  # (nq, n)
        if self.metric == "ip":
            return dots
        return ((q * q).sum(1, keepdim=True) - 2 * dots + self.norms).clamp_min(0)

    @torch.no_grad()
    def search(self, queries, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores or distances, ids), each (nq, k), best first."""
        q = check_vectors(queries, self.d, "queries")
        check_k(k, self.ntotal)
        out = [_topk(self.scores(q[i : i + self.block]), k, self.metric) for i in range(0, len(q), self.block)]
        return torch.cat([s for s, _ in out]), torch.cat([i for _, i in out])


def recall_at_k(found: torch.Tensor, true: torch.Tensor) -> float:
    """Mean fraction of each row of ``true`` ids (nq, k) that appears in the same row of ``found``."""
    found, true = torch.as_tensor(found), torch.as_tensor(true)
    if found.shape[0] != true.shape[0]:
        raise ValueError(f"found has {found.shape[0]} rows, true has {true.shape[0]}")
    hits = (true.unsqueeze(2) == found.unsqueeze(1)).any(2)  # (nq, k_true)
    return hits.float().mean().item()
