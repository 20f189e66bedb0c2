"""Lesson 24, exercise 3's choice: the nlist that minimises an IVF-Flat search of 10^6 vectors (d = 128, nprobe = 16)
is 4096 (about 1.02 M multiply-adds, against 2.13 M at 1024 and 8.03 M at 256); the grader asks for it."""

from llmedu.checks.retrieval import check_ivf_search_cost


def right(n, d, nlist, nprobe):
    return nlist * d + nprobe * n / nlist * d


def test_the_right_formula_and_choice_pass():
    assert check_ivf_search_cost(right, best_nlist=4096)


def test_a_missing_choice_fails():
    assert not check_ivf_search_cost(right)  # the cell's BEST_NLIST = None


def test_a_plausible_wrong_choice_fails():
    assert not check_ivf_search_cost(right, best_nlist=1024)  # the middle option: "balanced" lists
    assert not check_ivf_search_cost(right, best_nlist=256)  # fewest centroids, as if only the coarse term counted
    assert not check_ivf_search_cost(right, best_nlist=1000)  # sqrt(n): the folklore rule, not one of the options


def test_the_right_choice_with_a_wrong_formula_fails():
    # forgetting the coarse search makes the largest nlist cheapest too: the formula still fails
    assert not check_ivf_search_cost(lambda n, d, nlist, nprobe: nprobe * n / nlist * d, best_nlist=4096)


# Exercise 1: the bytes of an IVF-PQ index (packed codes and 8-byte ids), and the largest M that fits 64 GB.
def index_bytes(n, M, nbits):
    return n * (-(-M * nbits // 8) + 8)


def test_the_index_bytes_and_the_largest_fitting_m_pass():
    from llmedu.checks.retrieval import check_pq_index_bytes

    assert check_pq_index_bytes(index_bytes, best_m=48)  # 10^9 * (48 + 8) = 56 GB; M = 64 needs 72 GB


def test_index_bytes_that_forget_packing_ids_or_the_choice_fail():
    from llmedu.checks.retrieval import check_pq_index_bytes

    assert not check_pq_index_bytes(lambda n, M, nbits: n * (M * nbits / 8 + 8), best_m=48)  # fractional bytes
    assert not check_pq_index_bytes(lambda n, M, nbits: n * -(-M * nbits // 8), best_m=64)  # ids forgotten
    assert not check_pq_index_bytes(index_bytes, best_m=64)  # the codes alone would fit: ids count too
    assert not check_pq_index_bytes(index_bytes)  # no choice made
