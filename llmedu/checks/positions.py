"""Graders for lesson 02 (position encodings): each runs a learner's function on a few cases and compares
it with ``llmedu.nn.positions``. Importable from ``llmedu.checks.nn`` too, with the other graders of lessons 02-05.

    check_sinusoidal(fn)            fn(positions (T,), d_model) -> (T, d_model) table
    check_alibi_slopes(fn)          fn(n_heads) -> (n_heads,) slopes
    check_rope(fn)                  fn(x (B, H, T, D), positions (T,), base) -> x rotated ("rotate half" layout)

Understanding, not retyping the code shown:
    check_sinusoid_wavelength(fn)   fn(i, d_model, base) -> wavelength, in positions, of channel pair i
    check_rope_relative(fn)         fn(q (D,), k (D,), offset, base) -> RoPE score of q at p and k at p - offset
    check_rope_interpolation(fn)    fn(positions (T,), head_dim, train_len, target_len) -> (cos, sin) of PI
    check_rope_layout(fn)           fn(w (H*D, d_model), n_heads) -> w's rows reordered from the interleaved
                                    RoPE layout (pairs 2i, 2i+1) to the rotate-half one (pairs i, i + D/2)
"""

from __future__ import annotations

import math

import torch

from ..nn.positions import alibi_slopes, apply_rope, rope_cos_sin, sinusoidal_table
from .core import CheckResult, Grader

__all__ = [
    "check_sinusoidal",
    "check_alibi_slopes",
    "check_rope",
    "check_sinusoid_wavelength",
    "check_rope_relative",
    "check_rope_interpolation",
    "check_rope_layout",
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


def check_sinusoid_wavelength(fn) -> CheckResult:
    """Channels 2i and 2i+1 of the table repeat every 2*pi*base^(2i/d) positions."""
    g = Grader("check_sinusoid_wavelength")
    for i, d, base in ((0, 64, 10000.0), (1, 64, 10000.0), (16, 64, 10000.0), (31, 64, 10000.0), (3, 8, 100.0)):
        expected = 2 * math.pi * base ** (2 * i / d)
        got = g.call(fn, i, d, base)
        if isinstance(got, (int, float)) and math.isclose(got, expected / (2 * math.pi), rel_tol=1e-6):
            g.expect(f"pair {i}, d_model={d}", False, "that is 1 / frequency: a full period of sin is 2*pi radians")
        g.compare(f"channel pair {i}, d_model={d}, base={base}", got, expected, rtol=1e-6)  # float64 formula
    return g.result()


def _rope_at(x: torch.Tensor, position: int, base: float) -> torch.Tensor:  # (D,) rotated to `position`
    cos, sin = rope_cos_sin(torch.tensor([position]), x.shape[-1], base)
    return apply_rope(x[None, None, None], cos, sin)[0, 0, 0]


def check_rope_relative(fn) -> CheckResult:
    """``fn(q, k, offset, base)``: the score of q at any p with k at p - offset, computed from the offset only."""
    g = Grader("check_rope_relative")
    for D, offset, base in ((4, 3, 10000.0), (16, 1, 10000.0), (16, 40, 100.0), (32, -5, 10000.0)):
        q, k = torch.randn(D, generator=_gen(D)), torch.randn(D, generator=_gen(D + 1))
        got = g.call(fn, q.clone(), k.clone(), offset, base)
        for p in (abs(offset), abs(offset) + 97):  # the same answer must hold wherever the pair sits
            expected = (_rope_at(q, p, base) * _rope_at(k, p - offset, base)).sum()
            # fp32 sums of D products of O(1) values: ~1e-6; 1e-4 relative leaves room for another order
            g.compare(f"D={D}, offset={offset}, base={base}, query at {p}", got, expected.item(), rtol=1e-4, atol=1e-4)
    return g.result()


def check_rope_interpolation(fn) -> CheckResult:
    """Position interpolation (Chen et al. 2023): positions squeezed by train_len / target_len, base unchanged."""
    g = Grader("check_rope_interpolation")
    for T, D, train_len, target_len in ((8, 4, 4, 8), (64, 16, 16, 64), (10, 8, 128, 128)):
        pos = torch.arange(T)
        expected = rope_cos_sin(pos.float() * (train_len / target_len), D)
        case = f"{T} positions, head_dim={D}, trained at {train_len}, used at {target_len}"
        g.compare(case, g.call(fn, pos, D, train_len, target_len), expected, atol=TOL)
    return g.result()


def _rope_interleaved(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Meta's original Llama layout: channels (2i, 2i+1) of x (B, H, T, D) are one complex number, turned by p*theta_i."""
    D = x.shape[-1]
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    turn = torch.polar(torch.ones(len(positions), D // 2, dtype=torch.float64), positions[:, None] * theta)  # (T, D/2)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], D // 2, 2).contiguous())  # (B, H, T, D/2)
    return torch.view_as_real(pairs * turn).reshape(x.shape)


def _scores(w_q, w_k, x, n_heads, rope):  # x (T, d_model) -> (H, T, T) attention scores after RoPE
    T = x.shape[0]
    q = (x @ w_q.T).reshape(T, n_heads, -1).transpose(0, 1)[None]  # (1, H, T, D)
    k = (x @ w_k.T).reshape(T, n_heads, -1).transpose(0, 1)[None]
    q, k = rope(q), rope(k)
    return (q @ k.transpose(-1, -2))[0]


def check_rope_layout(fn) -> CheckResult:
    """``fn(w, n_heads)``: the query/key weight of a checkpoint trained with interleaved RoPE, reordered so that
    ``apply_rope`` (rotate-half layout, as in ``transformers``) gives the same attention scores.
    The scores are compared at 12 positions, so a reordering that only keeps q.k at offset 0 fails."""
    g = Grader("check_rope_layout")
    for n_heads, D, d_model in ((1, 4, 8), (1, 16, 16), (4, 8, 32), (2, 16, 24)):
        w_q = torch.randn(n_heads * D, d_model, generator=_gen(D + n_heads), dtype=torch.float64)
        w_k = torch.randn(n_heads * D, d_model, generator=_gen(D + n_heads + 1), dtype=torch.float64)
        x = torch.randn(12, d_model, generator=_gen(d_model), dtype=torch.float64)
        pos = torch.arange(12)
        cos, sin = rope_cos_sin(pos, D)
        expected = _scores(w_q, w_k, x, n_heads, lambda t: _rope_interleaved(t, pos))
        new_q, new_k = g.call(fn, w_q.clone(), n_heads), g.call(fn, w_k.clone(), n_heads)
        case = f"{n_heads} head(s) of {D} channels, d_model={d_model}"
        if not g.expect(
            case,
            isinstance(new_q, torch.Tensor) and new_q.shape == w_q.shape,
            f"expected a tensor of shape {tuple(w_q.shape)}, got {getattr(new_q, 'shape', type(new_q))}",
        ):
            break
        rows = torch.sort(new_q.reshape(-1)).values.equal(torch.sort(w_q.reshape(-1)).values)
        g.expect(case, rows, "the answer must reorder the weight's entries, not change them")
        got = _scores(new_q.double(), new_k.double(), x, n_heads, lambda t: apply_rope(t, cos.double(), sin.double()))
        whole = torch.cat([torch.arange(0, n_heads * D, 2), torch.arange(1, n_heads * D, 2)])  # heads ignored
        if n_heads > 1 and isinstance(new_q, torch.Tensor) and new_q.equal(w_q[whole]):
            g.expect(case, False, "the rows were reordered across heads: each head's D rows are reordered alone")
        # rope_cos_sin's angles are float32 (~1e-7 relative) on scores up to ~100: 1e-4 leaves room
        g.compare(f"{case}: scores of positions 0-11 after RoPE", got, expected, rtol=1e-5, atol=1e-4)
    return g.result()
