"""llmedu.kernels.flash_attention against PyTorch's scaled_dot_product_attention.

Tolerances: fp32 results must agree within 1e-5 (absolute, on values of order one). Both sides
compute the same sums in fp32, only in a different order (tile by tile, with rescaling), so the
difference is a few ulps times sqrt(number of terms): ~1e-6 at these sizes. In bf16 the question is
not agreement with SDPA but accuracy: our error against an fp32 reference may be at most twice that
of a straightforward bf16 implementation.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from llmedu.kernels import flash_attention
from llmedu.nn.attention import causal_mask, get_attention, math_attention

ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: see conftest.py


def reference(q, k, v, causal=False, attn_mask=None):
    """SDPA with the same conventions: GQA by repetition, causal aligned bottom-right."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    bias = torch.zeros(q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype=q.dtype)
    if attn_mask is not None:
        bias = bias.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else bias + attn_mask
    if causal:
        bias = bias.masked_fill(~causal_mask(q.shape[2], k.shape[2]), -math.inf)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def inputs(B, H, Hkv, Tq, Tk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
    return make(B, H, Tq, D), make(B, Hkv, Tk, D), make(B, Hkv, Tk, D)


def forward_backward(fn, q, k, v, **kw):
    out = fn(q, k, v, **kw)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(
        out.dtype
    )  # same values in any dtype
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


CASES = {  # name: (B, H, Hkv, Tq, Tk, D, causal, block_size)
    "square": (2, 4, 4, 64, 64, 16, False, 16),
    "square causal": (2, 4, 4, 64, 64, 16, True, 16),
    "odd lengths": (1, 2, 2, 37, 53, 8, False, 16),
    "odd lengths causal, Tq < Tk": (1, 2, 2, 37, 53, 8, True, 16),
    "one query (decoding)": (2, 2, 2, 1, 45, 8, True, 16),
    "GQA 8 -> 2": (2, 8, 2, 33, 33, 16, True, 8),
    "MQA 4 -> 1, Tq > Tk": (1, 4, 1, 50, 21, 8, False, 16),
    "tile larger than the sequence": (1, 2, 2, 7, 7, 8, True, 128),
}


@pytest.mark.parametrize("name", CASES)
def test_forward_and_backward_match_sdpa(name):
    B, H, Hkv, Tq, Tk, D, causal, block = CASES[name]
    q, k, v = inputs(B, H, Hkv, Tq, Tk, D)
    ours = forward_backward(flash_attention, q, k, v, causal=causal, block_size=block)
    ref = forward_backward(reference, q, k, v, causal=causal)
    for what, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m: f"{name}, {what}: {m}")


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask_and_additive_bias(causal):
    B, H, T, D = 3, 4, 29, 8
    q, k, v = inputs(B, H, 2, T, T, D)
    lengths = torch.tensor([29, 17, 5])
    keep = (torch.arange(T)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, Tk) bool
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])[None, :, None, None]  # an ALiBi-like bias
    bias = -slopes * (torch.arange(T)[None, :] - torch.arange(T)[:, None]).abs()  # (1, H, T, T)
    for mask in (keep, bias):
        ours = forward_backward(flash_attention, q, k, v, causal=causal, block_size=8, attn_mask=mask)
        ref = forward_backward(reference, q, k, v, causal=causal, attn_mask=mask)
        for what, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m: f"{mask.dtype} mask, {what}: {m}")


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    q, k, v = inputs(1, 2, 2, 6, 6, 4)
    keep = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    keep[..., 2, :] = False  # query 2 may see nothing
    out, dq, dk, dv = forward_backward(flash_attention, q, k, v, block_size=4, attn_mask=keep)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert torch.equal(dq[:, :, 2], torch.zeros_like(dq[:, :, 2]))


def test_gradcheck_in_float64():
    """Finite differences, independent of any reference implementation."""
    q, k, v = inputs(1, 4, 2, 7, 9, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal=True, block_size=4), (q, k, v))


def test_bf16_error_at_most_twice_that_of_naive_bf16():
    q, k, v = inputs(2, 4, 2, 200, 200, 32)
    exact = forward_backward(reference, q.double(), k.double(), v.double(), causal=True)
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    ours = forward_backward(flash_attention, *low, causal=True, block_size=64)
    naive = forward_backward(lambda q, k, v, causal: math_attention(q, k, v, causal, None), *low, causal=True)
    for what, e, a, b in zip(("out", "dq", "dk", "dv"), exact, ours, naive):
        err_ours, err_naive = (a.double() - e).abs().max().item(), (b.double() - e).abs().max().item()
        assert err_ours <= 2 * err_naive, (
            f"{what}: flash bf16 error {err_ours:.3g} > 2 x naive bf16 error {err_naive:.3g}"
        )


def saved_for_backward(fn, *args, **kw):
    """Every tensor autograd keeps for the backward pass of ``fn(*args)``."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*args, **kw)
    return out, saved


def test_only_the_logsumexp_is_saved_beyond_inputs_and_output():
    B, H, T, D = 1, 2, 96, 8
    q, k, v = inputs(B, H, 2, T, T, D)
    out, saved = saved_for_backward(flash_attention, q, k, v, causal=True, block_size=32)
    known = {t.data_ptr() for t in (q, k, v, out)}
    extra = [t for t in saved if t.data_ptr() not in known]
    assert [tuple(t.shape) for t in extra] == [(B, H, T)], "only the logsumexp (B, H, T) may be saved"
    # the oracle can fail: the naive implementation saves (B, H, T, T) probabilities
    _, naive = saved_for_backward(math_attention, q, k, v, True, None)
    assert max(t.numel() for t in naive) >= B * H * T * T


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_causal_tiles_above_the_diagonal_are_skipped():
    q, k, v = inputs(1, 1, 1, 64, 64, 4)
    with torch.no_grad():
        with CountOps() as full:
            flash_attention(q, k, v, causal=False, block_size=16)
        with CountOps() as causal:
            flash_attention(q, k, v, causal=True, block_size=16)
    # one row maximum (amax) per computed tile: 4 x 4 tiles, of which 4 + 3 + 2 + 1 are causal
    assert full.counts["amax"] == 16 and causal.counts["amax"] == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, D, block", [(256, 16, 64), (300, 8, 64), (100, 4, 128)])
def test_hbm_traffic_counted_as_the_kernel_runs_matches_the_loop(T, D, block, dtype):
    """FlashAttention-2's loops, read off the code: forward reads Q once and K, V once per query tile and
    writes O and the fp32 logsumexp once; backward reads K, V once and Q, dO, L, D_i once per key tile,
    adds into the fp32 dQ (a read and a write) once per key tile. Standard attention: 4 T D + 4 T^2."""
    from llmedu.kernels.traffic import counting, standard_attention

    e, n = torch.finfo(dtype).bits // 8, math.ceil(T / block)
    q, k, v = inputs(1, 1, 1, T, T, D, dtype=dtype)
    with counting() as fwd:
        out = flash_attention(q, k, v, block_size=block)
    with counting() as bwd:
        out.backward(torch.ones_like(out))
    with counting() as std:
        standard_attention(q.detach(), k.detach(), v.detach())
    assert (fwd.read, fwd.written) == ((T * D + 2 * T * D * n) * e, T * D * e + 4 * T)
    prologue = 2 * T * D * e + 4 * T  # dO and O read, D_i written
    per_pair = n * (2 * T * D * e + 2 * 4 * T + 2 * 4 * T * D)  # Q, dO, L, D_i read; dQ (fp32) read and written
    assert bwd.total == prologue + 2 * T * D * e + per_pair + 2 * T * D * e + 4 * T * D + T * D * e
    assert std.total == (4 * T * D + 4 * T * T) * e


def test_traffic_counters_nest_and_close():
    from llmedu.kernels.traffic import counting, load

    x = torch.zeros(10)
    with counting() as outer:
        load(x)
        with pytest.raises(RuntimeError), counting() as inner:
            load(x)
            raise RuntimeError
        load(x)
    load(x)  # no counter open: nothing counted anywhere
    assert (outer.read, inner.read) == (120, 40)


def test_largest_temporary_is_a_tile_for_flash_and_the_score_matrix_for_naive():
    from llmedu.kernels.traffic import largest_temporary, standard_attention

    q = torch.randn(1, 1, 512, 16)
    for block in (32, 128):
        n, shape, _ = largest_temporary(lambda q: flash_attention(q, q, q, causal=True, block_size=block), q)
        assert n == block * block, (block, shape)
    assert largest_temporary(lambda q: math_attention(q, q, q, True, None), q)[0] == 512 * 512
    assert largest_temporary(standard_attention, q, q, q)[0] == 512 * 512


def test_registered_as_an_attention_function():
    q, k, v = inputs(2, 4, 2, 20, 20, 8)
    torch.testing.assert_close(
        get_attention("flash")(q, k, v, True, None), reference(q, k, v, causal=True), atol=ATOL, rtol=0
    )


def test_our_gpt_with_flash_attention_matches_sdpa():
    """attn_impl="flash" in the model: same logits and same gradients as with PyTorch's SDPA."""
    from llmedu.models import CausalLM, TransformerConfig
    from llmedu.models.gpt import lm_loss

    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    results = {}
    for impl in ("sdpa", "flash"):
        torch.manual_seed(0)
        model = CausalLM(
            TransformerConfig(
                vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, attn_impl=impl
            )
        )
        logits = model(ids)
        lm_loss(logits, ids).backward()
        results[impl] = (logits, model.transformer.blocks[0].attn.q_proj.weight.grad)
    torch.testing.assert_close(results["flash"][0], results["sdpa"][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(results["flash"][1], results["sdpa"][1], atol=ATOL, rtol=0)


def test_peak_memory_is_linear_not_quadratic():
    """Measured by llmedu.memory.MemoryTracker over forward and backward, naive vs flash."""
    from llmedu.memory import MemoryTracker

    peaks = {}
    for name, fn in (
        ("naive", lambda q, k, v: math_attention(q, k, v, True, None)),
        ("flash", lambda q, k, v: flash_attention(q, k, v, causal=True, block_size=64)),
    ):
        q, k, v = inputs(1, 4, 4, 1024, 1024, 32)
        with MemoryTracker(torch.nn.Module(), device="cpu") as mt:
            fn(q, k, v).sum().backward()
        peaks[name] = mt.peak_bytes
    qkv_bytes = 3 * 4 * 1024 * 32 * 4
    assert peaks["naive"] > 4 * 1024 * 1024 * 4  # at least one (H, T, T) fp32 matrix
    assert peaks["flash"] < peaks["naive"] / 4 and peaks["flash"] < 8 * qkv_bytes, peaks


@pytest.mark.parametrize(
    "shapes, kw, error",
    [
        (((1, 2, 8, 16), (1, 2, 8, 8), (1, 2, 8, 8)), {}, "head dims differ"),
        (((1, 3, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8)), {}, "do not divide"),
        (((1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 9, 8)), {}, "same shape"),
        (((2, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8)), {}, "batch sizes differ"),
        (((1, 2, 8), (1, 2, 8, 8), (1, 2, 8, 8)), {}, "4-D"),
        (((1, 2, 9, 8), (1, 2, 8, 8), (1, 2, 8, 8)), {"causal": True}, "Tq <= Tk"),
        (((1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8)), {"block_size": 0}, "block_size"),
        (
            ((1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8)),
            {"attn_mask": torch.ones(3, 8, dtype=torch.bool)},
            "does not broadcast",
        ),
        (((1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8)), {"attn_mask": torch.ones(8, 8, dtype=torch.long)}, "bool"),
    ],
)
def test_bad_input_is_a_clear_error(shapes, kw, error):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises((ValueError, TypeError), match=error):
        flash_attention(q, k, v, **kw)


# -- the graders of lesson 17 ---------------------------------------------------------------------------
def test_graders_pass_right_answers_and_fail_wrong_ones():
    from llmedu.checks.attention import check_online_logsumexp, check_tiled_attention

    def online_logsumexp(x, block):
        m, l = torch.full(x.shape[:-1], -math.inf), torch.zeros(x.shape[:-1])
        for start in range(0, x.shape[-1], block):
            chunk = x[..., start : start + block]
            m_new = torch.maximum(m, chunk.amax(-1))
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
            l = l * torch.exp(m - m_safe) + torch.exp(chunk - m_safe[..., None]).sum(-1)
            m = m_new
        return m + torch.log(l)

    assert check_online_logsumexp(online_logsumexp)
    overflowing = check_online_logsumexp(lambda x, block: torch.log(torch.exp(x).sum(-1)))
    assert not overflowing and "values near 1000" in overflowing.failure
    assert check_tiled_attention(lambda q, k, v, block: flash_attention(q, k, v, block_size=block))
    unscaled = check_tiled_attention(lambda q, k, v, block: torch.softmax(q @ k.transpose(-2, -1), -1) @ v)
    assert not unscaled and "values differ" in unscaled.failure
