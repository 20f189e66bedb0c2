"""Lesson 02's graders: each passes a right answer, and fails a plausible wrong value and a right value
reached the wrong way (reordering across heads, ignoring the base, rounding interpolated positions)."""

from __future__ import annotations

import torch

from llmedu.checks.positions import check_rope_interpolation, check_rope_layout, check_rope_relative
from llmedu.nn.positions import apply_rope, rope_cos_sin


# -- exercise 1: reorder an interleaved-RoPE checkpoint for the rotate-half layout -----------
def _per_head(w, n_heads):  # rows (2i, 2i+1) of each head -> (i, i + D/2), as transformers' conversion does
    return w.reshape(n_heads, -1, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def test_rope_layout_accepts_the_per_head_reordering():
    assert check_rope_layout(_per_head)


def test_rope_layout_fails_the_weight_unchanged():
    assert not check_rope_layout(lambda w, n_heads: w)


def test_rope_layout_fails_the_inverse_reordering():
    def inverse(w, n_heads):  # (i, i + D/2) -> (2i, 2i+1): the same as the right one at D = 4, not at 16
        D = w.shape[0] // n_heads
        order = torch.argsort(torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)]))
        return w.reshape(n_heads, D, -1)[:, order].reshape(w.shape)

    assert not check_rope_layout(inverse)


def test_rope_layout_fails_a_reordering_across_heads():
    def whole(w, n_heads):  # right with one head, wrong with several
        return w[torch.cat([torch.arange(0, w.shape[0], 2), torch.arange(1, w.shape[0], 2)])]

    assert whole(torch.arange(8.0)[:, None], 1).equal(_per_head(torch.arange(8.0)[:, None], 1))
    result = check_rope_layout(whole)
    assert not result and "across heads" in result.failure


def test_rope_layout_fails_reordering_the_columns():
    assert not check_rope_layout(lambda w, n_heads: _per_head(w.T, 1).T)


# -- exercise 2: a RoPE score from the offset alone -------------------------------------------
def _score(q, k, offset, base):
    cos, sin = rope_cos_sin(torch.tensor([offset, 0]), q.shape[-1], base)
    q_rot = apply_rope(q[None, None, None], cos[:1], sin[:1])
    k_rot = apply_rope(k[None, None, None], cos[1:], sin[1:])
    return (q_rot * k_rot).sum().item()


def test_rope_relative_accepts_the_query_at_the_offset_and_the_key_at_zero():
    assert check_rope_relative(_score)


def test_rope_relative_fails_the_offset_the_wrong_way_round():
    assert not check_rope_relative(lambda q, k, offset, base: _score(q, k, -offset, base))


def test_rope_relative_fails_a_fixed_base():
    # right wherever the base is 10000, the usual value; the grader also asks for base 100
    assert not check_rope_relative(lambda q, k, offset, base: _score(q, k, offset, 10000.0))


# -- exercise 3: position interpolation -------------------------------------------------------
def test_rope_interpolation_accepts_squeezed_positions():
    assert check_rope_interpolation(lambda p, D, tr, tg: rope_cos_sin(p * (tr / tg), D))


def test_rope_interpolation_fails_stretched_positions():
    assert not check_rope_interpolation(lambda p, D, tr, tg: rope_cos_sin(p * (tg / tr), D))


def test_rope_interpolation_fails_rounded_positions():
    # integer division: right wherever target_len == train_len, wrong between the trained positions
    assert not check_rope_interpolation(lambda p, D, tr, tg: rope_cos_sin(p * tr // tg, D))


def test_rope_interpolation_fails_a_larger_base_instead():
    # raising the base ("NTK-aware" scaling) also reaches long contexts, but it is not position interpolation
    assert not check_rope_interpolation(lambda p, D, tr, tg: rope_cos_sin(p, D, 10000.0 * tg / tr))
