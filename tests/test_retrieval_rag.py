"""In-context RAG: the datastore, the examples, the causality of the loss, and the knowledge update."""

import pytest
import torch

from llmedu.models import CausalLM, TransformerConfig
from llmedu.retrieval import IVFIndex
from llmedu.retrieval.datastore import BagOfWords, ChunkStore, decode_bytes, encode_bytes
from llmedu.retrieval.rag import (
    evaluate,
    flops_per_predicted_token,
    make_examples,
    sweep_learning_rate,
    target_loss,
    train_on_examples,
)

pytestmark = pytest.mark.usefixtures("one_thread")

M = 32
_g = torch.Generator().manual_seed(0)
WORDS = ["".join(chr(97 + int(c)) for c in torch.randint(26, (5,), generator=_g)) for _ in range(2000)]


def docs(seed, n=4, words=60):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (words,), generator=g)) for _ in range(n)]


def test_bytes_round_trip_and_chunks():
    assert decode_bytes(encode_bytes("In the beginning")) == "In the beginning"
    store = ChunkStore(M)
    values, doc = store.chunk(["x" * (5 * M + 3), "y" * M, "z" * (2 * M)])
    assert values.shape == (4 + 1, 2 * M) and doc.tolist() == [0, 0, 0, 0, 2]  # full chunk pairs only
    with pytest.raises(ValueError, match="longer than two chunks"):
        store.chunk(["short"])
    with pytest.raises(RuntimeError, match="fit"):
        BagOfWords()(["no idf yet"])


def test_neighbours_never_come_from_the_own_document():
    train = docs(0)
    store = ChunkStore(M)
    store.add_documents(train)
    rows, own = store.chunk(train)
    nbrs = make_examples(store, train, k=2, exclude_own=True)[:, : 4 * M].view(-1, 2, 2 * M)  # (n, k, 2m)
    for doc, pair in zip(own, nbrs):
        for n in pair:
            hits = (store.values.long() == n).all(1).nonzero().flatten()
            assert (store.doc_ids[hits] != doc).any()  # an entry of another document
    # without the exclusion every chunk finds itself first
    first = make_examples(store, train, k=1)[:, : 2 * M]
    assert torch.equal(first, rows)


def test_loss_scores_only_the_last_chunk():
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.gpt2(vocab_size=256, d_model=32, n_layers=1, n_heads=2, max_seq_len=128))
    x = torch.randint(0, 256, (3, 4 * M))
    loss = target_loss(model, x, M)
    logits = model(x)
    ref = torch.nn.functional.cross_entropy(logits[:, -M - 1 : -1].reshape(-1, 256), x[:, -M:].reshape(-1))
    torch.testing.assert_close(loss, ref)
    y = x.clone()
    y[:, -M:] = (y[:, -M:] + 1) % 256  # change only the scored tokens' targets: the loss changes
    assert target_loss(model, y, M) != loss
    assert flops_per_predicted_token(model, 4 * M, M) > flops_per_predicted_token(model, 2 * M, M)
    with pytest.raises(ValueError, match="shorter"):
        target_loss(model, x[:, : M + 1], M)


def test_knowledge_update_is_deterministic_and_puts_the_text_in_reach():
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.gpt2(vocab_size=256, d_model=32, n_layers=1, n_heads=2, max_seq_len=128))
    old, new = docs(1), docs(2)

    def update():
        store = ChunkStore(M, index=IVFIndex(128, nlist=4))
        store.index.nprobe = 4
        store.add_documents(old)
        before = make_examples(store, new, k=1)
        store.add_documents(new)  # no gradient step: only the datastore changes
        after = make_examples(store, new, k=1)
        return before, after, evaluate(model, before, M), evaluate(model, after, M)

    b1, a1, lb1, la1 = update()
    b2, a2, lb2, la2 = update()
    assert torch.equal(b1, b2) and torch.equal(a1, a2) and lb1 == lb2 and la1 == la2
    # after the update each query's nearest entry is its own chunk and continuation: the text to predict
    assert torch.equal(a1[:, : 2 * M], a1[:, 2 * M :])
    assert not torch.equal(b1[:, : 2 * M], b1[:, 2 * M :])


def _tiny_lm():
    torch.manual_seed(0)
    return CausalLM(TransformerConfig.gpt2(vocab_size=256, d_model=16, n_layers=1, n_heads=2, max_seq_len=32))


def test_lr_sweep_keeps_the_lr_with_the_lowest_dev_loss():
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (40, 16), generator=g)  # (n, 2m) with m = 8
    dev = torch.randint(0, 256, (8, 16), generator=g)
    sweep = sweep_learning_rate(_tiny_lm, rows, dev, 8, steps=3, lrs=[1e-2, 1e-5], batch=4)
    assert len(sweep.dev_loss) == len(sweep.curves) == 2 and all(len(c) == 3 for c in sweep.curves)
    best = sweep.lrs[min(range(2), key=sweep.dev_loss.__getitem__)]
    assert sweep.best_lr == best
    # the model returned is the one trained at best_lr: retraining it gives the same dev loss (same seed, ~1e-6)
    again = _tiny_lm()
    train_on_examples(again, rows, 8, 3, batch=4, lr=best)
    assert evaluate(sweep.model, dev, 8) == pytest.approx(evaluate(again, dev, 8), abs=1e-6)


def test_lr_sweep_rejects_an_empty_list_or_dev_split():
    rows = torch.zeros(8, 16, dtype=torch.long)
    with pytest.raises(ValueError, match="non-empty list"):
        sweep_learning_rate(_tiny_lm, rows, rows, 8, 1, [])
    with pytest.raises(ValueError, match="positive"):
        sweep_learning_rate(_tiny_lm, rows, rows, 8, 1, [0.0])
    with pytest.raises(ValueError, match="dev split is empty"):
        sweep_learning_rate(_tiny_lm, rows, rows[:0], 8, 1, [1e-3])


def test_neighbour_coverage_counts_each_rows_own_neighbours():
    """A row whose neighbour holds its next chunk is covered; one whose neighbours are unrelated is not."""
    from llmedu.retrieval.rag import neighbour_coverage

    m, k = 8, 1
    text = torch.arange(10, 10 + 2 * m)  # the row's query and next chunk
    copied = torch.cat([text, text])  # neighbour = the same 2m bytes
    unrelated = torch.cat([torch.full((2 * m,), 200), text])
    got = neighbour_coverage(torch.stack([copied, unrelated]), k, m, n=4)
    assert got.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="2\\(k\\+1\\)m"):
        neighbour_coverage(torch.stack([copied, unrelated]), 2, m)
