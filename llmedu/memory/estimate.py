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
    seq_len: int, batch_size: int, hidden: int, n_heads: int, *, bytes_per_value: int = 2, dropout: bool = True
) -> int:
    """Bytes one transformer layer saves for backward (Korthikanti et al. 2022, §4.1, no parallelism).

    ``bytes_per_value=2`` with ``dropout=True`` is the paper's s·b·h·(34 + 5·a·s/h);
    ``bytes_per_value=4`` is fp32 training: s·b·h·(66 + 9·a·s/h), or s·b·h·(64 + 4·a·s/h) without dropout.
    """
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("hidden", hidden), ("n_heads", n_heads)):
        _check_count(name, value)
    if bytes_per_value not in (1, 2, 4, 8):
        raise ValueError(f"bytes_per_value must be 1, 2, 4 or 8, got {bytes_per_value!r}")
    if hidden % n_heads:
        raise ValueError(f"hidden={hidden} is not divisible by n_heads={n_heads}")
    s, b, h, a, v, d = seq_len, batch_size, hidden, n_heads, bytes_per_value, int(bool(dropout))
    linear_in_sbh = (16 * v + 2 * d) * s * b * h  # LN, QKV, projection, MLP inputs; dropout masks
    quadratic_in_s = (v + d * (1 + v)) * a * s * s * b  # softmax output; dropout mask and output
    return linear_in_sbh + quadratic_in_s
