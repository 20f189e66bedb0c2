"""Where a token is: six ways of telling attention about order.

Attention is a set operation; without positions "dog bites man" and "man bites dog" look alike.
The encodings below fall in three families:

* added to the token embeddings (absolute):
  - sinusoidal (Vaswani et al. 2017, sec. 3.5):  PE[p, 2i] = sin(p / 10000^(2i/d)),
    PE[p, 2i+1] = cos(p / 10000^(2i/d));
  - scaled sinusoidal (Geiping & Goldstein 2022, "Cramming"): the same table times one learned
    scalar, initialised to 1/sqrt(d);
  - learned (BERT, GPT-2): one trained vector per position, so no position past the table exists;
* added to the attention scores (relative):
  - T5's relative position bias (Raffel et al. 2020, sec. 2.1): one learned scalar per head and per
    bucket of distance j - i; buckets are exact for small distances and logarithmic up to
    ``max_distance``;
  - ALiBi (Press et al. 2022): no parameters, the bias is -m_h * |i - j| with a geometric sequence of
    slopes m_h, one per head;
* rotating queries and keys:
  - RoPE (Su et al. 2021): pairs of channels are rotated by the angle p * theta_i, so that
    q_p . k_r depends on p - r only. We pair channel c with channel c + D/2 ("rotate half"), the
    layout of the Llama weights in ``transformers``; the paper pairs neighbours (2i, 2i + 1), which
    is the same rotation with the channels permuted.

Left out: NTK/YaRN scaling of RoPE for longer contexts, and xPos.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = [
    "sinusoidal_table",
    "SinusoidalPositions",
    "ScaledSinusoidalPositions",
    "LearnedPositions",
    "relative_position_bucket",
    "RelativePositionBias",
    "alibi_slopes",
    "ALiBi",
    "rope_cos_sin",
    "rotate_half",
    "apply_rope",
]


# -- absolute: added to the embeddings ---------------------------------------------------------------
def sinusoidal_table(positions: torch.Tensor, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """(T,) integer positions -> (T, d_model): sin on even channels, cos on odd ones."""
    if d_model % 2:
        raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
    inv_freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float32, device=positions.device) / d_model)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, d/2)
    table = torch.empty(len(positions), d_model, device=positions.device)
    table[:, 0::2] = angles.sin()
    table[:, 1::2] = angles.cos()
    return table  # (T, d)


class SinusoidalPositions(nn.Module):
    """Fixed sinusoids: no parameters and no maximum length (extrapolating well is another matter)."""

    def __init__(self, d_model: int, base: float = 10000.0):
        super().__init__()
        self.d_model, self.base = d_model, base

    def forward(self, positions: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, d)
        return sinusoidal_table(positions, self.d_model, self.base)


class ScaledSinusoidalPositions(SinusoidalPositions):
    """Cramming's variant: the sinusoids times a learned scalar that starts at 1/sqrt(d)."""

    def __init__(self, d_model: int, base: float = 10000.0):
        super().__init__(d_model, base)
        self.scale = nn.Parameter(torch.tensor(d_model**-0.5))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, d)
        return self.scale * sinusoidal_table(positions, self.d_model, self.base)


class LearnedPositions(nn.Module):
    """One trained vector per position (BERT, GPT-2): a lookup table of ``max_len`` rows."""

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(torch.zeros(max_len, d_model))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, d)
        if len(positions) and int(positions.max()) >= self.max_len:
            raise ValueError(
                f"position {int(positions.max())} is past the learned table of {self.max_len} positions: "
                "learned absolute positions cannot extrapolate; shorten the input or use rope/alibi"
            )
        return self.weight[positions]


# -- relative: added to the attention scores ----------------------------------------------------------
def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """T5's bucketing of ``relative_position = key_pos - query_pos`` into ``num_buckets`` integers.

    Half the buckets (per direction) hold exact distances 0, 1, 2, ...; the rest cover distances up
    to ``max_distance`` on a log scale; farther ones share the last bucket.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets  # keys to the right: upper half
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # only the past is visible
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    far = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, far)


class RelativePositionBias(nn.Module):
    """A learned scalar per (bucket of j - i, head), added to the scores: (1, H, Tq, Tk)."""

    def __init__(self, n_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__()
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.weight = nn.Parameter(torch.zeros(num_buckets, n_heads))

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        relative = k_pos[None, :] - q_pos[:, None]  # (Tq, Tk)
        bucket = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self.weight[bucket].permute(2, 0, 1).unsqueeze(0)  # (Tq, Tk, H) -> (1, H, Tq, Tk)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's head slopes: 2^(-8/n), 2^(-16/n), ... for n a power of two.

    Otherwise the slopes of the nearest smaller power of two, followed by every other slope of
    twice that many heads (the rule of the paper's code and of BLOOM).
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be positive, got {n_heads}")
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = [2 ** (-8 * (i + 1) / closest) for i in range(closest)]
    extra = [2 ** (-8 * (i + 1) / (2 * closest)) for i in range(0, 2 * (n_heads - closest), 2)]
    return torch.tensor(slopes + extra)  # (H,)


class ALiBi(nn.Module):
    """Attention with Linear Biases: score(i, j) += -m_h * |i - j|, no parameters."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        distance = (q_pos[:, None] - k_pos[None, :]).abs().float()  # (Tq, Tk)
        return -(self.slopes[:, None, None] * distance).unsqueeze(0)  # (1, H, Tq, Tk)


# -- rotary: applied to queries and keys ---------------------------------------------------------------
def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) positions -> cos, sin of shape (T, head_dim): angle p * base^(-2i/D), repeated per half."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D): channel c and c + D/2 share an angle
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension: a 90 degree turn per pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_c, x_{c+D/2}) of x (B, H, T, D) by its angle; cos, sin are (T, D)."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)
