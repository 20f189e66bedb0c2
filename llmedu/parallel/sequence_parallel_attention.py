"""Sequence parallelism for a whole pre-LN block: the attention half beside ``sequence_parallel``'s MLP half.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.2.2
and fig. 5. Attention is split by heads as in tensor parallelism (``ParallelAttention``): Q, K, V by
columns, the output projection by rows. Attention itself needs every token, so the same two
conjugates as the MLP bracket it, and the LayerNorm and the residual dropout in between stay
split along the sequence:

    x (B, T/N, d) -> LayerNorm -> g -> Q K V (B, T, 3 H/N D) -> attention -> out-proj -> g-bar -> dropout -> + x
                     tokens    all-gather      heads H/N         (B, H/N, T, D)   partial sums  reduce-scatter

g all-gathers the normed tokens once for Q, K and V: ``_GatherQKV`` multiplies the gathered input
by this rank's rows of W_Q, W_K and W_V in one matmul. With ``store_shard=True`` it keeps its input
*shard* and the three weights (not a concatenated copy) for backward and all-gathers the input again
there, as the MLP's first layer does (sec. 4.2.2, last paragraph); then every activation the paper
lists for the attention half, 11sbh + 5as^2b (its sec. 4.1), is divided by t (its table 2, the row for
tensor + sequence parallelism). Ours materialises the scores only if ``attn_impl`` does (``math``); ``sdpa`` keeps O(T).

``SequenceParallelBlock`` is a whole ``SerialBlock`` (pre-LN, our course's GPT block) under SP: the
two halves, one after the other, each rank holding (B, T/N, d) between them. Every parameter of the
norms and the row-split biases is marked ``sequence_parallel``: after backward,
``all_reduce_sequence_parallel_grads`` sums their gradients over the group.

RoPE: Q and K are built on the *gathered* sequence, so pass the full (T, D) tables, as in tensor
parallelism. ``block_activation_bytes`` counts what one rank saves for backward (one process, TP, SP).

Untested: RoPE and GQA under SP (the code paths exist; the tests use MHA without RoPE). Left out:
the KV cache, per-rank dropout streams (seed each rank differently), attention masks other than causal.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..nn.attention import Attention, get_attention
from ..nn.blocks import SerialBlock
from ..nn.positions import apply_rope
from .replicas import check_replicas_agree
from .sequence_parallel import (
    SequenceParallelMLPBlock,
    SequenceParallelRowLinear,
    _all_gather_seq,
    _reduce_scatter_seq,
    gather_sequence,
    saved_activation_bytes,
    sequence_shard,
)
from .tensor_parallel import ParallelAttention, ParallelMLP, check_tp_size, shard

__all__ = [
    "SequenceParallelAttentionBlock",
    "SequenceParallelBlock",
    "block_activation_bytes",
    "paper_block_activation_bytes",
]


class _GatherQKV(torch.autograd.Function):
    """[Q | K | V] = g(x) [W_Q | W_K | W_V]^T + b, saving the shard x (B, T/N, d) and the weights, not copies."""

    @staticmethod
    def forward(ctx, x, group, *weights_and_biases):  # W_Q, W_K, W_V (rows, d) each, then 3 biases or Nones
        weights, biases = weights_and_biases[:3], weights_and_biases[3:]
        ctx.group, ctx.has_bias = group, biases[0] is not None
        ctx.save_for_backward(x, *weights)
        bias = torch.cat(biases) if ctx.has_bias else None
        return F.linear(_all_gather_seq(x, group), torch.cat(weights), bias)  # (B, T, (H + 2 Hkv) / N * D)

    @staticmethod
    def backward(ctx, grad):  # grad (B, T, (H + 2 Hkv) / N * D)
        x, *weights = ctx.saved_tensors
        full = _all_gather_seq(x, ctx.group).flatten(0, 1)  # (B*T, d): gathered again, the price of the memory
        grads = grad.split([w.shape[0] for w in weights], dim=-1)  # dQ, dK, dV features (B, T, rows) each
        grad_x = _reduce_scatter_seq(sum(g @ w for g, w in zip(grads, weights)), ctx.group)  # (B, T/N, d)
        grad_w = [g.flatten(0, 1).t() @ full for g in grads]  # (rows, d) each
        grad_b = [g.flatten(0, 1).sum(0) for g in grads] if ctx.has_bias else [None] * 3
        return grad_x, None, *grad_w, *grad_b


def _split_parameter(t: torch.Tensor, group) -> nn.Parameter:
    """This rank's rows of a column-split weight or bias (its heads), marked as split along dim 0."""
    p = nn.Parameter(shard(t.detach(), 0, group))
    p.tp_dim = 0
    return p


class SequenceParallelAttentionBlock(nn.Module):
    """x + dropout(attention(norm(x))) on this rank's tokens x (B, T/N, d), with H/N heads on this rank.

    Built from a plain block's ``norm`` (copied whole) and ``Attention`` (split by heads). Parameter
    names follow ``Attention``: ``q_proj.weight`` is this rank's rows of the full ``q_proj.weight``.
    """

    def __init__(self, norm: nn.Module, attn: Attention, dropout: float = 0.0, group=None, store_shard=True):
        super().__init__()
        n = dist.get_world_size(group)
        check_tp_size(n, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads)
        check_replicas_agree({"norm": norm, "attn": attn}, group, "SequenceParallelAttentionBlock")
        self.group, self.store_shard, self.impl = group, store_shard, attn.impl
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads // n, attn.n_kv_heads // n, attn.head_dim
        self.norm = copy.deepcopy(norm)
        for p in self.norm.parameters():
            p.tp_dim, p.sequence_parallel = None, True
        self.q_proj, self.k_proj, self.v_proj = (nn.Module() for _ in range(3))
        for mine, full in ((self.q_proj, attn.q_proj), (self.k_proj, attn.k_proj), (self.v_proj, attn.v_proj)):
            mine.weight = _split_parameter(full.weight, group)  # (heads / N * D, d)
            mine.bias = None if full.bias is None else _split_parameter(full.bias, group)
        self.o_proj = SequenceParallelRowLinear(attn.o_proj, group)  # g-bar inside
        self.dropout = nn.Dropout(dropout)

    def _qkv(self, h: torch.Tensor) -> torch.Tensor:  # (B, T/N, d) -> (B, T, (H + 2 Hkv) / N * D)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weights, biases = [p.weight for p in projections], [p.bias for p in projections]
        if self.store_shard:  # one all-gather for the three; backward gathers the shard again
            return _GatherQKV.apply(h, self.group, *weights, *biases)
        bias = None if biases[0] is None else torch.cat(biases)
        return F.linear(gather_sequence(h, self.group), torch.cat(weights), bias)  # saves the gathered input

    def forward(self, x: torch.Tensor, causal: bool = True, rope=None) -> torch.Tensor:  # (B, T/N, d) -> same
        B, T = x.shape[0], x.shape[1] * dist.get_world_size(self.group)
        qkv = self._qkv(self.norm(x))  # (B, T, (H + 2 Hkv) / N * D): every token, this rank's heads
        sizes = [self.n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2
        q, k, v = qkv.split(sizes, dim=-1)
        q = q.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H/N, T, D)
        k = k.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv/N, T, D)
        v = v.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv/N, T, D)
        if rope is not None:
            cos, sin = rope  # (T, D) each: the full sequence's positions
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = get_attention(self.impl)(q, k, v, causal, None)  # (B, H/N, T, D)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H/N * D)
        return x + self.dropout(self.o_proj(out))  # (B, T/N, d): g-bar adds the heads' partial sums


class SequenceParallelBlock(nn.Module):
    """A pre-LN ``SerialBlock`` under sequence parallelism: (B, T/N, d) in and out, attention then MLP."""

    def __init__(self, block: SerialBlock, group=None, store_shard: bool = True):
        super().__init__()
        if not isinstance(block, SerialBlock) or block.placement != "pre":
            raise ValueError("SequenceParallelBlock splits a pre-LN SerialBlock (norm, sublayer, residual)")
        n = dist.get_world_size(group)
        check_tp_size(
            n, n_heads=block.attn.n_heads, n_kv_heads=block.attn.n_kv_heads, d_ff=block.mlp.up_proj.out_features
        )
        dropout = block.dropout.p
        self.attn = SequenceParallelAttentionBlock(block.attn_norm, block.attn, dropout, group, store_shard)
        self.mlp = SequenceParallelMLPBlock(block.mlp_norm, block.mlp, dropout, group, store_shard)
        self.group = group

    def forward(self, x: torch.Tensor, causal: bool = True, rope=None) -> torch.Tensor:  # (B, T/N, d) -> same
        return self.mlp(self.attn(x, causal, rope))


def block_activation_bytes(
    batch: int,
    seq_len: int,
    d_model: int,
    n_heads: int,
    group=None,
    dtype=torch.bfloat16,
    attn_impl: str = "math",
    dropout: float = 0.1,
) -> dict:
    """Bytes one rank saves for backward in one pre-LN block (d_ff = 4d, GELU), counted by autograd's hooks.

    ``one``: the plain block on one process; ``tp``: tensor parallelism (``ParallelAttention`` and
    ``ParallelMLP``, norms and dropouts on the whole sequence); ``sp``: sequence parallelism keeping
    the shards. ``attn_impl="math"`` materialises the (B, H, T, T) probabilities (the fp32 softmax output
    and a 16-bit copy, 6as^2b; the paper's 5as^2b assumes a dropout on them, which ours lacks);
    ``"sdpa"`` (a fused kernel) saves O(T). Every rank of ``group`` must call it.
    """
    torch.manual_seed(0)
    block = SerialBlock(d_model, n_heads, 4 * d_model, attn_impl=attn_impl, dropout=dropout, fused=True).to(dtype)
    x = torch.randn(batch, seq_len, d_model, dtype=dtype, requires_grad=True)  # (B, T, d)
    result = {}
    with saved_activation_bytes(block) as one:
        block(x, causal=True)
    result["one"] = one.total
    tp = copy.deepcopy(block)
    tp.attn, tp.mlp = ParallelAttention(block.attn, group), ParallelMLP(block.mlp, group)
    with saved_activation_bytes(tp) as counted:
        tp(x, causal=True)
    result["tp"] = counted.total
    sp = SequenceParallelBlock(block, group, store_shard=True)
    x_shard = sequence_shard(x.detach(), group).requires_grad_()  # (B, T/N, d)
    with saved_activation_bytes(sp) as counted:
        sp(x_shard, causal=True)
    result["sp"] = counted.total
    return result


def paper_block_activation_bytes(s: int, b: int, h: int, a: int, t: int, mode: str) -> float:
    """Korthikanti et al. 2022, table 2: activation bytes of one layer (16-bit values, 1-byte dropout masks).

    s tokens, b sequences, h features, a heads, t ranks. ``mode``: "one" (no parallelism, eq. 1),
    "tp" (the 10sbh of the norms, dropouts and first-layer inputs stay whole on every rank) or "sp".
    """
    if mode == "one":
        return s * b * h * (34 + 5 * a * s / h)
    if mode == "tp":
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    if mode == "sp":
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    raise ValueError(f"mode must be 'one', 'tp' or 'sp', got {mode!r}")
