"""kNN-LM: lambda 0 is the LM, the mixture is a distribution, the datastore helps on text it holds."""

import pytest
import torch

from llmedu.models import CausalLM, TransformerConfig
from llmedu.retrieval import FlatIndex, IVFIndex
from llmedu.retrieval.knn_lm import KNNLM, build_datastore, interpolate, knn_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def knn():
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.gpt2(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=64)).eval()
    windows = torch.randint(0, 50, (20, 17))  # (n, T+1): 320 key/value pairs
    keys, values = build_datastore(model, windows)
    index = FlatIndex(32, metric="l2")
    index.add(keys)
    return KNNLM(model, index, values, k=8), windows


def test_lambda_zero_is_the_lm(knn):
    knn_lm, _ = knn
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        lm = torch.log_softmax(knn_lm.model(ids), dim=-1)
    assert torch.equal(knn_lm.log_probs(ids, lam=0.0), lm)  # exactly: logaddexp(a, -inf) = a


def test_interpolation_is_a_distribution(knn):
    knn_lm, _ = knn
    ids = torch.randint(0, 50, (2, 12))
    for lam in (0.0, 0.25, 0.5, 1.0):
        p = knn_lm.log_probs(ids, lam).exp()
        assert (p >= 0).all()
        torch.testing.assert_close(p.sum(-1), torch.ones(2, 12), rtol=0, atol=1e-5)  # fp32 sum of 50 terms


def test_knn_distribution_matches_eq2():
    d = torch.tensor([[0.0, 1.0, 2.0]])
    v = torch.tensor([[3, 3, 1]])
    p = knn_log_probs(d, v, vocab_size=5).exp()
    w = torch.softmax(-d, dim=-1)[0]
    torch.testing.assert_close(p[0], torch.tensor([0.0, w[2], 0.0, w[0] + w[1], 0.0]))


def test_interpolate_mixes_probabilities_not_log_probabilities():
    a, b = torch.log_softmax(torch.randn(4, 7), -1), torch.log_softmax(torch.randn(4, 7), -1)
    torch.testing.assert_close(interpolate(a, b, 0.3).exp(), 0.7 * a.exp() + 0.3 * b.exp())


def test_datastore_lowers_loss_on_text_it_holds(knn):
    knn_lm, windows = knn
    lm_alone = KNNLM.nll(knn_lm.log_probs(windows, 0.0), windows)
    mixed = KNNLM.nll(knn_lm.log_probs(windows, 0.5), windows)
    assert mixed < lm_alone - 0.3  # each context finds itself: the true next token gets half the mass


def test_ivf_index_works_and_bad_input(knn):
    knn_lm, windows = knn
    keys, values = build_datastore(knn_lm.model, windows)
    ivf = IVFIndex(32, nlist=4, metric="l2")
    ivf.train(keys)
    ivf.add(keys)
    approx = KNNLM(knn_lm.model, ivf, values, k=8)
    assert KNNLM.nll(approx.log_probs(windows, 0.5), windows) < KNNLM.nll(approx.log_probs(windows, 0.0), windows)
    with pytest.raises(ValueError, match="metric='l2'"):
        KNNLM(knn_lm.model, FlatIndex(32), values)
    with pytest.raises(ValueError, match="values"):
        KNNLM(knn_lm.model, knn_lm.index, values[:-1])
    with pytest.raises(ValueError, match="lambda"):
        interpolate(torch.zeros(1, 2), torch.zeros(1, 2), 1.5)
    with pytest.raises(ValueError, match="dimension mismatch"):
        knn_lm.index.search(torch.randn(1, 31), 1)


def test_datastore_of_the_last_positions(knn):
    knn_lm, windows = knn
    keys, values = build_datastore(knn_lm.model, windows, last=4)
    all_keys, all_values = build_datastore(knn_lm.model, windows)
    assert keys.shape == (20 * 4, 32) and torch.equal(values.view(20, 4), windows[:, -4:])
    torch.testing.assert_close(keys.view(20, 4, 32), all_keys.view(20, 16, 32)[:, -4:])
    with pytest.raises(ValueError, match="last"):
        build_datastore(knn_lm.model, windows, last=17)
