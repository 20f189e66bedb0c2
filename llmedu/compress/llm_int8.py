"""LLM.int8(): vector-wise int8 matmul plus a float matmul for the few outlier feature columns.

Dettmers, Lewis, Belkada & Zettlemoyer 2022, "LLM.int8(): 8-bit Matrix Multiplication for Transformers
at Scale", Section 3. Transformers past a few billion parameters grow *outlier features*: a handful of
hidden dimensions whose activations reach |x| >= 6 (often 20-60); the paper counts a feature as an
outlier when that happens in at least 25% of the layers and 6% of the tokens. One such value sets a
whole token's int8 step size, and the token's other features (383 in MiniLM's width of 384) lose their
precision. The fix splits the inner dimension of ``X W^T`` (eq. 5 and 7):

    O = { j : any |X[:, j]| >= threshold }                   the outlier columns, found per call
    X W^T = X[:, O] W[:, O]^T                                 in floating point (fp16 in the paper)
          + s_x s_w^T * (Q(X[:, ~O]) Q(W[:, ~O])^T)          vector-wise int8: one scale per row of X
                                                              (token) and per row of W (output channel)

The float part is the float matmul on those columns, nothing less; the tests check that it equals
``X[:, O] @ W[:, O].T`` exactly. ``LLMInt8Linear`` stores the weight in int8 (per output row) and
dequantizes only the outlier columns it needs, as bitsandbytes does.

With ``threshold = math.inf`` no column is ever an outlier: ``LLMInt8Linear`` is then plain vector-wise int8
(per-token activations, per-output-row weights) and skips the search and the split, so that a row of lesson 22's
table isolates what the float columns buy, in error and in time.

``outlier_features`` measures the outliers of a real model: it hooks every ``nn.Linear`` and records
which input columns reach the threshold, and in what fraction of tokens. ``outlier_hits`` counts them per
feature, as the paper's criterion needs (Section 4.1): for the hidden states it tracks (the inputs of the linears
named, each assigned to a transformer layer) it counts, per feature j, the tokens where |x_j| >= 6. A feature is
*systematic* when it reaches the threshold in at least 25% of the layers (in any tracked input of a layer) and in
at least 6% of all the sequence positions of all the tracked hidden states (hits summed over the states, over
the states' tokens summed).

Left out: the fp16 storage of the paper (we keep fp32 or the input's dtype), bitsandbytes' fused CUDA
kernels and its row-major/col32 layouts, and int8 training (the paper's backward). The paper tracks the
inputs of the attention projections and of the FFN expansion; which linears stand for the hidden states is
the caller's choice here (``outlier_hits`` takes their names).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .int8 import dequantize, int8_matmul, quantize

__all__ = [
    "outlier_columns",
    "vectorwise_int8_matmul",
    "llm_int8_matmul",
    "LLMInt8Linear",
    "outlier_features",
    "OutlierHits",
    "outlier_hits",
]


def _check_threshold(threshold) -> None:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:  # NaN too
        raise ValueError(f"the outlier threshold must be positive, got {threshold!r}")


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x (..., {weight.shape[-1]}) @ weight (d_out, d_in)^T: got {tuple(x.shape)} and {tuple(weight.shape)}"
        )


def outlier_columns(x: torch.Tensor, threshold: float = 6.0) -> torch.Tensor:
    """(..., d_in) -> (d_in,) bool: the features with at least one |value| >= threshold."""
    _check_threshold(threshold)
    return (x.detach().abs() >= threshold).reshape(-1, x.shape[-1]).any(dim=0)


def vectorwise_int8_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(N, d_in) @ (d_out, d_in)^T in int8, one absmax scale per row of x and per row of weight."""
    _check(x, weight)
    if x.shape[-1] == 0:  # every column was an outlier: nothing left for int8
        return x.new_zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    qx, sx, _ = quantize(x, bits=8, symmetric=True, axis=0)  # (N, d_in) int8, (N, 1)
    qw, sw, _ = quantize(weight, bits=8, symmetric=True, axis=0)  # (d_out, d_in) int8, (d_out, 1)
    return int8_matmul(qx, qw.t()).float() * (sx * sw.t())  # (N, d_out): the outer product of scales


def llm_int8_matmul(
    x: torch.Tensor, weight: torch.Tensor, threshold: float = 6.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """x (..., d_in) @ weight^T with the outlier decomposition; returns (y, parts).

    ``parts``: ``columns`` (d_in,) bool, ``outlier`` (the float part) and ``int8`` (the rest), each
    (N, d_out) with N = the number of rows of x; ``y = outlier + int8``, reshaped like x.
    """
    _check(x, weight)
    x2 = x.reshape(-1, x.shape[-1])  # (N, d_in)
    cols = outlier_columns(x2, threshold)  # (d_in,)
    outlier = x2[:, cols] @ weight[:, cols].t()  # (N, d_out): |O| columns in floating point
    rest = vectorwise_int8_matmul(x2[:, ~cols], weight[:, ~cols]).to(outlier.dtype)  # (N, d_out)
    y = (outlier + rest).reshape(*x.shape[:-1], weight.shape[0])
    return y, {"columns": cols, "outlier": outlier, "int8": rest}


class LLMInt8Linear(nn.Module):
    """An ``nn.Linear`` stored in int8 (one scale per output row), computed with LLM.int8().

    ``threshold=math.inf``: vector-wise int8 alone (no column is an outlier), without the search and split.
    """

    def __init__(self, linear: nn.Linear, threshold: float = 6.0):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"LLMInt8Linear wraps an nn.Linear, got {type(linear).__name__}")
        _check_threshold(threshold)
        self.threshold = threshold
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, s, _ = quantize(linear.weight, bits=8, symmetric=True, axis=0)
        self.register_buffer("weight_q", q)  # (d_out, d_in) int8
        self.register_buffer("weight_scale", s)  # (d_out, 1)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.last_outliers = 0  # how many columns the last call sent to the float path

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d_out)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs with {self.in_features} features, got shape {tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_features)  # (N, d_in)
        if self.threshold == math.inf:  # vector-wise int8 alone: no outlier search, no split
            self.last_outliers = 0
            y = self._vectorwise(x2, self.weight_q)  # (N, d_out)
        else:
            cols = outlier_columns(x2, self.threshold)  # (d_in,)
            self.last_outliers = int(cols.sum())
            w_cols = dequantize(self.weight_q[:, cols], self.weight_scale, torch.zeros(1))  # (d_out, |O|)
            y = x2[:, cols].float() @ w_cols.t()  # (N, d_out) the outlier part
            rest = x2[:, ~cols]  # (N, d_in - |O|)
            if rest.shape[1]:
                # the weight was quantized once with scales over all its columns; reuse its codes
                y = y + self._vectorwise(rest, self.weight_q[:, ~cols])
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def _vectorwise(self, x: torch.Tensor, weight_q: torch.Tensor) -> torch.Tensor:
        """(N, k) float, (d_out, k) int8 codes -> (N, d_out): per-token int8 activations times the stored rows."""
        qx, sx, _ = quantize(x, bits=8, symmetric=True, axis=0)  # (N, k) int8, (N, 1) per token
        return int8_matmul(qx, weight_q.t()).float() * (sx * self.weight_scale.t())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, threshold={self.threshold}"


@torch.no_grad()
def outlier_features(
    model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], threshold: float = 6.0
) -> dict[str, dict[str, object]]:
    """For every ``nn.Linear`` of ``model``: the input columns that reach ``threshold`` on ``batches``.

    Returns name -> {"columns": sorted list of feature indices, "token_fraction": the fraction of
    (unpadded) tokens with at least one outlier, "absmax": the largest |input|}. Each batch is a dict
    with ``input_ids`` and ``attention_mask``; padded positions are left out.
    """
    _check_threshold(threshold)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear")
    found = {n: {"cols": None, "hit": 0, "tokens": 0, "absmax": 0.0} for n in linears}
    mask = {}

    def record(name):
        def hook(module, args):
            x = args[0]
            if x.dim() == 3:  # (B, T, d): keep real tokens only
                x = x[mask["m"]]
            x = x.reshape(-1, x.shape[-1]).abs()  # (N, d)
            big = x >= threshold  # (N, d)
            rec = found[name]
            rec["cols"] = big.any(0) if rec["cols"] is None else rec["cols"] | big.any(0)
            rec["hit"] += int(big.any(1).sum())
            rec["tokens"] += x.shape[0]
            rec["absmax"] = max(rec["absmax"], float(x.max()))

        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in linears.items()]
    try:
        was_training = model.training
        model.eval()
        for batch in batches:
            mask["m"] = batch["attention_mask"].bool()
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    return {
        n: {
            "columns": torch.nonzero(r["cols"]).flatten().tolist() if r["cols"] is not None else [],
            "token_fraction": r["hit"] / max(1, r["tokens"]),
            "absmax": r["absmax"],
        }
        for n, r in found.items()
    }


@dataclass
class OutlierHits:
    """Per-feature outlier counts over S hidden states (the inputs of S linears), from ``outlier_hits``."""

    names: list[str]  # the S linears whose inputs are the hidden states
    layers: list[int]  # the transformer layer of each
    threshold: float
    hits: torch.Tensor  # (S, d) int64: real tokens with |x_j| >= threshold in hidden state s
    tokens: torch.Tensor  # (S,) int64: real tokens each hidden state was seen at
    absmax: torch.Tensor  # (S, d) float: the largest |x_j| in hidden state s

    def layer_share(self) -> torch.Tensor:
        """(d,): the fraction of the layers in which feature j reaches the threshold at least once (in any
        of the layer's hidden states)."""
        layer_ids = sorted(set(self.layers))
        rows = torch.tensor([layer_ids.index(layer) for layer in self.layers])  # (S,) 0..n_layers-1
        states_hit = torch.zeros(len(layer_ids), self.hits.shape[1], dtype=torch.int64)  # (n_layers, d)
        states_hit.index_add_(0, rows, (self.hits > 0).long())  # how many of each layer's states reach it
        return (states_hit > 0).float().mean(dim=0)

    def token_share(self) -> torch.Tensor:
        """(d,): the fraction of all sequence positions of all S hidden states where feature j reaches it."""
        return self.hits.sum(dim=0).double() / int(self.tokens.sum())

    def systematic(self, min_layer_share: float = 0.25, min_token_share: float = 0.06) -> torch.Tensor:
        """(d,) bool: Dettmers et al.'s outlier features, >= threshold in >= 25% of layers and >= 6% of positions."""
        for share in (min_layer_share, min_token_share):
            if not 0 < share <= 1:
                raise ValueError(f"a share must lie in (0, 1], got {share}")
        return (self.layer_share() >= min_layer_share) & (self.token_share() >= min_token_share)


@torch.no_grad()
def outlier_hits(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    names: Iterable[str],
    threshold: float = 6.0,
    layers: Iterable[int] | None = None,
) -> OutlierHits:
    """For each named module's input (one hidden state each, all of one width d), how many real tokens
    reach ``threshold`` in each feature: the counts behind the paper's per-feature criterion. ``layers``: the
    transformer layer of each name (default: each name a layer of its own).

    Each batch is a dict with ``input_ids`` and ``attention_mask`` (B, T); padded positions are left out. The
    modules' inputs must be (B, T, d), one row per token, as a transformer's linears receive them.
    """
    _check_threshold(threshold)
    names = list(names)
    if not names:
        raise ValueError("outlier_hits needs the names of the modules whose inputs to count, got none")
    layers = list(range(len(names))) if layers is None else list(layers)
    if len(layers) != len(names):
        raise ValueError(f"one layer per name: got {len(layers)} layers for {len(names)} names")
    if len(set(names)) != len(names):
        raise ValueError(f"each name once: a module's input is one hidden state, got {names}")
    modules = {n: model.get_submodule(n) for n in names}
    widths = {n: m.in_features for n, m in modules.items() if isinstance(m, nn.Linear)}
    if len(widths) != len(names) or len(set(widths.values())) != 1:
        raise ValueError(
            f"expected nn.Linear modules of one input width, got {widths or [type(m).__name__ for m in modules.values()]}"
        )
    d = next(iter(widths.values()))
    hits = torch.zeros(len(names), d, dtype=torch.int64)  # (S, d)
    tokens = torch.zeros(len(names), dtype=torch.int64)  # (S,)
    absmax = torch.zeros(len(names), d)  # (S, d)
    mask = {}

    def record(row):
        def hook(module, args):
            x = args[0]
            if x.dim() != 3:
                raise ValueError(f"{names[row]} received an input of shape {tuple(x.shape)}, expected (B, T, d)")
            x = x[mask["m"]].abs().float()  # (real tokens, d)
            hits[row] += (x >= threshold).sum(dim=0)
            tokens[row] += x.shape[0]
            if x.shape[0]:
                absmax[row] = torch.maximum(absmax[row], x.amax(dim=0))

        return hook

    handles = [m.register_forward_pre_hook(record(i)) for i, m in enumerate(modules.values())]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            mask["m"] = batch["attention_mask"].bool()  # (B, T)
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not int(tokens.min()):
        raise ValueError("no real token reached some of the named modules: were the batches empty?")
    return OutlierHits(names, layers, threshold, hits, tokens, absmax)
