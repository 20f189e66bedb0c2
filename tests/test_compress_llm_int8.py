"""LLM.int8(): the outlier part is the float matmul itself; the decomposition beats plain int8."""

import math

import pytest
import torch
from torch import nn

from llmedu.compress.int8 import int8_matmul, quantize
from llmedu.compress.llm_int8 import (
    LLMInt8Linear,
    llm_int8_matmul,
    outlier_columns,
    outlier_features,
    outlier_hits,
    vectorwise_int8_matmul,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # many small ops on a busy 2-core CPU


def activations_with_outliers(seed=0, n=64, d=128, cols=(5, 77), size=40.0):
    """Gaussian activations plus a few feature columns of large values (as in the paper's Fig. 3)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    for c in cols:
        x[:, c] = size * (1 + torch.rand(n, generator=g))  # systematic: every token, same sign
    return x, torch.randn(96, d, generator=g) * 0.05


def test_outlier_part_equals_the_float_matmul_on_those_columns():
    x, w = activations_with_outliers()
    y, parts = llm_int8_matmul(x, w)
    cols = parts["columns"]
    assert cols.nonzero().flatten().tolist() == [5, 77]
    assert torch.equal(parts["outlier"], x[:, cols] @ w[:, cols].t())  # bitwise: the same float op
    assert torch.equal(parts["int8"], vectorwise_int8_matmul(x[:, ~cols], w[:, ~cols]))
    assert torch.equal(y, parts["outlier"] + parts["int8"])


def test_decomposition_is_much_closer_to_fp32_than_plain_int8():
    x, w = activations_with_outliers()
    exact = x @ w.t()
    err_plain = (vectorwise_int8_matmul(x, w) - exact).abs().mean()
    err_decomposed = (llm_int8_matmul(x, w)[0] - exact).abs().mean()
    # an outlier of ~60 sets each token's step to ~0.5, so the Gaussian features (|x| ~ 1) mostly round
    # to 0 or +-1 code; without them in the scale the step is ~0.03. Measured ratio ~17x; ask for 4x.
    assert err_decomposed < err_plain / 4


def test_without_outliers_it_is_plain_vectorwise_int8_and_with_all_columns_it_is_exact():
    x, w = activations_with_outliers(cols=())
    y, parts = llm_int8_matmul(x, w, threshold=1e6)
    assert not parts["columns"].any() and torch.equal(y, vectorwise_int8_matmul(x, w))
    y, parts = llm_int8_matmul(x, w, threshold=1e-12)  # every column is an outlier: all in float
    assert parts["columns"].all() and torch.allclose(y, x @ w.t(), rtol=0, atol=1e-6)


def test_vectorwise_int8_error_bound():
    x, w = activations_with_outliers(cols=())
    exact = x @ w.t()
    approx = vectorwise_int8_matmul(x, w)
    # each product term errs by at most (s_x/2)|w| + (s_w/2)|x| + (s_x/2)(s_w/2): a bound per output
    sx = x.abs().amax(1, keepdim=True) / 127.5
    sw = w.abs().amax(1, keepdim=True) / 127.5
    bound = (sx / 2) @ w.abs().sum(1, keepdim=True).t() + x.abs().sum(1, keepdim=True) @ (sw / 2).t()
    bound = bound + x.shape[1] * (sx / 2) @ (sw / 2).t()
    assert ((approx - exact).abs() <= bound + 1e-5).all()


def test_module_matches_the_function_up_to_weight_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(128, 96)
    x, _ = activations_with_outliers()
    layer = LLMInt8Linear(linear)
    y = layer(x.view(4, 16, 128))
    assert y.shape == (4, 16, 96) and layer.last_outliers == 2
    exact = linear(x).view(4, 16, 96)
    # the module stores W in int8 (rows quantized over all columns): error ~ weight step, far below the
    # error of plain int8 with these outliers
    plain = vectorwise_int8_matmul(x, linear.weight) + linear.bias
    assert (y - exact).abs().mean() < (plain.view(4, 16, 96) - exact).abs().mean() / 4


def test_infinite_threshold_is_llm_int8_with_no_outlier_columns():
    torch.manual_seed(0)
    linear = nn.Linear(128, 96)
    x, _ = activations_with_outliers(cols=())  # Gaussian: no |x| reaches 6
    assert not outlier_columns(x).any()
    vectorwise = LLMInt8Linear(linear, threshold=math.inf)
    y = vectorwise(x.view(4, 16, 128))
    # bitwise what LLM.int8 computes when it finds no outlier column: the same codes, scales and bias
    assert torch.equal(y, LLMInt8Linear(linear, threshold=6.0)(x.view(4, 16, 128)))
    # with outliers it does not split them off: it equals LLM.int8 at a threshold no value reaches
    x, _ = activations_with_outliers()
    y = vectorwise(x)
    assert vectorwise.last_outliers == 0 and torch.equal(y, LLMInt8Linear(linear, threshold=1e30)(x))
    # and it is vector-wise: per-token, per-output-row int8 codes of the same weight (not the per-tensor layer)
    qx, sx, _ = quantize(x, bits=8, symmetric=True, axis=0)  # (64, 128) int8, (64, 1): a scale per token
    qw, sw = vectorwise.weight_q, vectorwise.weight_scale  # (96, 128) int8, (96, 1): a scale per output row
    assert torch.equal(y, int8_matmul(qx, qw.t()).float() * (sx * sw.t()) + linear.bias)


def test_outlier_features_finds_the_planted_columns():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.proj = nn.Linear(8, 4)

        def forward(self, input_ids, attention_mask):
            return self.proj(self.emb(input_ids))

    model = Tiny()
    with torch.no_grad():
        model.emb.weight.zero_()
        model.emb.weight[3, 2] = 9.0  # token 3 carries an outlier in feature 2
        model.emb.weight[4, 6] = 50.0  # token 4 too, feature 6, but only at a padded position
    ids = torch.tensor([[1, 3, 1, 4]])
    mask = torch.tensor([[1, 1, 1, 0]])
    found = outlier_features(model, [{"input_ids": ids, "attention_mask": mask}])["proj"]
    assert found["columns"] == [2] and found["token_fraction"] == pytest.approx(1 / 3) and found["absmax"] == 9.0


class Planted(nn.Module):
    """Five "layers", each a linear reading its own embedding of the ids: hidden state l is emb[l](ids)."""

    def __init__(self, layers=5, d=8):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(10, d) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(d, 2) for _ in range(layers))
        for e in self.emb:
            nn.init.zeros_(e.weight)

    def plant(self, layers, token, feature, value):
        with torch.no_grad():
            for layer in layers:
                self.emb[layer].weight[token, feature] = value

    def forward(self, input_ids, attention_mask):
        return sum(p(e(input_ids)) for e, p in zip(self.emb, self.proj))


def test_outlier_hits_count_each_feature_in_each_hidden_state():
    model = Planted()
    every = range(5)
    model.plant(every, token=3, feature=1, value=7.0)  # in every layer, 4 of 10 tokens: systematic
    model.plant([0, 1], token=2, feature=4, value=-9.0)  # 2 of 5 layers, 2 tokens, negative: systematic
    model.plant([4], token=3, feature=3, value=8.0)  # 8% of positions, but in 1 of 5 layers only
    model.plant([2, 3], token=5, feature=5, value=20.0)  # 2 of 5 layers, but 1 token: 2% of positions
    model.plant([0], token=5, feature=2, value=6.0)  # exactly the threshold, once: one token, one layer
    model.plant(every, token=1, feature=6, value=5.99)  # everywhere, just below it
    model.plant(every, token=9, feature=7, value=50.0)  # only at padded positions
    ids = torch.tensor([[3, 1, 3, 2, 1, 9, 9], [3, 2, 5, 1, 3, 9, 9]])  # ids 3: 4 tokens, 1: 3, 2: 2, 5: 1
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0, 0]])
    names = [f"proj.{i}" for i in range(5)]
    stats = outlier_hits(model, [{"input_ids": ids, "attention_mask": mask}], names)
    assert stats.tokens.tolist() == [10] * 5
    assert stats.hits[:, 1].tolist() == [4] * 5 and stats.hits[:, 4].tolist() == [2, 2, 0, 0, 0]
    assert stats.hits[:, 2].tolist() == [1, 0, 0, 0, 0] and stats.hits[:, [0, 6, 7]].sum() == 0
    assert stats.layer_share().tolist() == pytest.approx([0, 1, 0.2, 0.2, 0.4, 0.4, 0, 0])
    assert stats.token_share().tolist() == pytest.approx([0, 20 / 50, 1 / 50, 4 / 50, 4 / 50, 2 / 50, 0, 0])
    assert stats.systematic().nonzero().flatten().tolist() == [1, 4]  # >= 25% of layers and >= 6% of positions
    assert stats.systematic(min_layer_share=0.2).nonzero().flatten().tolist() == [1, 3, 4]
    assert stats.absmax[:, 7].max() < 50 and stats.absmax[0, 4] == 9.0  # padding left out, |x| taken
    # the paper's layers hold several tracked inputs: here layers 0 (states 0, 1), 1 (2, 3) and 2 (4). A feature
    # counts for a layer when any of its states reaches 6; the positions are still those of all five states
    grouped = outlier_hits(model, [{"input_ids": ids, "attention_mask": mask}], names, layers=[0, 0, 1, 1, 2])
    assert grouped.layer_share().tolist() == pytest.approx([0, 1, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 0, 0])
    assert torch.equal(grouped.token_share(), stats.token_share())
    assert grouped.systematic().nonzero().flatten().tolist() == [1, 3, 4]  # feature 3: 1 of 3 layers now


def test_bad_input_gets_a_clear_error():
    x, w = activations_with_outliers()
    with pytest.raises(ValueError, match="threshold must be positive"):
        outlier_columns(x, threshold=0)
    with pytest.raises(ValueError, match=r"x \(..., 128\) @ weight"):
        llm_int8_matmul(x[:, :100], w)
    with pytest.raises(TypeError, match="wraps an nn.Linear"):
        LLMInt8Linear(nn.Identity())
    with pytest.raises(ValueError, match="expected inputs with 128 features"):
        LLMInt8Linear(nn.Linear(128, 4))(torch.randn(2, 3))
    with pytest.raises(ValueError, match="threshold must be positive"):
        LLMInt8Linear(nn.Linear(4, 4), threshold=float("nan"))
    model = Planted()
    batch = [{"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)}]
    with pytest.raises(ValueError, match="one input width"):
        outlier_hits(model, batch, ["proj.0", "emb.0"])
    with pytest.raises(ValueError, match="needs the names"):
        outlier_hits(model, batch, [])
    with pytest.raises(ValueError, match="one layer per name"):
        outlier_hits(model, batch, ["proj.0", "proj.1"], layers=[0])
    with pytest.raises(ValueError, match="each name once"):
        outlier_hits(model, batch, ["proj.0", "proj.0"])
    with pytest.raises(ValueError, match="no real token"):
        outlier_hits(model, [], ["proj.0"])
    with pytest.raises(ValueError, match="a share must lie in"):
        outlier_hits(model, batch, ["proj.0"]).systematic(min_token_share=0)
