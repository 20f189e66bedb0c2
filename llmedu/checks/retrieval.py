"""Graders for lesson 24, retrieval.

check_pq_code_bytes(fn)        fn(d, M, nbits) -> (bytes of one packed PQ code, compression ratio against the
                               float32 vector): Jegou et al. 2011
check_pq_index_bytes(fn, best_m)
                               fn(n, M, nbits) -> bytes of an IVF-PQ index's codes and ids, each code packed into
                               whole bytes as FAISS's code_size, each id 8 bytes; best_m: the largest M of
                               M_OPTIONS at 8 bits whose index of 10^9 vectors fits in 64 GB (48)
check_knn_interpolation(fn)    fn(log_p_lm, log_p_knn, lam) -> log(lam p_kNN + (1 - lam) p_LM), kNN-LM's eq. 3
                               (Khandelwal et al. 2020), which must stay a distribution
check_ivf_search_cost(fn, best_nlist)
                               fn(n, d, nlist, nprobe) -> multiply-adds per query of IVF-Flat, lists of equal
                               size: the coarse search plus the probed lists; best_nlist: the nlist of 256, 1024,
                               4096 that minimises it for n = 10^6, d = 128, nprobe = 16 (4096)
"""

from __future__ import annotations

import torch

from llmedu.checks.core import CheckResult, Grader
from llmedu.retrieval.knn_lm import interpolate
from llmedu.retrieval.pq import ProductQuantizer

__all__ = ["check_pq_code_bytes", "check_pq_index_bytes", "check_knn_interpolation", "check_ivf_search_cost"]


def check_pq_code_bytes(fn) -> CheckResult:
    """Against ``ProductQuantizer.code_bytes`` and 4 d bytes per float32 vector."""
    g = Grader("check_pq_code_bytes")
    for d, M, nbits in [(64, 8, 8), (128, 16, 8), (768, 96, 8), (64, 16, 4), (96, 12, 6)]:
        code = ProductQuantizer(d, M, nbits).code_bytes()
        got = g.call(fn, d, M, nbits)
        g.compare(f"d={d}, M={M}, nbits={nbits}: (bytes, ratio)", got, (float(code), 4.0 * d / code), rtol=1e-9)
    return g.result()


ID_BYTES = 8  # FAISS keeps each vector's id as an int64 beside its code
BUDGET = {"n": 10**9, "nbits": 8, "bytes": 64e9}  # exercise 1's choice: the largest M that fits
M_OPTIONS = (32, 48, 64, 96)


def check_pq_index_bytes(fn, best_m=None) -> CheckResult:
    """n * (ceil(M * nbits / 8) + 8): the packed codes (``ProductQuantizer.code_bytes``, FAISS's code_size) and
    the ids; cases whose codes are not whole bytes fail M * nbits / 8. Then ``best_m`` must be the largest M of
    ``M_OPTIONS`` whose index fits ``BUDGET`` by the learner's own formula, and the right one."""
    g = Grader("check_pq_index_bytes")
    for n, d, M, nbits in [(1000, 64, 8, 8), (10**6, 128, 16, 8), (10**6, 40, 5, 6), (100, 96, 12, 6), (7, 30, 3, 5)]:
        expected = n * (ProductQuantizer(d, M, nbits).code_bytes() + ID_BYTES)
        got = g.call(fn, n, M, nbits)
        g.compare(f"n={n}, M={M}, nbits={nbits}: bytes of codes and ids", got, float(expected), rtol=1e-9)
    if g.failure is None:
        sizes = {M: g.call(fn, BUDGET["n"], M, BUDGET["nbits"]) for M in M_OPTIONS}
        fits = [M for M in M_OPTIONS if sizes[M] <= BUDGET["bytes"]]
        g.expect(
            f"best_m: the largest M of {M_OPTIONS} whose index of 10**9 vectors at 8 bits fits in 64 GB",
            bool(best_m in M_OPTIONS and fits and best_m == max(fits)),
            f"got {best_m!r}; by your formula: "
            + ", ".join(f"M {M}: {float(v) / 1e9:.0f} GB" for M, v in sizes.items()),
        )
    return g.result()


def check_knn_interpolation(fn) -> CheckResult:
    """Against ``llmedu.retrieval.knn_lm.interpolate``, and the result must sum to 1."""
    g = Grader("check_knn_interpolation")
    gen = torch.Generator().manual_seed(0)
    log_p_lm = torch.log_softmax(torch.randn(6, 11, generator=gen), -1)  # (N, V)
    p_knn = torch.zeros(6, 11)
    p_knn[:, :3] = torch.softmax(torch.randn(6, 3, generator=gen), -1)  # neighbours voted for 3 tokens only
    log_p_knn = p_knn.log()  # -inf elsewhere, as in a real kNN distribution
    for lam in (0.25, 0.5, 0.0, 0.9):
        got = g.call(fn, log_p_lm.clone(), log_p_knn.clone(), lam)
        if g.compare(f"lambda={lam}", got, interpolate(log_p_lm, log_p_knn, lam), atol=1e-5, rtol=1e-5):
            g.expect(
                f"lambda={lam}: exp of the result sums to 1",
                bool(torch.allclose(got.exp().sum(-1), torch.ones(6), atol=1e-5)),
            )
    return g.result()


CHOICE = {"n": 10**6, "d": 128, "nprobe": 16}  # exercise 3's choice: nlist of 256, 1024 or 4096
NLIST_OPTIONS = (256, 1024, 4096)


def check_ivf_search_cost(fn, best_nlist=None) -> CheckResult:
    """nlist * d (distances to every centroid) + nprobe * (n / nlist) * d (the vectors of the probed lists);
    then ``best_nlist``, the learner's choice for ``CHOICE``, must be the one their own formula makes cheapest
    and the right one (4096: about 1.02 M multiply-adds against 2.13 M at 1024 and 8.03 M at 256)."""
    g = Grader("check_ivf_search_cost")
    for n, d, nlist, nprobe in [
        (102_400, 64, 256, 8),  # every n divisible by nlist: the exercise's lists of equal size
        (1_048_576, 128, 1024, 16),
        (10_000, 32, 100, 100),
        (4096, 8, 64, 1),
    ]:
        expected = nlist * d + nprobe * (n / nlist) * d
        got = g.call(fn, n, d, nlist, nprobe)
        g.compare(f"n={n}, d={d}, nlist={nlist}, nprobe={nprobe}", got, float(expected), rtol=1e-9)
    costs = {nlist: g.call(fn, CHOICE["n"], CHOICE["d"], nlist, CHOICE["nprobe"]) for nlist in NLIST_OPTIONS}
    if g.failure is None:
        right = min(
            NLIST_OPTIONS, key=lambda nlist: nlist * CHOICE["d"] + CHOICE["nprobe"] * CHOICE["n"] / nlist * CHOICE["d"]
        )
        g.expect(
            f"best_nlist for n=10**6, d=128, nprobe=16: choose one of {NLIST_OPTIONS}",
            best_nlist in NLIST_OPTIONS,
            f"got {best_nlist!r}; set BEST_NLIST to the nlist your formula makes cheapest",
        )
        g.expect(
            "best_nlist is the nlist your formula makes cheapest",
            best_nlist == min(costs, key=costs.get) == right,
            f"got {best_nlist}; your costs: " + ", ".join(f"nlist {k}: {float(v):.3g}" for k, v in costs.items()),
        )
    return g.result()
