"""Tensor parallelism: every layer's matrices split across ranks (Megatron-LM, Shoeybi et al. 2019).

A linear layer Y = X A can be split two ways over N ranks:

    by columns   A = [A_1 ... A_N]        Y_i = X A_i            each rank holds a slice of Y
    by rows      A = [A_1; ...; A_N]      Y = sum_i X_i A_i      each rank holds a partial sum of Y

The MLP Z = GELU(X A) B splits A by columns and B by rows (sec. 3, fig. 3a): GELU acts element by
element, so rank i computes GELU(X A_i) B_i with no communication in between, and one all-reduce adds
the partial sums. Two conjugate functions carry the communication:

    f   forward: identity          backward: all-reduce     (before the column-split layer)
    g   forward: all-reduce        backward: identity       (after the row-split layer)

so an MLP costs one all-reduce forward (g) and one backward (f). Self-attention splits the same way
by heads (fig. 3b): Q, K, V projections by columns (rank i owns heads i*H/N ...), the output
projection by rows. With grouped-query attention the key/value heads are split too, so N must divide
both H and H_kv. The vocabulary is split as well: the embedding table by rows (each rank looks up the
ids it owns, zeros elsewhere, and g adds them up), the output projection by columns, and the
cross-entropy is computed from vocabulary-sharded logits with three all-reduces of (tokens,) numbers
instead of gathering the (tokens, vocab) logits (sec. 3, last paragraph).

Norms, biases of row-split layers and position tables are replicated: their inputs and gradients are
identical on every rank, so their gradients agree without communication.

What can overlap: a column-split layer that takes f inside (``copy_input=True``) computes its backward
as Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` does: the input gradient first, then
its all-reduce launched, then the weight gradient while the all-reduce runs (``async_input_grad=True``),
then the wait. g's forward all-reduce has nothing independent to hide behind: the next layer needs it.

Left out: sequence parallelism (Korthikanti et al. 2022), dropout with per-rank RNG streams (use
dropout=0), the KV cache under tensor parallelism, and overlap by splitting a matrix product into chunks
(Wang et al. 2022; Transformer Engine's userbuffers).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.gpt import CausalLM
from ..nn.activations import FeedForward
from ..nn.attention import Attention, get_attention
from ..nn.positions import apply_rope

__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "shard",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelMLP",
    "ParallelAttention",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_lm_loss",
    "tensor_parallel",
    "check_tp_size",
]


# -- the two conjugate functions ---------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """f: identity forward; the gradient of a replicated input is the sum over ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (partial sums -> the full output); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def shard(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's contiguous 1/N slice of ``t`` along ``dim`` (a copy); N must divide the size."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[dim] % n:
        raise ValueError(f"a dimension of size {t.shape[dim]} cannot be split evenly over {n} tensor-parallel ranks")
    return t.chunk(n, dim=dim)[r].clone()


def _parameter(t: torch.Tensor, tp_dim: int | None) -> nn.Parameter:
    """A parameter that remembers along which dimension it was split (None: replicated)."""
    p = nn.Parameter(t)
    p.tp_dim = tp_dim
    return p


# -- the two ways to split a linear layer ----------------------------------------------------------------
class _LinearWithGradAllReduce(torch.autograd.Function):
    """f fused into a column-split linear: backward all-reduces the input gradient, before or during the
    weight gradient (``layer.async_input_grad``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.has_bias = layer, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):  # grad_y (..., out / N)
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        if not ctx.needs_input_grad[0]:  # no input gradient: nothing to all-reduce
            return (None, *layer.weight_grad(grad_y, x, ctx.has_bias), None)
        grad_x = layer.input_grad(grad_y, weight)  # (..., in): this rank's share of the sum over ranks
        work = (layer.link or dist).all_reduce(grad_x, group=layer.group, async_op=True)  # launched now
        if layer.async_input_grad:
            grad_w, grad_b = layer.weight_grad(grad_y, x, ctx.has_bias)  # computed while the link works
            work.wait()
        else:
            work.wait()  # synchronous: the weight gradient waits for the link
            grad_w, grad_b = layer.weight_grad(grad_y, x, ctx.has_bias)
        return grad_x, grad_w, grad_b, None


class ColumnParallelLinear(nn.Module):
    """Y_i = f(X) A_i^T + b_i: the output features split across ranks; output (..., out / N).

    ``copy_input=False`` leaves out f, for layers that share an input already passed through f once
    (Q, K and V; the gate and up projections of a gated MLP). With f inside, ``async_input_grad=True``
    overlaps its all-reduce with the weight gradient; ``link`` (a ``Link``) carries it instead of gloo.
    """

    def __init__(self, linear: nn.Linear, group=None, copy_input: bool = True, async_input_grad=False, link=None):
        super().__init__()
        self.group, self.copy_input = group, copy_input
        self.async_input_grad, self.link = async_input_grad, link
        self.weight = _parameter(shard(linear.weight.detach(), 0, group), 0)  # (out / N, in)
        self.bias = None if linear.bias is None else _parameter(shard(linear.bias.detach(), 0, group), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out / N)
        if not self.copy_input:
            return F.linear(x, self.weight, self.bias)
        return _LinearWithGradAllReduce.apply(x, self.weight, self.bias, self)

    def input_grad(self, grad_y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return grad_y @ weight  # (..., out / N) @ (out / N, in) -> (..., in)

    def weight_grad(self, grad_y: torch.Tensor, x: torch.Tensor, has_bias: bool):
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])  # (tokens, out / N)
        grad_w = grad_2d.t() @ x.reshape(-1, x.shape[-1])  # (out / N, in)
        return grad_w, (grad_2d.sum(0) if has_bias else None)


class RowParallelLinear(nn.Module):
    """Y = g(X_i A_i^T) + b: the input features split across ranks; the input is already split."""

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        self.group = group
        self.weight = _parameter(shard(linear.weight.detach(), 1, group), 1)  # (out, in / N)
        self.bias = None if linear.bias is None else _parameter(linear.bias.detach().clone(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in / N) -> (..., out)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)  # the partial sums added up
        return y if self.bias is None else y + self.bias  # added once, after the sum


# -- the two halves of a transformer block ---------------------------------------------------------------
class ParallelMLP(nn.Module):
    """down(act(up(x))) with up (and gate) split by columns, down by rows: one f, one g."""

    def __init__(self, mlp: FeedForward, group=None):
        super().__init__()
        self.group, self.act = group, mlp.act
        self.gate_proj = None if mlp.gate_proj is None else ColumnParallelLinear(mlp.gate_proj, group, copy_input=False)
        self.up_proj = ColumnParallelLinear(mlp.up_proj, group, copy_input=False)
        self.down_proj = RowParallelLinear(mlp.down_proj, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        x = copy_to_tp(x, self.group)  # f: the only communication of backward
        if self.gate_proj is None:
            h = self.act(self.up_proj(x))  # (B, T, d_ff / N): no communication needed for the activation
        else:
            h = self.act(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h)  # g inside: the only communication of forward


class ParallelAttention(nn.Module):
    """Self-attention with this rank's H / N query heads and H_kv / N key/value heads."""

    def __init__(self, attn: Attention, group=None):
        super().__init__()
        n = dist.get_world_size(group)
        check_tp_size(n, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads)
        self.group, self.impl, self.head_dim = group, attn.impl, attn.head_dim
        self.n_heads, self.n_kv_heads = attn.n_heads // n, attn.n_kv_heads // n  # local heads
        self.heads = slice(dist.get_rank(group) * self.n_heads, (dist.get_rank(group) + 1) * self.n_heads)
        # splitting the output features of Q, K, V into N contiguous chunks splits them by heads
        self.q_proj = ColumnParallelLinear(attn.q_proj, group, copy_input=False)
        self.k_proj = ColumnParallelLinear(attn.k_proj, group, copy_input=False)
        self.v_proj = ColumnParallelLinear(attn.v_proj, group, copy_input=False)
        self.o_proj = RowParallelLinear(attn.o_proj, group)

    def forward(self, x, causal: bool, attn_mask=None, rope=None, cache=None, layer: int = 0) -> torch.Tensor:
        if cache is not None:
            raise NotImplementedError("the KV cache is not supported under tensor parallelism")
        B, T, _ = x.shape
        x = copy_to_tp(x, self.group)  # f, once for Q, K and V
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H/N, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv/N, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv/N, T, D)
        if rope is not None:
            cos, sin = rope  # (T, D) each
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] > 1:
            attn_mask = attn_mask[:, self.heads]  # per-head biases (ALiBi, T5): this rank's heads only
        out = get_attention(self.impl)(q, k, v, causal, attn_mask)  # (B, H/N, T, D)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H/N * D)
        return self.o_proj(out)  # (B, T, d), summed over ranks by g


# -- the vocabulary, split by rows ---------------------------------------------------------------------
class VocabParallelEmbedding(nn.Module):
    """Rows vocab_start .. vocab_end of the table; ids outside give zeros, and g adds the ranks up."""

    def __init__(self, embedding: nn.Embedding, group=None):
        super().__init__()
        self.group = group
        self.weight = _parameter(shard(embedding.weight.detach(), 0, group), 0)  # (V / N, d)
        rows = self.weight.shape[0]
        self.vocab_start = dist.get_rank(group) * rows
        self.vocab_end = self.vocab_start + rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, d)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)  # (B, T)
        local = (ids - self.vocab_start).masked_fill(~mine, 0)
        x = F.embedding(local, self.weight) * mine.unsqueeze(-1)  # (B, T, d), zero for others' ids
        return reduce_from_tp(x, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits split along the vocabulary; three all-reduces of (N,)."""

    @staticmethod
    def forward(ctx, logits, target, group):  # logits (N, V / tp), target (N,)
        v_local = logits.shape[-1]
        start = dist.get_rank(group) * v_local
        top = logits.max(dim=-1).values  # (N,) for a stable softmax
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)  # (N, V / tp)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # (N,)
        dist.all_reduce(sum_exp, group=group)
        mine = (target >= start) & (target < start + v_local)  # (N,): the rank that owns the target
        local = (target - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine  # (N,)
        dist.all_reduce(target_logit, group=group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine)
        return sum_exp.log() - target_logit  # (N,)  = -log softmax(logits)[target]

    @staticmethod
    def backward(ctx, grad):  # d loss_n / d logits = softmax - one_hot(target)
        probs, local, mine = ctx.saved_tensors
        g = probs.clone()  # (N, V / tp)
        g[torch.arange(g.shape[0], device=g.device), local] -= mine.to(g.dtype)
        return g * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
    """Mean cross-entropy of ``target`` (...) given this rank's slice of the logits (..., V / N)."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(target.shape)} disagree")
    logits = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32; fp64 stays
    losses = _VocabParallelCrossEntropy.apply(logits, target.flatten(), group)
    return losses.mean()


def vocab_parallel_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, group=None) -> torch.Tensor:
    """``models.gpt.lm_loss`` for vocabulary-sharded logits (B, T, V / N): predict token t+1."""
    return vocab_parallel_cross_entropy(logits[:, :-1], input_ids[:, 1:], group)


# -- the whole model -----------------------------------------------------------------------------------
def check_tp_size(n: int, **sizes: int) -> None:
    """Raise a clear error if ``n`` tensor-parallel ranks do not divide every named size."""
    bad = {name: size for name, size in sizes.items() if size % n}
    if bad:
        listed = ", ".join(f"{name}={size}" for name, size in bad.items())
        raise ValueError(f"tensor parallelism over {n} ranks needs {n} to divide {listed}")


def tensor_parallel(model: CausalLM, group=None) -> CausalLM:
    """A copy of ``model`` holding this rank's shards; its forward returns logits (B, T, V / N).

    Every rank must pass the same full model (same seed). Parameter names stay those of the full
    model; a split parameter has ``tp_dim`` set to the dimension it was split along, so that
    ``shard(full.grad, p.tp_dim)`` is what its gradient should equal. Use
    ``vocab_parallel_lm_loss(logits, ids, group)`` as the loss.
    """
    if not isinstance(model, CausalLM):
        raise TypeError(f"tensor_parallel expects a CausalLM, got {type(model).__name__}")
    c, n = model.config, dist.get_world_size(group)
    check_tp_size(n, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, d_ff=c.d_ff, vocab_size=c.vocab_size)
    if c.position == "relative":
        raise ValueError("relative position biases (T5) are learned per head; not supported under tensor parallelism")
    if c.dropout > 0:
        raise ValueError("dropout needs per-rank random streams under tensor parallelism; use dropout=0")
    tp = copy.deepcopy(model)
    for block in tp.transformer.blocks:
        block.attn = ParallelAttention(block.attn, group)
        block.mlp = ParallelMLP(block.mlp, group)
    tp.transformer.tok_embed = VocabParallelEmbedding(model.transformer.tok_embed, group)
    lm_head = ColumnParallelLinear(model.lm_head, group)  # (V / N, d): logits split by vocabulary
    if c.tie_embeddings:
        lm_head.weight = tp.transformer.tok_embed.weight  # the same shard of the same matrix
    tp.lm_head = lm_head
    for p in tp.parameters():
        if not hasattr(p, "tp_dim"):
            p.tp_dim = None  # replicated: norms, position tables, row-parallel biases
    return tp
