"""The graders of lesson 17 (FlashAttention): each passes a right answer, and fails a plausible wrong value
AND a right value computed the wrong way (the method is recorded, not only the result)."""

import math

import pytest
import torch
import torch.nn.functional as F

from llmedu.checks.attention import (
    check_causal_tiles,
    check_causal_traffic,
    check_online_logsumexp,
    check_tiled_attention,
)
from llmedu.kernels import flash_attention
from llmedu.kernels.traffic import counting

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: see conftest.py


# -- exercise 1: a logsumexp read `block` columns at a time ----------------------------------------------
def running_logsumexp(x, block, guard=True):
    m, s = torch.full(x.shape[:-1], -math.inf), torch.zeros(x.shape[:-1])
    for j in range(0, x.shape[-1], block):
        b = x[..., j : j + block]
        m_new = torch.maximum(m, b.amax(-1))
        safe = m_new.masked_fill(m_new == -math.inf, 0.0) if guard else m_new  # a block with nothing in it
        s = s * torch.exp(m - safe) + torch.exp(b - safe[..., None]).sum(-1)
        m = m_new
    return m + torch.log(s)


def merged_by_torch(x, block):  # block by block, but torch does each merge
    out = torch.full(x.shape[:-1], -math.inf)
    for j in range(0, x.shape[-1], block):
        out = torch.logaddexp(out, torch.logsumexp(x[..., j : j + block], -1))
    return out


def test_online_logsumexp_passes_the_running_max_and_sum():
    assert check_online_logsumexp(running_logsumexp)


def test_online_logsumexp_fails_a_plausible_wrong_value(capsys):
    assert not check_online_logsumexp(lambda x, b: running_logsumexp(x, b, guard=False))  # NaN on a -inf block
    assert "all -inf" in capsys.readouterr().out


def all_blocks_at_once(x, block):  # padded and cut into blocks, then one reduction over every block together
    xb = F.pad(x, (0, -x.shape[-1] % block), value=-math.inf).unflatten(-1, (-1, block))  # (..., n_blocks, block)
    m = xb.amax((-2, -1))
    safe = m.masked_fill(m == -math.inf, 0.0)
    return m + torch.log(torch.exp(xb - safe[..., None, None]).sum((-2, -1)))


def whole_row_transposed(x, block):  # the row moved off the last dim: x.mT's last dim is the batch of rows
    m = x.mT.amax(0)
    safe = m.masked_fill(m == -math.inf, 0.0)
    return m + torch.log(torch.exp(x.mT - safe).sum(0))


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda x, b: torch.logsumexp(x, -1), "logsumexp"),  # no blocks at all
        (merged_by_torch, "does the merge for you"),  # blocks, but torch.logaddexp merges them
        (all_blocks_at_once, "each reduction over at most"),
        (whole_row_transposed, "each reduction over at most"),
    ],
)
def test_online_logsumexp_fails_the_right_value_computed_the_wrong_way(wrong, message, capsys):
    capsys.readouterr()
    assert not check_online_logsumexp(wrong)
    assert message in capsys.readouterr().out


# -- exercise 2: tiled attention --------------------------------------------------------------------------
def tiled(q, k, v, block, rescale=True):
    out = torch.empty_like(q)
    for i in range(0, q.shape[2], block):
        qi = q[:, :, i : i + block]
        m, l, o = torch.full(qi.shape[:-1], -math.inf), torch.zeros(qi.shape[:-1]), torch.zeros_like(qi)
        for j in range(0, k.shape[2], block):
            s = qi @ k[:, :, j : j + block].transpose(-1, -2) * q.shape[-1] ** -0.5
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new) if rescale else torch.ones_like(m)
            l, o, m = c * l + p.sum(-1), c[..., None] * o + p @ v[:, :, j : j + block], m_new
        out[:, :, i : i + block] = o / l[..., None]
    return out


def tiles_then_whole(q, k, v, block):  # each score tile computed apart, then glued into the (Tq, Tk) matrix
    rows = [
        torch.cat(
            [q[:, :, i : i + block] @ k[:, :, j : j + block].transpose(-1, -2) for j in range(0, k.shape[2], block)], -1
        )
        for i in range(0, q.shape[2], block)
    ]
    return torch.softmax(torch.cat(rows, 2) * q.shape[-1] ** -0.5, -1) @ v


def query_rows_only(q, k, v, block):  # split by query tiles only: each against all keys, no online softmax
    rows = [
        torch.softmax(q[:, :, i : i + block] @ k.mT * q.shape[-1] ** -0.5, -1) @ v for i in range(0, q.shape[2], block)
    ]
    return torch.cat(rows, 2)


def tiles_merged_by_logsumexp(q, k, v, block):  # tiled, but torch.logsumexp/logaddexp carry the normaliser
    out = torch.empty_like(q)
    for i in range(0, q.shape[2], block):
        qi = q[:, :, i : i + block]
        L, o = torch.full(qi.shape[:-1], -math.inf), torch.zeros_like(qi)
        for j in range(0, k.shape[2], block):
            s = qi @ k[:, :, j : j + block].transpose(-1, -2) * q.shape[-1] ** -0.5
            lj = torch.logsumexp(s, -1)
            L_new = torch.logaddexp(L, lj)
            o = o * torch.exp(L - L_new)[..., None] + torch.exp(s - L_new[..., None]) @ v[:, :, j : j + block]
            L = L_new
        out[:, :, i : i + block] = o
    return out


def test_tiled_attention_passes_the_online_softmax():
    assert check_tiled_attention(tiled)


def test_tiled_attention_fails_a_plausible_wrong_value(capsys):
    assert not check_tiled_attention(lambda q, k, v, b: tiled(q, k, v, b, rescale=False))  # forgets e^(m_old - m)
    assert "Tq=" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v), "fused attention"),
        (lambda q, k, v, b: torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v, "no (Tq, Tk)"),
        (tiles_then_whole, "no (Tq, Tk)"),
        (query_rows_only, "keys at a time"),
        (tiles_merged_by_logsumexp, "does the merge for you"),
    ],
)
def test_tiled_attention_fails_the_right_value_computed_the_wrong_way(wrong, message, capsys):
    capsys.readouterr()
    assert not check_tiled_attention(wrong)
    assert message in capsys.readouterr().out


# -- exercise 3: causal tiles with Tq < Tk ----------------------------------------------------------------
def causal_tiles(Tq, Tk, block):
    return sum(
        sum(1 for k0 in range(0, Tk, block) if k0 <= min(q0 + block, Tq) - 1 + Tk - Tq) for q0 in range(0, Tq, block)
    )


def test_causal_tiles_passes_and_fails_a_top_left_mask():
    assert check_causal_tiles(causal_tiles)
    assert not check_causal_tiles(lambda Tq, Tk, b: causal_tiles(Tq, Tq, b))  # aligned top-left: offset forgotten


# -- exercise 4: the bytes of the causal forward, predicted ----------------------------------------------
def causal_bytes(T, D, block, itemsize, lse_bytes=4, short_last_tile=True):
    keys_read = sum(min(q0 + block, T) if short_last_tile else q0 + block for q0 in range(0, T, block))
    return (T * D + 2 * keys_read * D + T * D) * itemsize + lse_bytes * T  # Q once, K and V per tile, O; lse


def by_running_the_kernel(T, D, block, itemsize):
    q = torch.zeros(1, 1, T, D, dtype={2: torch.bfloat16, 4: torch.float32}[itemsize])
    with torch.no_grad(), counting() as traffic:
        flash_attention(q, q, q, causal=True, block_size=block)
    return traffic.total


def test_causal_traffic_passes_a_prediction():
    assert check_causal_traffic(causal_bytes)


@pytest.mark.parametrize(
    "wrong",
    [
        lambda T, D, b, e: (2 * T * D + 2 * T * D * math.ceil(T / b)) * e + 4 * T,  # every tile, as if not causal
        lambda T, D, b, e: causal_bytes(T, D, b, e, short_last_tile=False),  # the last tile taken as full
        lambda T, D, b, e: causal_bytes(T, D, b, e, lse_bytes=e),  # the logsumexp in the input's dtype
        lambda T, D, b, e: causal_bytes(T, D, b, e, lse_bytes=0),  # the logsumexp forgotten
    ],
)
def test_causal_traffic_fails_a_plausible_wrong_value(wrong, capsys):
    assert not check_causal_traffic(wrong)
    assert "T=" in capsys.readouterr().out


def test_causal_traffic_fails_the_right_value_computed_by_running_the_kernel(capsys):
    capsys.readouterr()
    assert not check_causal_traffic(by_running_the_kernel)
    assert "it ran the kernel" in capsys.readouterr().out
