"""The memory of training, on paper: model states and activations in closed form.

Model states (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", §3.1). Mixed-precision training with Adam keeps, per parameter, an fp16 weight
(2 bytes) and an fp16 gradient (2 bytes) for the forward and backward passes, and K = 12 bytes of
optimizer state in fp32 (a master copy of the weight, Adam's momentum and variance): (2 + 2 + K)Ψ
bytes for Ψ parameters, 16Ψ. Plain fp32 training with AdamW also costs 16Ψ, split differently:
4Ψ weights, 4Ψ gradients, 8Ψ moments. ZeRO (§5.2, Figure 1) shards these across N data-parallel
ranks; the bytes per rank are

    stage 0 (plain data parallel)  (2 + 2 + K)Ψ
    stage 1 (P_os, optimizer)      2Ψ + 2Ψ + KΨ/N
    stage 2 (P_os+g, + gradients)  2Ψ + (2 + K)Ψ/N
    stage 3 (P_os+g+p, + weights)  (2 + 2 + K)Ψ/N

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4.1). A transformer layer with sequence length s, micro-batch b, hidden size h and a
attention heads stores, in 16-bit with dropout, s·b·h·(34 + 5·a·s/h) bytes for backward:

    attention  11sbh + 5as²b   LN output 2sbh, Q and K 4sbh, V 2sbh, softmax 2as²b, its dropout
                               mask as²b and output 2as²b, input of the projection 2sbh, dropout mask sbh
    MLP        19sbh           input 2sbh, GeLU input 8sbh, GeLU output 8sbh, dropout mask sbh
    LayerNorms  4sbh           the input of each of the two

Written for v bytes per value and 1 byte per dropout mask, that is sbh·(16v + 2d) + as²b·(v + d(1 + v))
with d = 1 with dropout, 0 without (the dropout output is then the softmax output, stored once).
In fp32 (v = 4) with dropout: s·b·h·(66 + 9·a·s/h); without: s·b·h·(64 + 4·a·s/h).

Parallelism (the paper's §4.2-4.3 and table 2). Tensor parallelism over t ranks splits the heads
and the FFN's width, so Q, K, V, the projection's input and GeLU's input and output (24sbh) and the
whole as²b term divide by t, while the LayerNorms' inputs and outputs and the dropout masks (10sbh)
stay whole on every rank: sbh·(10 + 24/t + 5as/(ht)). Sequence parallelism splits those along the
sequence as well, and everything divides by t: sbh/t·(34 + 5as/h). Context parallelism over c
ranks (Megatron-Core's CP; ring attention, Liu et al. 2023) gives each rank s/c tokens, all of
whose activations are local: everything divides by c (the score terms: s/c queries, s keys). On
top it holds K/V blocks in flight, the one it computes with and the one arriving
(``ring_attention_kv_bytes``); a ring-attention kernel that recomputes its scores in backward
(ours, FlashAttention) saves none of the as²b term.

Mixture of experts (``llmedu.nn.moe``, top-k, none dropped): the FFN's 8v·sbh (GeLU's input and
output, d_ff = 4h) become 11v·sbh per chosen expert, k of them: each expert's copy of its rows
(v), GeLU's input and output (8v), its output, kept for the gate's gradient (v), and the gated
output (v), which ``index_add`` keeps for its backward. The router's (s·b, E) tensors are left out.

What they leave out: buffers, temporaries that live only during one op, the embedding and
output layers' activations (the paper's §4.1 adds those separately), and allocator overheads.
``MemoryTracker`` measures all of it; these formulas say what dominates.
"""

from __future__ import annotations

__all__ = [
    "adamw_fp32_bytes",
    "mixed_precision_adam_bytes",
    "zero_bytes_per_rank",
    "activation_bytes_per_layer",
    "ring_attention_kv_bytes",
]


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def adamw_fp32_bytes(n_params: int) -> dict[str, int]:
    """Model states of fp32 training with (W)Adam: 4 + 4 + 8 bytes per parameter.

    Keys as ``MemoryTracker``'s: parameters 4Ψ, gradients 4Ψ, optimizer 8Ψ (momentum and variance).
    """
    _check_count("n_params", n_params)
    return {"parameters": 4 * n_params, "gradients": 4 * n_params, "optimizer": 8 * n_params}


def mixed_precision_adam_bytes(n_params: int, k: int = 12) -> dict[str, int]:
    """Model states of mixed-precision training with Adam: (2 + 2 + K)Ψ bytes (ZeRO, §3.1).

    parameters 2Ψ (fp16 or bf16 weights), gradients 2Ψ, optimizer KΨ: K = 12 for Adam (fp32 master
    weights, momentum and variance, 4 bytes each).
    """
    _check_count("n_params", n_params)
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k (bytes of optimizer state per parameter) must be a non-negative int, got {k!r}")
    return {"parameters": 2 * n_params, "gradients": 2 * n_params, "optimizer": k * n_params}


def zero_bytes_per_rank(n_params: int, world_size: int, stage: int, k: int = 12) -> dict[str, float]:
    """Model states held by each of ``world_size`` ranks under ZeRO ``stage`` 0-3 (ZeRO, §5.2).

    Stage 0 is plain data parallelism (everything replicated); stage 1 shards the optimizer state,
    stage 2 also the gradients, stage 3 also the weights. Values are bytes, possibly fractional
    when Ψ does not divide by N (real implementations pad to a multiple of N).
    """
    _check_count("world_size", world_size)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    full = mixed_precision_adam_bytes(n_params, k)
    sharded = {"optimizer": stage >= 1, "gradients": stage >= 2, "parameters": stage >= 3}
    return {name: full[name] / world_size if sharded[name] else float(full[name]) for name in full}


def activation_bytes_per_layer(
    seq_len: int,
    batch_size: int,
    hidden: int,
    n_heads: int,
    *,
    bytes_per_value: int = 2,
    dropout: bool = True,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    context_parallel: int = 1,
    moe_top_k: int | None = None,
) -> int:
    """Bytes one transformer layer saves for backward, on one rank (Korthikanti et al. 2022, §4).

    ``bytes_per_value=2`` with ``dropout=True`` is the paper's s·b·h·(34 + 5·a·s/h);
    ``bytes_per_value=4`` is fp32 training: s·b·h·(66 + 9·a·s/h), or s·b·h·(64 + 4·a·s/h) without dropout.
    ``tensor_parallel=t``: sbh·(10 + 24/t + 5as/(ht)); with ``sequence_parallel``: sbh/t·(34 + 5as/h)
    (table 2). ``context_parallel=c`` divides all of it by c. ``moe_top_k=k``: a mixture of experts
    in place of the FFN, each token through k experts (not modelled with tensor parallelism).
    """
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("hidden", hidden), ("n_heads", n_heads)):
        _check_count(name, value)
    for name, value in (("tensor_parallel", tensor_parallel), ("context_parallel", context_parallel)):
        _check_count(name, value)
    if bytes_per_value not in (1, 2, 4, 8):
        raise ValueError(f"bytes_per_value must be 1, 2, 4 or 8, got {bytes_per_value!r}")
    if hidden % n_heads:
        raise ValueError(f"hidden={hidden} is not divisible by n_heads={n_heads}")
    t, c = tensor_parallel, context_parallel
    if n_heads % t:
        raise ValueError(f"tensor_parallel={t} does not divide n_heads={n_heads}")
    if seq_len % c:
        raise ValueError(f"context_parallel={c} does not divide seq_len={seq_len}")
    if sequence_parallel and (seq_len // c) % t:
        raise ValueError(
            f"sequence parallelism: tensor_parallel={t} does not divide the {seq_len // c} tokens per rank"
        )
    if moe_top_k is not None:
        _check_count("moe_top_k", moe_top_k)
        if t > 1:
            raise ValueError("moe_top_k with tensor_parallel > 1 is not modelled (experts split by expert parallelism)")
    s, b, h, a, v, d = seq_len, batch_size, hidden, n_heads, bytes_per_value, int(bool(dropout))
    s_local = s // c  # this rank's tokens under context parallelism
    whole = (4 * v + 2 * d) * (s_local // t if sequence_parallel else s_local) * b * h  # LN in/out, dropout masks
    ffn = 11 * v * moe_top_k if moe_top_k is not None else 8 * v  # GeLU's input and output; per expert in an MoE
    split = (4 * v + ffn) * s_local * b * (h // t)  # Q, K, V, projection input; the FFN's hidden activations
    scores = (v + d * (1 + v)) * (a // t) * s_local * s * b  # softmax output; dropout mask and output
    return whole + split + scores


def ring_attention_kv_bytes(
    seq_len: int, batch_size: int, kv_hidden: int, context_parallel: int, *, bytes_per_value: int = 2
) -> int:
    """The K/V blocks one rank holds in flight during ring attention, besides its own: 2 blocks (the one
    it computes with and the one arriving), each K and V of s/c tokens: 2 * 2 * (s/c) * b * h_kv * v.

    ``kv_hidden`` = n_kv_heads * head_dim (h without grouped-query attention).
    """
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("kv_hidden", kv_hidden)):
        _check_count(name, value)
    _check_count("context_parallel", context_parallel)
    if seq_len % context_parallel:
        raise ValueError(f"context_parallel={context_parallel} does not divide seq_len={seq_len}")
    return 2 * 2 * (seq_len // context_parallel) * batch_size * kv_hidden * bytes_per_value
