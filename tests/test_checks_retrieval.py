"""Lesson 24's graders pass a correct answer and fail the mistakes a learner is likely to make."""

import torch

from llmedu.checks.retrieval import check_ivf_search_cost, check_knn_interpolation, check_pq_code_bytes


def test_pq_code_bytes_grader():
    assert check_pq_code_bytes(lambda d, M, nbits: (M * nbits / 8, 4 * d / (M * nbits / 8)))
    assert not check_pq_code_bytes(lambda d, M, nbits: (M * nbits, 4 * d / (M * nbits)))  # bits, not bytes
    assert not check_pq_code_bytes(lambda d, M, nbits: (M * nbits / 8, d / (M * nbits / 8)))  # float32 is 4 bytes
    assert not check_pq_code_bytes(lambda d, M, nbits: 1 / 0)


def test_knn_interpolation_grader():
    assert check_knn_interpolation(
        lambda lm, knn, lam: torch.log(lam * knn.exp() + (1 - lam) * lm.exp())  # in probability space: right
    )
    assert not check_knn_interpolation(lambda lm, knn, lam: lam * knn + (1 - lam) * lm)  # mixes log-probs: the bug
    assert not check_knn_interpolation(lambda lm, knn, lam: torch.logaddexp(knn, lm))  # forgets the weights


def test_ivf_search_cost_grader():
    def right(n, d, nlist, nprobe):
        return nlist * d + nprobe * n / nlist * d

    assert check_ivf_search_cost(right, best_nlist=4096)
    assert check_ivf_search_cost(lambda n, d, nlist, nprobe: nlist * d + nprobe * (n // nlist) * d, best_nlist=4096)
    assert not check_ivf_search_cost(lambda n, d, nlist, nprobe: nprobe * n / nlist * d, 4096)  # no coarse search
    assert not check_ivf_search_cost(lambda n, d, nlist, nprobe: nlist * d + n / nlist * d, 4096)  # one list only
