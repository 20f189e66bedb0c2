"""The knowledge update (kNN-LM datastore grown, no gradient step), n-gram coverage and search FLOPs."""

import math

import pytest
import torch

from llmedu.models import CausalLM, TransformerConfig
from llmedu.retrieval import FlatIndex
from llmedu.retrieval.datastore import chunk_pairs
from llmedu.retrieval.knn_lm import KNNLM, build_datastore
from llmedu.retrieval.knowledge import (
    knn_lm_losses,
    knowledge_update,
    lm_loss,
    ngram_coverage,
    search_flops,
    size_to_reach,
)

pytestmark = pytest.mark.usefixtures("one_thread")

M = 16


def words(seed, n):
    g = torch.Generator().manual_seed(seed)
    return ["".join(chr(97 + int(c)) for c in torch.randint(26, (6,), generator=g)) for _ in range(n)]


def corpus(vocab, n_docs, n_words, seed):
    """Documents of words drawn from ``vocab``: corpus A and corpus B use different vocabularies."""
    g = torch.Generator().manual_seed(seed)
    return [" ".join(vocab[i] for i in torch.randint(len(vocab), (n_words,), generator=g)) for _ in range(n_docs)]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.gpt2(vocab_size=256, d_model=32, n_layers=2, n_heads=2, max_seq_len=64))
    a = corpus(words(0, 300), 4, 120, seed=1)  # the datastore before: one "language"
    b_vocab = words(1, 40)  # corpus B: few words, so its documents share them, as articles share names
    b_other, b_eval = corpus(b_vocab, 4, 120, seed=2), corpus(b_vocab, 2, 60, seed=3)
    return model, a, b_other, b_eval


def test_knowledge_update_lowers_the_loss_and_is_deterministic(setup):
    model, a, b_other, b_eval = setup
    weights = [p.clone() for p in model.parameters()]
    first = knowledge_update(model, a, b_other, b_eval, m=M, lams=(0.0, 0.25, 0.5))
    second = knowledge_update(model, a, b_other, b_eval, m=M, lams=(0.0, 0.25, 0.5))
    assert first == second  # bit for bit: exact search, no randomness
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))  # no gradient step
    assert first.before[0] == first.after[0]  # lambda 0 is the LM alone, whatever the datastore
    # random text of another vocabulary: A's neighbours do not help; B's other documents do, by a margin
    # far above float noise (each of the 14 B-words continues as it did in the added documents)
    assert first.after[1] < first.before[1] - 0.3 and first.after[2] < first.before[2] - 0.3
    assert first.after[1] < first.lm_alone - 0.3
    assert first.coverage_after > first.coverage_before + 0.3
    assert first.keys_after > first.keys_before and first.n_eval == len(chunk_pairs(b_eval, M)[0]) * M


def test_knn_lm_losses_at_lambda_zero_is_the_lm(setup):
    model, a, _, b_eval = setup
    rows, _ = chunk_pairs(a, M)
    keys, values = build_datastore(model, rows, last=M)
    index = FlatIndex(32, metric="l2")
    index.add(keys)
    val, _ = chunk_pairs(b_eval, M)
    loss0 = knn_lm_losses(model, index, values, val, M, [0.0, 0.5], k=4)
    # fp32 logits summed over ~200 bytes in another order: 1e-5 relative
    assert loss0[0] == pytest.approx(lm_loss(model, val, M), rel=1e-5)
    loss_own = knn_lm_losses(model, index, values, rows, M, [0.0, 0.5], k=4)
    assert loss_own[1] < loss_own[0] - 0.3  # text the datastore holds: each context finds itself
    # the last-positions search gives what the full search gives on those positions
    knn = KNNLM(model, index, values, k=4)
    full = knn.lm_and_knn(val[:3, :-1])
    part = knn.lm_and_knn(val[:3, :-1], last=M)
    torch.testing.assert_close(part[0], full[0][:, -M:])  # same hidden states, same ops: 1e-5
    torch.testing.assert_close(part[1], full[1][:, -M:])


def test_ngram_coverage_counts_exactly():
    store = torch.tensor([[1, 2, 3, 4, 5, 6]])
    rows = torch.tensor([[9, 1, 2, 3, 9, 4, 5]])
    # trigrams ending at each of the last 3 bytes: (2,3,9), (3,9,4), (9,4,5): none is in the store
    assert ngram_coverage(rows, store, n=3, last=3) == 0.0
    assert ngram_coverage(rows, store, n=2, last=6) == 0.5  # 91 no, 12 yes, 23 yes, 39 no, 94 no, 45 yes
    assert ngram_coverage(rows, store, n=1) == pytest.approx(5 / 7)  # every byte but the two 9s
    big = torch.randint(0, 256, (5, 40), generator=torch.Generator().manual_seed(0))
    assert ngram_coverage(big, big, n=8, last=20) == 1.0  # every n-gram of a text is in that text
    with pytest.raises(ValueError, match="n must be from 1 to 8"):
        ngram_coverage(rows, store, n=9)
    with pytest.raises(ValueError, match="last"):
        ngram_coverage(rows, store, n=3, last=6)
    with pytest.raises(ValueError, match="0..255"):
        ngram_coverage(rows + 300, store, n=2)


def test_search_flops_is_a_count():
    assert search_flops(1000, 64) == 2 * 1000 * 64
    assert search_flops(1024, 64, nlist=32, nprobe=4) == 2 * (32 * 64 + 4 * 32 * 64)
    assert search_flops(1024, 64, nlist=32, nprobe=32) > search_flops(1024, 64)  # probing all lists costs more
    with pytest.raises(ValueError, match="nprobe"):
        search_flops(1024, 64, nlist=32, nprobe=33)


def test_bad_input(setup):
    model, a, b_other, b_eval = setup
    with pytest.raises(ValueError, match="evaluated document"):
        knowledge_update(model, a, b_other + b_eval[:1], b_eval, m=M)
    with pytest.raises(ValueError, match="lams must include 0.0"):
        knowledge_update(model, a, b_other, b_eval, m=M, lams=(0.5,))
    index = FlatIndex(32, metric="l2")
    index.add(torch.randn(8, 32))
    with pytest.raises(ValueError, match="last must be"):
        KNNLM(model, index, torch.zeros(8, dtype=torch.long)).lm_and_knn(torch.zeros(1, 5, dtype=torch.long), last=6)
    with pytest.raises(ValueError, match="rows must be"):
        knn_lm_losses(model, index, torch.zeros(8, dtype=torch.long), torch.zeros(2, M, dtype=torch.long), M, [0.0])


def test_size_to_reach_extrapolates_a_log_line():
    sizes = [1000, 2000, 4000]
    losses = [3.0 - 0.1 * math.log(s) for s in sizes]  # an exact line in ln(size)
    assert size_to_reach(sizes, losses, 3.0 - 0.1 * math.log(64_000)) == pytest.approx(64_000, rel=1e-9)
    assert size_to_reach(sizes, [2.0, 2.0, 2.1], 1.0) is None  # the loss does not fall with size
    with pytest.raises(ValueError, match="two"):
        size_to_reach([10], [1.0], 0.5)


def test_knowledge_update_unigram_is_the_added_text_byte_frequencies(setup):
    """The unigram line counts the added documents' scored bytes, add-one, and scores the evaluated bytes."""
    model, a, b_other, b_eval = setup
    got = knowledge_update(model, a, b_other, b_eval, m=M, lams=(0.0,)).unigram
    counts = torch.bincount(chunk_pairs(b_other, M)[0][:, M:].flatten(), minlength=256).double() + 1
    expected = -(counts / counts.sum()).log()[chunk_pairs(b_eval, M)[0][:, M:]].mean().item()
    assert got == pytest.approx(expected, rel=1e-12)
