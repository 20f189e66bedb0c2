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

``outlier_features`` measures the outliers of a real model: it hooks every ``nn.Linear`` and records
which input columns reach the threshold, and in what fraction of tokens.

Left out: the fp16 storage of the paper (we keep fp32 or the input's dtype), bitsandbytes' fused CUDA
kernels and its row-major/col32 layouts, and int8 training (the paper's backward).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .int8 import dequantize, int8_matmul, quantize

__all__ = ["outlier_columns", "vectorwise_int8_matmul", "llm_int8_matmul", "LLMInt8Linear", "outlier_features"]


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x (..., {weight.shape[-1]}) @ weight (d_out, d_in)^T: got {tuple(x.shape)} and {tuple(weight.shape)}"
        )


def outlier_columns(x: torch.Tensor, threshold: float = 6.0) -> torch.Tensor:
    """(..., d_in) -> (d_in,) bool: the features with at least one |value| >= threshold."""
    if threshold <= 0:
        raise ValueError(f"the outlier threshold must be positive, got {threshold}")
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
    """An ``nn.Linear`` stored in int8 (one scale per output row), computed with LLM.int8()."""

    def __init__(self, linear: nn.Linear, threshold: float = 6.0):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"LLMInt8Linear wraps an nn.Linear, got {type(linear).__name__}")
        if threshold <= 0:
            raise ValueError(f"the outlier threshold must be positive, got {threshold}")
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
        cols = outlier_columns(x2, self.threshold)  # (d_in,)
        self.last_outliers = int(cols.sum())
        w_cols = dequantize(self.weight_q[:, cols], self.weight_scale, torch.zeros(1))  # (d_out, |O|)
        y = x2[:, cols].float() @ w_cols.t()  # (N, d_out) the outlier part
        rest = x2[:, ~cols]  # (N, d_in - |O|)
        if rest.shape[1]:
            qx, sx, _ = quantize(rest, bits=8, symmetric=True, axis=0)  # per token
            # the weight was quantized once with scales over all its columns; reuse its codes
            y = y + int8_matmul(qx, self.weight_q[:, ~cols].t()).float() * (sx * self.weight_scale.t())
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

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
    if threshold <= 0:
        raise ValueError(f"the outlier threshold must be positive, got {threshold}")
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
