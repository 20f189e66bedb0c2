"""Graders for lessons 02-05 (the transformer's parts): each runs a learner's function on a few cases
and compares it with ``llmedu.nn`` / ``llmedu.models``. Lesson 02's position-encoding graders
(``check_sinusoidal``, ``check_alibi_slopes``, ``check_rope`` and the three below) are written in
``llmedu.checks.positions`` and importable from here as well.

    check_layernorm(fn)         fn(x, weight, bias, eps) -> normalised x
    check_rmsnorm(fn)           fn(x, weight, eps) -> normalised x
    check_swiglu(fn)            fn(x, w_gate, w_up, w_down) -> FFN output; weights are (out, in) like nn.Linear
    check_causal_mask(fn)       fn(t_q, t_k) -> (t_q, t_k) bool, True where a query may look
    check_gqa_attention(fn)     fn(q (B, H, T, D), k, v (B, H_kv, T, D), causal) -> (B, H, T, D)
    check_kv_cache_bytes(fn)    fn(n_layers, n_kv_heads, head_dim, seq_len, batch, bytes_per_value) -> int
    check_flops_per_token(fn)   fn(n_params, n_layers, seq_len, d_model) -> training FLOPs per token

Lesson 02 (understanding, not retyping the code shown): check_sinusoid_wavelength, check_rope_relative,
check_rope_interpolation, in ``positions``.
Lesson 03:
    check_glu_width(fn)             fn(d_ff) -> SwiGLU hidden width with a plain FFN's parameters
    check_fixed_layernorm(fn)       fn(x (B, T, d), weight, bias, eps) -> LayerNorm(x): the lesson's buggy one fixed
    check_rmsnorm_as_layernorm(fn)  fn(x) -> x' such that RMSNorm(x') == LayerNorm(x) (no bias)
    check_depth_gradient_ratio(fn)  fn(placement, L_small, L_large) -> Xiong et al.'s last-layer gradient ratio
Lesson 04:
    check_gqa_from_mha(fn)          fn(w (H*D, d), n_heads, n_kv_heads) -> (H_kv*D, d), heads mean-pooled per group
    check_decode_speedup(fn)        fn(weight_bytes, mha_cache_bytes, n_heads, n_kv_heads) -> memory-bound speed-up
Lesson 05: check_llama_flops, written in ``llmedu.checks.models`` with the lesson's other graders.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..nn.attention import causal_mask, kv_cache_bytes, math_attention
from ..nn.norms import LayerNorm, RMSNorm
from .core import CheckResult, Grader
from .positions import (  # lesson 02's graders, in a module of their own
    check_alibi_slopes,
    check_rope,
    check_rope_interpolation,
    check_rope_relative,
    check_sinusoid_wavelength,
    check_sinusoidal,
)

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
    "check_sinusoid_wavelength",
    "check_rope_relative",
    "check_rope_interpolation",
    "check_glu_width",
    "check_rmsnorm_as_layernorm",
    "check_depth_gradient_ratio",
    "check_fixed_layernorm",
    "check_gqa_from_mha",
    "check_decode_speedup",
    "check_llama_flops",
]

# float32 results of the same formula computed in another order agree to ~1e-6; 1e-5 leaves room
TOL = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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


# -- lesson 03 ---------------------------------------------------------------------------------------
def check_glu_width(fn) -> CheckResult:
    """``fn(d_ff)``: the integer width h whose 3 matrices hold the parameters of 2 matrices of width d_ff."""
    g = Grader("check_glu_width")
    for d_ff in (3, 256, 1024, 3072, 11008 * 3 // 2):
        # 3 d h against 2 d d_ff parameters: 2 d_ff / 3, rounded down (as glu_hidden_size and Llama's int() do)
        # or to the nearest integer; both keep the parameter count within one column of the plain FFN's
        got, exact = g.call(fn, d_ff), 2 * d_ff / 3
        g.expect(
            f"d_ff = {d_ff}",
            got in {math.floor(exact), round(exact)} and isinstance(got, int) and not isinstance(got, bool),
            f"got {got!r}; expected 2 d_ff / 3 = {exact:g} as an integer ({math.floor(exact)} or {round(exact)})",
        )
    return g.result()


def check_rmsnorm_as_layernorm(fn) -> CheckResult:
    """``fn(x)`` returns x' with RMSNorm(x') equal to LayerNorm(x), same gain, no bias."""
    g = Grader("check_rmsnorm_as_layernorm")
    # a large mean (centring matters), then a spread of 1e-3 (eps = 1e-5 is not negligible against the
    # variance: an x' that is already normalised, such as LayerNorm(x) itself, is then scaled by RMSNorm again)
    for shape, spread in (((2, 8), 2.0), ((3, 5, 32), 2.0), ((4, 16), 1e-3)):
        x = torch.randn(*shape, generator=_gen(5)) * spread + 3
        rms, ln = RMSNorm(shape[-1], eps=1e-5), LayerNorm(shape[-1], eps=1e-5, bias=False)
        ln.weight.data = rms.weight.data = torch.randn(shape[-1], generator=_gen(6))
        got = g.call(fn, x.clone())
        if isinstance(got, torch.Tensor) and got.shape == x.shape:
            got = rms(got).detach()
        g.compare(f"x of shape {shape}: RMSNorm(fn(x)) vs LayerNorm(x)", got, ln(x).detach(), atol=TOL)
    return g.result()


def check_depth_gradient_ratio(fn) -> CheckResult:
    """Xiong et al. (2020), theorem 1: pre-LN's gradients scale like 1/sqrt(L), post-LN's last layer's not."""
    g = Grader("check_depth_gradient_ratio")
    for placement, small, large in (("pre", 6, 24), ("post", 6, 24), ("pre", 2, 50), ("post", 12, 48)):
        expected = math.sqrt(large / small) if placement == "pre" else 1.0
        case = f"{placement}-LN, ||grad|| at {small} layers / at {large} layers"
        g.compare(case, g.call(fn, placement, small, large), expected, rtol=1e-6)
    return g.result()


class _OpNames(TorchDispatchMode):
    """Records the name of every ATen op run inside the block (``aten.native_layer_norm`` -> ``native_layer_norm``)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# a library norm does the exercise's work: F.layer_norm, torch.layer_norm and nn.LayerNorm all run the first
_LIBRARY_NORMS = ("native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit")

# F.rms_norm runs as elementwise ATen ops on CPU, unseen above: so catch the norms where Python calls them too
_PYTHON_NORMS = (F.rms_norm, torch.rms_norm, F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm)


class _NormCalls(TorchFunctionMode):
    """Records the name of every library norm called from Python inside the block (``nn.RMSNorm``'s too)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if any(func is f for f in _PYTHON_NORMS):
            self.names.add(func.__name__)
        return func(*args, **(kwargs or {}))


def check_fixed_layernorm(fn) -> CheckResult:
    """``fn(x (B, T, d), weight, bias, eps)``: LayerNorm of each token on its own, with the biased variance.

    The lesson's buggy version takes its statistics over a whole sequence (every token sees the later ones
    through the mean and variance) and uses ``torch.var``'s default, the unbiased variance (divides by n - 1).
    The fix is written out: each call's library norms (``F.layer_norm``, ``nn.LayerNorm``, ``F.rms_norm`` of the
    centred input, group or batch norm) are recorded, in Python and as ATen ops, and fail.
    """
    g = Grader("check_fixed_layernorm")
    for (B, T, d), eps in (((2, 6, 8), 1e-5), ((1, 5, 4), 1e-5), ((3, 4, 16), 1e-12)):
        gen = _gen(d)
        # tokens of different offsets and scales: statistics shared between tokens give other answers
        x = torch.randn(B, T, d, generator=gen) * (0.5 + 3 * torch.rand(B, T, 1, generator=gen))
        x = x + 4 * torch.randn(B, T, 1, generator=gen)
        w, b = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
        ref = LayerNorm(d, eps)
        ref.weight.data, ref.bias.data = w, b
        expected = ref(x).detach()
        case = f"x of shape {(B, T, d)}, eps={eps}"
        with _OpNames() as recorder, _NormCalls() as python_calls:
            got = g.call(fn, x.clone(), w, b, eps)
        library = sorted(python_calls.names | recorder.names.intersection(_LIBRARY_NORMS))
        if library:
            g.expect(case, False, f"your function calls a library norm ({library[0]}): write the mean and variance out")
        if isinstance(got, torch.Tensor) and got.shape == x.shape:
            moved = x.clone()
            moved[0, -1] = moved[0, -1] * 3 + 5  # change only the last token of the first sequence
            other = g.call(fn, moved, w, b, eps)
            if isinstance(other, torch.Tensor) and other.shape == x.shape:
                changed = (other - got).abs().amax(-1)  # (B, T): how much each token's output moved
                changed[0, -1] = 0.0
                if (changed > TOL).any():
                    where = tuple(int(i) for i in torch.nonzero(changed > TOL)[0])
                    g.expect(
                        case,
                        False,
                        f"changing only the last token of sequence 0 changed the output of token {where[1]} of "
                        f"sequence {where[0]}: your statistics mix tokens, where LayerNorm normalises each token's d "
                        "features on its own (over a sequence, later tokens leak into earlier positions of a "
                        "causal LM; over the batch, sequences into each other)",
                    )
            centred = x - x.mean(-1, keepdim=True)
            unbiased = centred / torch.sqrt(x.var(-1, keepdim=True, unbiased=True) + eps) * w + b
            if torch.allclose(got, unbiased, atol=TOL):
                g.expect(
                    case,
                    False,
                    "you divide the variance by d - 1 (torch.var's default, unbiased=True); LayerNorm's sigma^2 "
                    "is the mean of the squared deviations, a division by d",
                )
        g.compare(case, got, expected, atol=TOL)
        if isinstance(got, torch.Tensor) and got.shape == x.shape:
            # statistics kept from an earlier call (BatchNorm's running statistics) leave the other tokens
            # alone but normalise the changed one wrongly: its output must be LayerNorm's too
            g.compare(f"{case}, after changing the last token", other, ref(moved).detach(), atol=TOL)
    return g.result()


# -- lesson 04 ---------------------------------------------------------------------------------------
def check_gqa_from_mha(fn) -> CheckResult:
    """Ainslie et al. (2023), sec. 2.1: mean-pool the heads of each group; group j serves query heads j*g..j*g+g-1."""
    g = Grader("check_gqa_from_mha")
    for H, H_kv, D, d in ((4, 2, 3, 8), (8, 1, 2, 4), (6, 3, 4, 5), (4, 4, 2, 3)):
        w = torch.randn(H * D, d, generator=_gen(H * D))
        expected = w.view(H_kv, H // H_kv, D, d).mean(1).reshape(H_kv * D, d)  # consecutive heads, as repeat_kv
        g.compare(f"{H} heads of {D} -> {H_kv} key/value heads", g.call(fn, w.clone(), H, H_kv), expected, atol=TOL)
    return g.result()


def check_decode_speedup(fn) -> CheckResult:
    """A memory-bound decoding step reads every weight and the whole cache: time ~ bytes read."""
    g = Grader("check_decode_speedup")
    cases = [
        (140e9, 2 * 80 * 64 * 128 * 4096 * 2, 64, 8),  # Llama-2 70B shape, one 4096-token sequence
        (140e9, 2 * 80 * 64 * 128 * 4096 * 2 * 64, 64, 1),  # 64 such sequences, MQA
        (1e9, 1e6, 16, 16),  # MHA against itself
    ]
    for weights, cache, H, H_kv in cases:
        expected = (weights + cache) / (weights + cache * H_kv / H)
        case = f"weights {weights:.3g} B, MHA cache {cache:.3g} B, {H} heads -> {H_kv} KV heads"
        g.compare(case, g.call(fn, weights, cache, H, H_kv), expected, rtol=1e-6)
    return g.result()


# -- lesson 05 ---------------------------------------------------------------------------------------
# check_llama_flops lives with the lesson's other graders, in llmedu.checks.models; importable from here too.
from .models import check_llama_flops, llama_matmul_parameters  # noqa: E402, F401
