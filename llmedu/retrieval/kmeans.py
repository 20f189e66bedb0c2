"""k-means (Lloyd 1982): the coarse quantizer of IVF and the codebooks of PQ.

    repeat: assign each x to its nearest centroid;  move each centroid to the mean of its points

Each round can only lower the sum of squared distances, so it converges (to a local minimum).
Initialisation picks k distinct training points at random (FAISS's default; k-means++ is better
but slower). A cluster that loses all its points is re-seeded at a random training point so that
no centroid is wasted. FAISS also subsamples to 256 points per centroid, which we do too.

Left out: k-means++ initialisation, several restarts, and FAISS's splitting of large clusters.
"""

from __future__ import annotations

import torch

from .exact import as_matrix

__all__ = ["kmeans", "assign"]


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid (squared L2) for each row of x: (n,)."""
    # argmin ||x - c||^2 = argmin (||c||^2 - 2 x . c): ||x||^2 is the same for every c
    return ((centroids * centroids).sum(1) - 2 * x @ centroids.T).argmin(1)  # (n,)


@torch.no_grad()
def kmeans(x, k: int, n_iter: int = 10, seed: int = 0, max_points_per_centroid: int = 256) -> torch.Tensor:
    """(k, d) centroids of the rows of ``x`` (n, d)."""
    x = as_matrix(x, "training vectors")
    n = x.shape[0]
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if n < k:
        raise ValueError(f"k-means with {k} centroids needs at least {k} training vectors, got {n}")
    g = torch.Generator().manual_seed(seed)
    if n > k * max_points_per_centroid:  # subsample: more points barely move the centroids
        x = x[torch.randperm(n, generator=g)[: k * max_points_per_centroid]]
        n = x.shape[0]
    centroids = x[torch.randperm(n, generator=g)[:k]].clone()  # (k, d)
    for _ in range(n_iter):
        labels = assign(x, centroids)  # (n,)
        sums = torch.zeros_like(centroids).index_add_(0, labels, x)  # (k, d)
        counts = torch.bincount(labels, minlength=k)  # (k,)
        empty = counts == 0
        centroids = sums / counts.clamp_min(1).unsqueeze(1).to(x.dtype)
        if empty.any():
            centroids[empty] = x[torch.randint(n, (int(empty.sum()),), generator=g)]
    return centroids
