"""Synthetic embeddings shaped like real ones, for testing and benchmarking the indexes.

Real embeddings (sentence encoders, an LM's hidden states) are clustered and have a low intrinsic
dimension: they lie near a few-dimensional surface inside R^d. Isotropic Gaussian noise in all d
dimensions has neither, and is the worst case for IVF and PQ alike (every neighbour is about as
far as every other). So: ``n_clusters`` centres in a ``rank``-dimensional subspace, points spread
around them inside that subspace, a little noise in all d dimensions, rows scaled to unit norm
(so that inner product and cosine agree). Queries drawn with another seed are a held-out set:
never added to the index.
"""

from __future__ import annotations

import torch

__all__ = ["clustered_vectors"]


def clustered_vectors(
    n: int, d: int = 64, n_clusters: int = 100, rank: int = 16, noise: float = 0.05, seed: int = 0, data_seed: int = 0
) -> torch.Tensor:
    """(n, d) unit vectors; ``data_seed`` fixes the distribution, ``seed`` the draw from it."""
    if rank > d:
        raise ValueError(f"rank={rank} cannot exceed d={d}")
    shape = torch.Generator().manual_seed(data_seed)
    basis = torch.linalg.qr(torch.randn(d, rank, generator=shape)).Q  # (d, rank) orthonormal
    centres = torch.randn(n_clusters, rank, generator=shape)  # (C, rank)
    g = torch.Generator().manual_seed(1_000_003 + seed)
    z = centres[torch.randint(n_clusters, (n,), generator=g)] + 0.5 * torch.randn(n, rank, generator=g)
    x = z @ basis.T + noise * torch.randn(n, d, generator=g)  # (n, d)
    return x / x.norm(dim=1, keepdim=True)
