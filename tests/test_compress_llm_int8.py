"""LLM.int8(): the outlier part is the float matmul itself; the decomposition beats plain int8."""

import pytest
import torch
from torch import nn

from llmedu.compress.llm_int8 import (
    LLMInt8Linear,
    llm_int8_matmul,
    outlier_columns,
    outlier_features,
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
