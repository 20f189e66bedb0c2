"""Transformer blocks: attention and a feed-forward network, each wrapped in a residual connection.

The serial block applies them one after the other. Where the norm sits is a choice:

    post-LN   (Vaswani et al. 2017; BERT):    x = LN(x + f(x))
    pre-LN    (GPT-2; Xiong et al. 2020):     x = x + f(LN(x))
    sandwich  (CogView, Ding et al. 2021):    x = x + LN_out(f(LN(x)))
    DeepNorm  (Wang et al. 2022):             x = LN(alpha * x + f(x))

Post-LN normalises the residual stream itself, so gradients to early layers shrink with depth and it
needs a learning-rate warm-up; pre-LN keeps an identity path from the loss to every layer and
trains without one; DeepNorm keeps post-LN's quality while bounding the update of each layer.

The parallel block (GPT-J, Wang & Komatsuzaki 2021; PaLM, Chowdhery et al. 2022, sec. 2) feeds the
same normalised input to both branches and adds them:

    x = x + Attention(LN(x)) + FFN(LN(x))

The two branches can then share one input matmul; PaLM reports about 15% faster training at scale.

Both take the same settings and build the same attention and FFN, in their common base ``Block``;
they differ in their norms and in ``forward``.

Left out: cross-attention (encoder-decoder blocks) and stochastic depth.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .activations import FeedForward
from .attention import Attention
from .norms import make_norm

__all__ = ["PLACEMENTS", "Block", "SerialBlock", "ParallelBlock"]

PLACEMENTS = ("pre", "post", "sandwich", "deepnorm")


class Block(nn.Module):
    """What the two blocks share: one list of settings, the attention, the FFN and the residual dropout.

    A block kind says which norm placements it supports (``check_placement``) and which norms it
    needs (``add_norms``). ``deepnorm_alpha`` weighs the residual in DeepNorm blocks only; given with
    another placement it would be ignored, so it is refused.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        n_kv_heads: int | None = None,
        activation: str = "gelu",
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
        placement: str = "pre",
        bias: bool = True,
        attn_impl: str = "sdpa",
        dropout: float = 0.0,
        deepnorm_alpha: float = 1.0,
        fused: bool = False,
    ):
        super().__init__()
        self.check_placement(placement)
        if deepnorm_alpha != 1.0 and placement != "deepnorm":
            raise ValueError(
                f"deepnorm_alpha={deepnorm_alpha} weighs the residual of DeepNorm blocks only; "
                f"a {type(self).__name__} with placement={placement!r} would ignore it (leave it at 1.0)"
            )
        self.placement = placement
        self.alpha = deepnorm_alpha  # the residual's weight: 1 except in DeepNorm
        self.attn = Attention(d_model, n_heads, n_kv_heads, bias=bias, impl=attn_impl)
        self.mlp = FeedForward(d_model, d_ff, activation, bias=bias, fused=fused)
        self.add_norms(lambda: make_norm(norm, d_model, norm_eps, bias, fused))
        self.dropout = nn.Dropout(dropout)

    def check_placement(self, placement: str) -> None:
        """Raise ValueError if this kind of block cannot put its norms at ``placement``."""
        raise NotImplementedError

    def add_norms(self, new_norm: Callable[[], nn.Module]) -> None:
        """Create this block's norms; ``new_norm()`` makes one with the block's settings."""
        raise NotImplementedError


class SerialBlock(Block):
    """Attention, then FFN; ``placement`` says where the norms go (see the module docstring)."""

    def check_placement(self, placement: str) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown norm placement {placement!r}; choose from {PLACEMENTS}")

    def add_norms(self, new_norm: Callable[[], nn.Module]) -> None:
        self.attn_norm, self.mlp_norm = new_norm(), new_norm()
        if self.placement == "sandwich":
            self.attn_out_norm, self.mlp_out_norm = new_norm(), new_norm()

    def _residual(self, x, f, norm, out_norm=None) -> torch.Tensor:
        if self.placement == "pre":
            return x + self.dropout(f(norm(x)))
        if self.placement == "sandwich":
            return x + self.dropout(out_norm(f(norm(x))))
        return norm(self.alpha * x + self.dropout(f(x)))  # post-LN; DeepNorm when alpha > 1

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        """``attn_kwargs``: causal, attn_mask, rope, cache, layer (see ``Attention.forward``)."""
        sandwich = self.placement == "sandwich"
        attn_out_norm = self.attn_out_norm if sandwich else None
        mlp_out_norm = self.mlp_out_norm if sandwich else None
        x = self._residual(x, lambda h: self.attn(h, **attn_kwargs), self.attn_norm, attn_out_norm)
        return self._residual(x, self.mlp, self.mlp_norm, mlp_out_norm)


class ParallelBlock(Block):
    """x + Attention(LN(x)) + FFN(LN(x)): one norm, two branches side by side (pre-LN only)."""

    def check_placement(self, placement: str) -> None:
        if placement != "pre":
            raise ValueError(f"the parallel block is a pre-LN block; got placement={placement!r}")

    def add_norms(self, new_norm: Callable[[], nn.Module]) -> None:
        self.norm = new_norm()

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        """``attn_kwargs``: causal, attn_mask, rope, cache, layer (see ``Attention.forward``)."""
        h = self.norm(x)
        return x + self.dropout(self.attn(h, **attn_kwargs) + self.mlp(h))
