"""Sequence parallelism: Megatron's tensor parallelism with the norms and dropouts split by tokens.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.2.2.
Under tensor parallelism (``tensor_parallel.py``) the matmuls are split over N ranks, but the
LayerNorm, the residual dropout and the input of the first linear layer are replicated: every rank
stores the same (B, T, d) activations. These ops work token by token, so they can be split along
the *sequence* instead. The all-reduce g of tensor parallelism (= reduce-scatter + all-gather)
is cut in two, and the halves move to the two ends of the block:

    x (B, T/N, d) -> LayerNorm -> g -> column-linear -> GELU -> row-linear -> g-bar -> dropout -> + x
                      tokens    all-gather   (B, T, d_ff / N)    partial sums  reduce-scatter  tokens

    g       forward: all-gather along the sequence      backward: reduce-scatter
    g-bar   forward: reduce-scatter along the sequence  backward: all-gather

The bytes moved equal those of tensor parallelism's one all-reduce, but no rank stores a replicated
activation. Per layer and 16-bit activations (s tokens, b sequences, h features, t ranks), the MLP
half (its LayerNorm, two linear layers, GELU, dropout mask) stores, from sec. 4.1 and 4.2:

    tensor parallel:     2sbh (LN input) + 2sbh (linear 1 input) + 16sbh / t + sbh (mask)  = 5sbh + 16sbh / t
    sequence parallel:   the same, every term divided by t                                  = 21sbh / t

The second line holds only if the first linear layer keeps its input *shard* for backward and
all-gathers it again there (sec. 4.2.2, last paragraph): ``store_shard=True``, the
``_GatherLinear`` below. With ``store_shard=False`` autograd keeps the gathered (B, T, d) input
(2sbh + 19sbh / t). ``mlp_activation_bytes`` measures the three, counting the tensors autograd saves.

The LayerNorm's weight and bias, and the bias of the row-split layer, are replicated but now see
only this rank's tokens: their gradients are partial sums and must be all-reduced over the group
after backward (``all_reduce_sequence_parallel_grads``); such parameters have
``sequence_parallel = True``.

Megatron keeps activations as (T, B, d), so that the sequence is the outermost dimension and
the ranks' pieces are contiguous for the collectives; we keep the course's (B, T, d) and move the
sequence to the front for each collective, which costs a copy.

The attention half (the same g / g-bar around the head-split attention; attention itself needs the
whole sequence, which g gives it) and a whole block are in ``sequence_parallel_attention.py``.

Left out: overlapping the backward all-gather with the weight
gradient matmul, and per-rank RNG streams for dropout: seed each rank differently
(``torch.manual_seed(seed + rank)``), or every rank drops the same positions of its own shard.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..nn.activations import FeedForward
from ..nn.norms import LayerNorm
from .compat import all_gather_single, reduce_scatter_single
from .replicas import check_replicas_agree
from .tensor_parallel import ColumnParallelLinear, ParallelMLP, RowParallelLinear

__all__ = [
    "sequence_shard",
    "gather_sequence",
    "reduce_scatter_sequence",
    "SequenceParallelColumnLinear",
    "SequenceParallelRowLinear",
    "SequenceParallelMLPBlock",
    "all_reduce_sequence_parallel_grads",
    "saved_activation_bytes",
    "mlp_activation_bytes",
    "paper_mlp_activation_bytes",
]


def _check_divides(seq_len: int, n: int) -> None:
    if seq_len % n:
        raise ValueError(f"a sequence of {seq_len} tokens cannot be split evenly over {n} sequence-parallel ranks")


def sequence_shard(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's contiguous 1/N of the sequence (dim 1): (B, T, ...) -> (B, T/N, ...), a copy."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    _check_divides(x.shape[1], n)
    return x.chunk(n, dim=1)[r].clone()


# -- the collectives along the sequence (torch's work along dim 0, so the sequence goes first) ------------
def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:  # (B, T/N, ...) -> (B, T, ...)
    n = dist.get_world_size(group)
    pieces = x.movedim(1, 0).contiguous()  # (T/N, B, ...)
    out = pieces.new_empty((n * pieces.shape[0], *pieces.shape[1:]))  # (T, B, ...), rank r's tokens at r*T/N
    all_gather_single(out, pieces, group=group)
    return out.movedim(0, 1)  # (B, T, ...)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:  # (B, T, ...) -> (B, T/N, ...)
    n = dist.get_world_size(group)
    _check_divides(x.shape[1], n)
    full = x.movedim(1, 0).contiguous()  # (T, B, ...)
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))  # (T/N, B, ...)
    reduce_scatter_single(out, full, group=group)  # the sum over ranks of this rank's tokens
    return out.movedim(0, 1)  # (B, T/N, ...)


# -- the two conjugate functions ---------------------------------------------------------------------------
class _GatherSequence(torch.autograd.Function):
    """g: all-gather the tokens forward; backward, each rank keeps the summed gradient of its own tokens."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """g-bar: add the ranks' partial sums and keep this rank's tokens; backward, all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: (B, T/N, ...) on each rank -> (B, T, ...) on every rank."""
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """g-bar: partial sums (B, T, ...) on each rank -> this rank's tokens of their sum (B, T/N, ...)."""
    return _ReduceScatterSequence.apply(x, group)


class _GatherLinear(torch.autograd.Function):
    """F.linear(g(x), W, b) that saves the shard x, not the gathered input, and gathers it again in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):  # x (B, T/N, in), weight (out / N, in)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)  # (B, T/N, in): 1/N of what autograd would keep
        return F.linear(_all_gather_seq(x, group), weight, bias)  # (B, T, out / N)

    @staticmethod
    def backward(ctx, grad):  # grad (B, T, out / N)
        x, weight = ctx.saved_tensors
        full = _all_gather_seq(x, ctx.group)  # (B, T, in): the all-gather again, the price of the memory
        grad_x = _reduce_scatter_seq(grad @ weight, ctx.group)  # (B, T/N, in), as g's backward
        grad_2d = grad.reshape(-1, grad.shape[-1])  # (B*T, out / N)
        grad_weight = grad_2d.t() @ full.reshape(-1, full.shape[-1])  # (out / N, in)
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None  # (out / N,)
        return grad_x, grad_weight, grad_bias, None


# -- the two linear layers, split as in tensor parallelism --------------------------------------------------
class SequenceParallelColumnLinear(ColumnParallelLinear):
    """The output features split as ``ColumnParallelLinear``; input (B, T/N, in) -> g -> (B, T, out / N)."""

    def __init__(self, linear: nn.Linear, group=None, store_shard: bool = True):
        super().__init__(linear, group, copy_input=False)  # g replaces f: its backward does the reduction
        self.store_shard = store_shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T/N, in) -> (B, T, out / N)
        if self.store_shard:
            return _GatherLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(gather_sequence(x, self.group), self.weight, self.bias)  # saves the gathered input


class SequenceParallelRowLinear(RowParallelLinear):
    """The input features split as ``RowParallelLinear``; its all-reduce replaced by g-bar."""

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__(linear, group)
        if self.bias is not None:
            self.bias.sequence_parallel = True  # added to this rank's tokens only: a partial gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, in / N) -> (B, T/N, out)
        y = reduce_scatter_sequence(F.linear(x, self.weight), self.group)  # (B, T/N, out)
        return y if self.bias is None else y + self.bias


# -- the MLP half of a pre-LN block ----------------------------------------------------------------------
class SequenceParallelMLPBlock(nn.Module):
    """x + dropout(MLP(norm(x))) on this rank's tokens x (B, T/N, d), built from a plain block's parts.

    ``norm`` (any token-wise norm) is copied whole; the MLP's weights are split as in
    ``ParallelMLP``. Every rank must pass the same weights: it is checked (``replicas.py``). Parameter names follow the FeedForward (``gate_proj``, ``up_proj``, ``down_proj``);
    the norm is ``norm``. A gated MLP all-gathers its input twice, once per input projection.
    """

    def __init__(self, norm: nn.Module, mlp: FeedForward, dropout: float = 0.0, group=None, store_shard=True):
        super().__init__()
        check_replicas_agree({"norm": norm, "mlp": mlp}, group, "SequenceParallelMLPBlock")  # as DDP does
        self.group, self.act = group, mlp.act
        self.norm = copy.deepcopy(norm)
        for p in self.norm.parameters():
            p.tp_dim, p.sequence_parallel = None, True  # replicated weights, gradients from this rank's tokens
        column = lambda linear: SequenceParallelColumnLinear(linear, group, store_shard)  # noqa: E731
        self.gate_proj = None if mlp.gate_proj is None else column(mlp.gate_proj)
        self.up_proj = column(mlp.up_proj)
        self.down_proj = SequenceParallelRowLinear(mlp.down_proj, group)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T/N, d) -> (B, T/N, d)
        h = self.norm(x)  # (B, T/N, d): this rank's tokens only
        if self.gate_proj is None:
            h = self.act(self.up_proj(h))  # (B, T, d_ff / N)
        else:
            h = self.act(self.gate_proj(h)) * self.up_proj(h)
        return x + self.dropout(self.down_proj(h))  # (B, T/N, d)


def all_reduce_sequence_parallel_grads(module: nn.Module, group=None) -> None:
    """Sum over the group the gradients of parameters marked ``sequence_parallel``; call after backward."""
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)


# -- activation memory: what autograd saves for backward ----------------------------------------------------
class _Bytes:
    total = 0


@contextmanager
def saved_activation_bytes(module: nn.Module) -> Iterator[_Bytes]:
    """Count the bytes of the tensors autograd saves while the block runs; ``module``'s parameters excluded.

    A tensor saved twice (or as a view, like ``F.linear``'s (B*T, d) of a (B, T, d) input) counts once.
    """
    counter, seen = _Bytes(), set()
    params = {p.data_ptr() for p in module.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if t.data_ptr() not in params and key not in seen:
            seen.add(key)
            counter.total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counter


def mlp_activation_bytes(batch: int, seq_len: int, d_model: int, group=None, dtype=torch.bfloat16) -> dict:
    """Bytes this rank saves for backward in the MLP half of a pre-LN block (d_ff = 4d, GELU, dropout 0.1).

    ``tp``: plain tensor parallelism (full LayerNorm, ``ParallelMLP``, full dropout); ``sp_gathered``:
    sequence parallelism keeping the gathered input of the first linear layer; ``sp``: keeping its shard.
    LayerNorm and GELU are torch's one-kernel ones (the written-out GELU saves three tensors, not one).
    Beyond the paper's terms, LayerNorm saves a mean and a 1/std per token, and on the CPU dropout keeps
    its mask in the activations' dtype, not in bytes. Every rank of ``group`` must call it.
    """
    torch.manual_seed(0)
    norm = LayerNorm(d_model, fused=True).to(dtype)
    mlp = FeedForward(d_model, 4 * d_model, "gelu", fused=True).to(dtype)
    tp_mlp, dropout = ParallelMLP(mlp, group), nn.Dropout(0.1)
    x = torch.randn(batch, seq_len, d_model, dtype=dtype, requires_grad=True)  # (B, T, d)
    with saved_activation_bytes(nn.ModuleList([norm, tp_mlp])) as tp:
        x + dropout(tp_mlp(norm(x)))
    result = {"tp": tp.total}
    for name, store_shard in (("sp_gathered", False), ("sp", True)):
        block = SequenceParallelMLPBlock(norm, mlp, 0.1, group, store_shard)
        x_shard = sequence_shard(x.detach(), group).requires_grad_()  # (B, T/N, d)
        with saved_activation_bytes(block) as sp:
            block(x_shard)
        result[name] = sp.total
    return result


def paper_mlp_activation_bytes(
    s: int, b: int, h: int, t: int, sequence_parallel: bool, act_bytes: int = 2, mask_bytes: int = 1
) -> float:
    """The paper's count for the MLP half (sec. 4.1-4.2.2); its defaults: 16-bit activations, 1-byte mask.

    LN input and linear 1 input (sbh each), GELU input and linear 2 input (4sbh / t each), dropout mask (sbh).
    """
    replicated = (2 * act_bytes + mask_bytes) * s * b * h  # split by t only under sequence parallelism
    split = 8 * act_bytes * s * b * h / t
    return replicated / t + split if sequence_parallel else replicated + split
