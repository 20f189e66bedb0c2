"""Product quantization (Jegou, Douze & Schmid 2011, "Product quantization for nearest neighbor search").

Cut each d-dimensional vector into M sub-vectors of d/M dimensions and quantize each sub-vector with
its own k-means codebook of 2^nbits centroids. A vector becomes M small integers (its code):

    x = [x_1 | x_2 | ... | x_M]   ->   code = (c_1, ..., c_M),  c_j = argmin_c ||x_j - C_j[c]||^2
    bytes per vector: M * nbits / 8   (float32 needs 4 d: d=64, M=8, nbits=8 is 32x smaller)

Asymmetric distance computation (ADC, §3.3 of the paper): the query is NOT quantized. One table
per query holds its distance (or inner product) to every centroid of every sub-space, (M, 2^nbits);
the approximate distance to a stored vector is then M table look-ups and adds:

    q . x_hat   = sum_j  T_ip[j, c_j]       T_ip[j, c] = q_j . C_j[c]
    ||q - x_hat||^2 = sum_j T_l2[j, c_j]    T_l2[j, c] = ||q_j - C_j[c]||^2

Left out: packing the codes in memory (we keep one uint8 per sub-vector; ``code_bytes``, and so
``IVFIndex.nbytes``, count the packed size FAISS stores), OPQ rotations, and polysemous codes.
"""

from __future__ import annotations

import torch

from .exact import METRICS, as_matrix, check_vectors
from .kmeans import assign, kmeans

__all__ = ["ProductQuantizer"]


class ProductQuantizer:
    def __init__(self, d: int, M: int, nbits: int = 8):
        if not isinstance(M, int) or M < 1 or d % M:
            raise ValueError(f"M={M!r} sub-quantizers must be a positive int that divides d={d}")
        if not isinstance(nbits, int) or not 1 <= nbits <= 8:
            raise ValueError(f"nbits must be an int from 1 to 8 (one uint8 per sub-code), got {nbits!r}")
        self.d, self.M, self.nbits = d, M, nbits
        self.dsub, self.ksub = d // M, 2**nbits
        self.codebooks: torch.Tensor | None = None  # (M, ksub, dsub) once trained

    @property
    def is_trained(self) -> bool:
        return self.codebooks is not None

    def code_bytes(self) -> int:
        """Bytes of one packed code: M * nbits / 8, rounded up to whole bytes (FAISS's ``code_size``)."""
        return -(-self.M * self.nbits // 8)

    def _check_trained(self) -> None:
        if not self.is_trained:
            raise RuntimeError("the product quantizer is not trained: call train(x) first")

    def train(self, x, n_iter: int = 10, seed: int = 0) -> None:
        x = check_vectors(as_matrix(x, "training vectors"), self.d, "training vectors")
        if x.shape[0] < self.ksub:
            raise ValueError(f"training PQ with 2^{self.nbits}={self.ksub} centroids needs >= {self.ksub} vectors")
        subs = x.view(-1, self.M, self.dsub)  # (n, M, dsub)
        self.codebooks = torch.stack(
            [kmeans(subs[:, j], self.ksub, n_iter=n_iter, seed=seed + j) for j in range(self.M)]
        )  # (M, ksub, dsub)

    @torch.no_grad()
    def encode(self, x) -> torch.Tensor:
        """(n, M) uint8 codes: the nearest centroid of each sub-vector."""
        self._check_trained()
        subs = check_vectors(x, self.d).view(-1, self.M, self.dsub)  # (n, M, dsub)
        codes = [assign(subs[:, j], self.codebooks[j]) for j in range(self.M)]
        return torch.stack(codes, dim=1).to(torch.uint8)  # (n, M)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(n, d) reconstructions: the concatenated centroids."""
        self._check_trained()
        idx = codes.long()  # (n, M)
        parts = self.codebooks[torch.arange(self.M), idx]  # (n, M, dsub)
        return parts.reshape(-1, self.d)

    def distance_tables(self, q: torch.Tensor, metric: str = "l2") -> torch.Tensor:
        """ADC tables (nq, M, ksub): q_j . C_j[c] ("ip") or ||q_j - C_j[c]||^2 ("l2")."""
        self._check_trained()
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        qs = check_vectors(q, self.d, "queries").view(-1, self.M, 1, self.dsub)  # (nq, M, 1, dsub)
        if metric == "ip":
            return (qs * self.codebooks).sum(-1)  # (nq, M, ksub)
        return ((qs - self.codebooks) ** 2).sum(-1)  # (nq, M, ksub)

    @staticmethod
    def adc(tables: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """(nq, n) approximate scores: sum over sub-spaces j of table[q, j, code[x, j]]."""
        idx = codes.long()  # (n, M)
        out = tables[:, 0, idx[:, 0]]  # (nq, n): one look-up per stored vector and query
        for j in range(1, idx.shape[1]):
            out += tables[:, j, idx[:, j]]
        return out
