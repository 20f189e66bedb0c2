"""Faults in retrieval: non-finite vectors, exclusion that leaks, empty neighbour slots, bad sizes.

Each test injects one fault. A stored NaN vector used to be the top hit of every query; ``exclude_docs``
searched only 5k deep and then let the excluded document's entries through; a slot that an IVF index
left empty (id -1) became chunk 0; ``FlatIndex(block=0)``, a kNN-LM value past the vocabulary and
``chunk_pairs(m=0)`` failed inside ``range``, ``scatter_add`` and a division.
"""

import pytest
import torch

from llmedu.models import CausalLM, TransformerConfig
from llmedu.retrieval import FlatIndex, IVFIndex, ProductQuantizer
from llmedu.retrieval.datastore import BagOfWords, ChunkStore, chunk_pairs
from llmedu.retrieval.knn_lm import KNNLM, knn_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")

D = 16


def _unit(n: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=1, keepdim=True)


# -- non-finite vectors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_a_non_finite_vector_is_refused_at_add_naming_how_many_and_the_first(bad, metric):
    x = _unit(10)
    x[3, 0] = bad
    x[7, 5] = bad
    index = FlatIndex(D, metric)
    with pytest.raises(ValueError, match=r"vectors hold NaN or inf in 2 of 10 rows \(the first is row 3\)"):
        index.add(x)
    assert index.ntotal == 0  # nothing stored: the NaN can never become every query's top hit
    index.add(_unit(10))
    q = _unit(2, seed=1)
    q[1, 2] = bad
    with pytest.raises(ValueError, match=r"queries hold NaN or inf in 1 of 2 rows \(the first is row 1\)"):
        index.search(q, 3)


def test_ivf_and_pq_refuse_non_finite_vectors_too():
    x = _unit(300)
    ivf = IVFIndex(D, nlist=4, pq_M=4, pq_nbits=4)
    ivf.train(x)
    y = x.clone()
    y[42, 1] = float("nan")
    with pytest.raises(ValueError, match=r"training vectors hold NaN or inf in 1 of 300 rows \(the first is row 42\)"):
        IVFIndex(D, nlist=4).train(y)
    with pytest.raises(ValueError, match=r"training vectors hold NaN or inf .*row 42"):
        ProductQuantizer(D, 4, 4).train(y)
    with pytest.raises(ValueError, match=r"vectors hold NaN or inf .*row 42"):
        ivf.add(y)
    assert ivf.ntotal == 0


# -- ChunkStore: exclusion holds however deep it must search ----------------------------------------------
M = 8
OWN = "red green blue " * 120  # one long document whose chunks are all alike: 224 entries
OTHERS = ["one two three four five six seven eight nine ten " * 2, "cats and dogs and birds and fish " * 2]


@pytest.fixture(scope="module")
def mostly_one_document():
    store = ChunkStore(M, embedder=BagOfWords(dim=32))
    store.add_documents([OWN, *OTHERS])
    return store


def test_exclusion_holds_when_the_store_is_mostly_the_excluded_document(mostly_one_document):
    store, k = mostly_one_document, 12
    rows, docs = store.chunk([OWN])  # queries from document 0, which must never see itself
    keys = store.embed(rows[:5])
    nbrs = store.search(keys, k, exclude_docs=docs[:5])  # (5, k, 2m); 10 to 12 of each 12 were document 0's
    own_rows = store.values[store.doc_ids == 0].long()  # (224, 2m)
    assert not (nbrs.reshape(-1, 1, 2 * M) == own_rows).all(-1).any()  # not one neighbour is a row of document 0
    ids = store.neighbour_ids(keys, k, exclude_docs=docs[:5])  # (5, k): the entries behind them
    assert (ids >= 0).all() and (store.doc_ids[ids] != 0).all() and torch.equal(nbrs, store.values[ids].long())
    # they are the k best of the others, as exact search over the others alone ranks them
    scores = keys @ store.index.vectors.T  # (5, N)
    oracle = scores.masked_fill(store.doc_ids == 0, float("-inf")).topk(k, dim=1).values
    torch.testing.assert_close(scores.gather(1, ids), oracle, atol=0, rtol=0)


def test_exclusion_that_leaves_fewer_than_k_entries_is_refused(mostly_one_document):
    store = mostly_one_document
    others = int((store.doc_ids != 0).sum())
    rows, docs = store.chunk([OWN])
    ids = store.neighbour_ids(store.embed(rows[:2]), others + 1, exclude_docs=docs[:2])
    assert (ids[:, :others] >= 0).all() and (ids[:, others:] == -1).all()  # every other entry, then an empty slot
    with pytest.raises(ValueError, match=rf"2 of 2 keys found fewer than k={others + 1} neighbours outside"):
        store.search(store.embed(rows[:2]), others + 1, exclude_docs=docs[:2])


# -- empty slots of an IVF index: id -1, never chunk 0 ----------------------------------------------------
def test_an_ivf_slot_left_empty_is_minus_one_and_never_chunk_zero(mostly_one_document):
    store = ChunkStore(M, embedder=mostly_one_document.embedder, index=IVFIndex(32, nlist=2))
    far = torch.zeros(2, 32)
    far[1, 0] = 100.0  # list 1's centroid is far from every (unit) key: list 1 stays empty
    store.index.centroids = far
    store.add_documents(OTHERS)
    assert len(store.index.list_ids[1]) == 0
    query = far[1:]  # its one probed list is the empty one
    scores, ids = store.index.search(query, 3)  # FAISS's convention
    assert ids.tolist() == [[-1, -1, -1]] and scores.tolist() == [[float("-inf")] * 3]
    assert store.neighbour_ids(query, 3).tolist() == [[-1, -1, -1]]
    with pytest.raises(ValueError, match=r"raise the IVF index's nprobe \(now 1\)"):
        store.search(query, 3)  # used to return chunk 0 three times
    store.index.nprobe = 2  # the advice works
    assert store.search(query, 3).shape == (1, 3, 2 * M)


def test_knn_lm_gives_empty_ivf_slots_no_weight():
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.gpt2(vocab_size=20, d_model=16, n_layers=1, n_heads=2)).eval()
    index = IVFIndex(16, nlist=2, metric="l2")
    index.centroids = torch.stack([torch.zeros(16), torch.full((16,), 1e3)])
    near, far = torch.randn(5, 16), torch.full((5, 16), 1e3) + torch.randn(5, 16)  # list 0, list 1
    index.add(torch.cat([near, far]))
    values = torch.tensor([3, 3, 7, 7, 7, 0, 0, 0, 0, 0])
    knn = KNNLM(model, index, values, k=8)  # a query probes list 0 only: 5 found, 3 slots stay empty
    ids = torch.randint(0, 20, (1, 4))
    _, log_p_knn = knn.lm_and_knn(ids)
    with torch.no_grad():
        h = model.transformer(ids)[0]  # (4, d)
    weights = torch.softmax(-torch.cdist(h, near).pow(2), dim=-1)  # (4, 5): eq. 2 over the 5 found only
    oracle = torch.zeros(4, 20).index_add_(1, values[:5], weights)
    torch.testing.assert_close(log_p_knn.exp()[0], oracle, atol=1e-5, rtol=0)


# -- sizes and ids named ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_flat_index_block_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=rf"block \(queries scored at once\) must be a positive int, got {bad!r}"):
        FlatIndex(D, block=bad)


def test_a_knn_lm_value_past_the_vocabulary_is_named():
    model = CausalLM(TransformerConfig.gpt2(vocab_size=20, d_model=16, n_layers=1, n_heads=2)).eval()
    index = FlatIndex(16, metric="l2")
    index.add(torch.randn(4, 16))
    with pytest.raises(ValueError, match=r"datastore value 20 is not a token id of the vocabulary of 20 \(ids 0..19\)"):
        KNNLM(model, index, torch.tensor([1, 2, 20, 3]))
    with pytest.raises(ValueError, match="datastore value -1 is not a token id"):
        KNNLM(model, index, torch.tensor([1, -1, 2, 3]))
    with pytest.raises(ValueError, match="datastore value 25 is not a token id of the vocabulary of 20"):
        knn_log_probs(torch.zeros(2, 3), torch.tensor([[1, 2, 3], [4, 25, 6]]), 20)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_chunk_pairs_names_a_bad_chunk_length(bad):
    with pytest.raises(ValueError, match=rf"chunk length m must be a positive int \(bytes per chunk\), got {bad!r}"):
        chunk_pairs(["some text that is long enough"], bad)
