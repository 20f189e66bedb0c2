"""Graders for lessons 02-05 (the transformer's parts): each runs a learner's function on a few cases
and compares it with ``llmedu.nn`` / ``llmedu.models``.

    check_sinusoidal(fn)        fn(positions (T,), d_model) -> (T, d_model) table
    check_alibi_slopes(fn)      fn(n_heads) -> (n_heads,) slopes
    check_rope(fn)              fn(x (B, H, T, D), positions (T,), base) -> x rotated ("rotate half" layout)
    check_layernorm(fn)         fn(x, weight, bias, eps) -> normalised x
    check_rmsnorm(fn)           fn(x, weight, eps) -> normalised x
    check_swiglu(fn)            fn(x, w_gate, w_up, w_down) -> FFN output; weights are (out, in) like nn.Linear
    check_causal_mask(fn)       fn(t_q, t_k) -> (t_q, t_k) bool, True where a query may look
    check_gqa_attention(fn)     fn(q (B, H, T, D), k, v (B, H_kv, T, D), causal) -> (B, H, T, D)
    check_kv_cache_bytes(fn)    fn(n_layers, n_kv_heads, head_dim, seq_len, batch, bytes_per_value) -> int
    check_flops_per_token(fn)   fn(n_params, n_layers, seq_len, d_model) -> training FLOPs per token
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..nn.attention import causal_mask, kv_cache_bytes, math_attention
from ..nn.norms import LayerNorm, RMSNorm
from ..nn.positions import alibi_slopes, apply_rope, rope_cos_sin, sinusoidal_table
from .core import CheckResult, Grader

__all__ = [
    "check_sinusoidal",
    "check_alibi_slopes",
    "check_rope",
    "check_layernorm",
    "check_rmsnorm",
    "check_swiglu",
    "check_causal_mask",
    "check_gqa_attention",
    "check_kv_cache_bytes",
    "check_flops_per_token",
]

# float32 results of the same formula computed in another order agree to ~1e-6; 1e-5 leaves room
TOL = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_sinusoidal(fn) -> CheckResult:
    g = Grader("check_sinusoidal")
    for T, d in ((4, 2), (7, 8), (50, 64)):
        pos = torch.arange(T)
        g.compare(f"{T} positions, d_model={d}", g.call(fn, pos, d), sinusoidal_table(pos, d), atol=TOL)
    return g.result()


def check_alibi_slopes(fn) -> CheckResult:
    g = Grader("check_alibi_slopes")
    for n in (1, 4, 8, 12, 6):  # powers of two first, then the interleaved rule
        g.compare(f"{n} heads", g.call(fn, n), alibi_slopes(n), atol=1e-7)
    return g.result()


def check_rope(fn) -> CheckResult:
    g = Grader("check_rope")
    for (B, H, T, D), start, base in (
        ((1, 1, 3, 2), 0, 10000.0),
        ((2, 3, 5, 8), 7, 10000.0),
        ((1, 2, 9, 16), 0, 500.0),
    ):
        x = torch.randn(B, H, T, D, generator=_gen(T))
        pos = torch.arange(start, start + T)
        cos, sin = rope_cos_sin(pos, D, base)
        case = f"x of shape {(B, H, T, D)}, positions from {start}, base {base}"
        g.compare(case, g.call(fn, x, pos, base), apply_rope(x, cos, sin), atol=TOL)
    return g.result()


def check_layernorm(fn) -> CheckResult:
    g = Grader("check_layernorm")
    for shape, eps in (((2, 8), 1e-5), ((3, 4, 16), 1e-12)):
        x = torch.randn(*shape, generator=_gen(1)) * 3 + 1
        ref = LayerNorm(shape[-1], eps)
        w, b = torch.randn(shape[-1], generator=_gen(2)), torch.randn(shape[-1], generator=_gen(3))
        ref.weight.data, ref.bias.data = w, b
        g.compare(f"x of shape {shape}, eps={eps}", g.call(fn, x, w, b, eps), ref(x).detach(), atol=TOL)
    return g.result()


def check_rmsnorm(fn) -> CheckResult:
    g = Grader("check_rmsnorm")
    for shape, eps in (((2, 8), 1e-6), ((3, 4, 16), 1e-5)):
        x = torch.randn(*shape, generator=_gen(1)) * 3 + 1
        ref = RMSNorm(shape[-1], eps)
        ref.weight.data = torch.randn(shape[-1], generator=_gen(2))
        got = g.call(fn, x, ref.weight.data, eps)
        if isinstance(got, torch.Tensor) and got.shape == x.shape:
            centred = LayerNorm(shape[-1], eps, bias=False)
            centred.weight.data = ref.weight.data
            if torch.allclose(got, centred(x).detach(), atol=TOL):
                g.expect(
                    f"x of shape {shape}", False, "you subtracted the mean: that is LayerNorm; RMSNorm only rescales"
                )
        g.compare(f"x of shape {shape}, eps={eps}", got, ref(x).detach(), atol=TOL)
    return g.result()


def check_swiglu(fn) -> CheckResult:
    g = Grader("check_swiglu")
    for d, d_ff in ((4, 6), (16, 40)):
        x = torch.randn(2, 3, d, generator=_gen(d))
        wg, wu = torch.randn(d_ff, d, generator=_gen(1)), torch.randn(d_ff, d, generator=_gen(2))
        wd = torch.randn(d, d_ff, generator=_gen(3))
        expected = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
        g.compare(
            f"d_model={d}, d_ff={d_ff}", g.call(fn, x, wg, wu, wd), expected, atol=1e-4
        )  # sums of ~40 O(10) terms
    return g.result()


def check_causal_mask(fn) -> CheckResult:
    g = Grader("check_causal_mask")
    for t_q, t_k in ((1, 1), (4, 4), (1, 6), (3, 7)):  # the last two: decoding with a cache
        g.compare(f"{t_q} queries, {t_k} keys", g.call(fn, t_q, t_k), causal_mask(t_q, t_k))
    return g.result()


def check_gqa_attention(fn) -> CheckResult:
    g = Grader("check_gqa_attention")
    for H, H_kv, causal in ((4, 4, False), (4, 2, True), (6, 1, True), (6, 3, False)):
        q = torch.randn(2, H, 5, 8, generator=_gen(H))
        k, v = torch.randn(2, H_kv, 5, 8, generator=_gen(1)), torch.randn(2, H_kv, 5, 8, generator=_gen(2))
        case = f"{H} query heads, {H_kv} key/value heads, causal={causal}"
        g.compare(case, g.call(fn, q, k, v, causal), math_attention(q, k, v, causal, None), atol=TOL)
    return g.result()


def check_kv_cache_bytes(fn) -> CheckResult:
    g = Grader("check_kv_cache_bytes")
    cases = [(2, 4, 8, 16, 1, 4), (32, 32, 128, 4096, 1, 2), (80, 8, 128, 4096, 8, 2)]  # toy, Llama-2 7B, 70B (GQA)
    for args in cases:
        g.compare(
            f"layers, kv heads, head dim, tokens, batch, bytes = {args}", g.call(fn, *args), kv_cache_bytes(*args)
        )
    return g.result()


def check_flops_per_token(fn) -> CheckResult:
    g = Grader("check_flops_per_token")
    for n, layers, T, d in ((1_000, 2, 16, 8), (85_000_000, 12, 1024, 768), (175e9, 96, 2048, 12288)):
        expected = float(6 * n + 12 * layers * T * d)
        g.compare(f"N={n:g}, {layers} layers, T={T}, d={d}", g.call(fn, n, layers, T, d), expected, rtol=1e-9)
    return g.result()
