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


def padded_in_float64(x, block):  # the whole row copied first (padded, cast), then read block by block
    return running_logsumexp(F.pad(x, (0, -x.shape[-1] % block), value=-math.inf).double(), block).float()


def test_online_logsumexp_passes_a_padded_copy_read_once():
    assert check_online_logsumexp(padded_in_float64)


def two_passes(x, block):  # stable, block by block: the maximum over the blocks, then the sum over them again
    m = torch.full(x.shape[:-1], -math.inf)
    for j in range(0, x.shape[-1], block):
        m = torch.maximum(m, x[..., j : j + block].amax(-1))
    safe = m.masked_fill(m == -math.inf, 0.0)
    s = torch.zeros(x.shape[:-1])
    for j in range(0, x.shape[-1], block):
        s = s + torch.exp(x[..., j : j + block] - safe[..., None]).sum(-1)
    return safe + torch.log(s)


def test_online_logsumexp_fails_two_passes_over_the_blocks(capsys):
    capsys.readouterr()
    assert not check_online_logsumexp(two_passes)
    assert "a second pass over the row" in capsys.readouterr().out
    # two passes over a padded copy of x: the copy is followed as x
    assert not check_online_logsumexp(lambda x, b: two_passes(F.pad(x, (0, -x.shape[-1] % b), value=-math.inf), b))


def cloned_blocks(x, block):  # the blocks copied out first: a copy is followed, and read where it is used
    return [x[..., j : j + block].clone() for j in range(0, x.shape[-1], block)]


def two_passes_over_copies(x, block):  # two passes over copies of the blocks, x itself read only by the copies
    blocks = cloned_blocks(x, block)
    m = torch.stack([b.amax(-1) for b in blocks]).amax(0)
    safe = m.masked_fill(m == -math.inf, 0.0)
    return safe + torch.log(sum(torch.exp(b - safe[..., None]).sum(-1) for b in blocks))


def one_pass_over_copies(x, block):  # the same copies, read once in order: a right answer
    m, s = torch.full(x.shape[:-1], -math.inf), torch.zeros(x.shape[:-1])
    for b in cloned_blocks(x, block):
        m_new = torch.maximum(m, b.amax(-1))
        safe = m_new.masked_fill(m_new == -math.inf, 0.0)
        s, m = s * torch.exp(m - safe) + torch.exp(b - safe[..., None]).sum(-1), m_new
    return m + torch.log(s)


def per_lane(x, block):  # a right answer: a running maximum and sum per column of the block, folded at the end
    xp = F.pad(x, (0, -x.shape[-1] % block), value=-math.inf)
    m, s = torch.full((*x.shape[:-1], block), -math.inf), torch.zeros(*x.shape[:-1], block)
    for j in range(0, xp.shape[-1], block):
        m_new = torch.maximum(xp[..., j : j + block], m)  # elementwise: m holds the last block, a running state
        safe = m_new.masked_fill(m_new == -math.inf, 0.0)
        s, m = s * torch.exp(m - safe) + torch.exp(xp[..., j : j + block] - safe), m_new
    top = m.amax(-1).masked_fill(m.amax(-1) == -math.inf, 0.0)
    return top + torch.log((s * torch.exp(m.masked_fill(m == -math.inf, 0.0) - top[..., None])).sum(-1))


def test_online_logsumexp_follows_copies_of_the_blocks(capsys):
    assert check_online_logsumexp(one_pass_over_copies)
    assert check_online_logsumexp(per_lane)
    capsys.readouterr()
    assert not check_online_logsumexp(two_passes_over_copies)
    assert "a second pass over the row" in capsys.readouterr().out


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


def rows_transposed(q, k, v, block):  # each query tile against all keys at once, the keys in the first dims
    rows = [
        (torch.softmax(k @ q[:, :, i : i + block].mT * q.shape[-1] ** -0.5, dim=-2).mT @ v)
        for i in range(0, q.shape[2], block)
    ]
    return torch.cat(rows, 2)


def key_tiles_only(q, k, v, block):  # the online softmax over key tiles, but every query at once
    m, l, o = torch.full(q.shape[:-1], -math.inf), torch.zeros(q.shape[:-1]), torch.zeros_like(q)
    for j in range(0, k.shape[2], block):
        s = q @ k[:, :, j : j + block].mT * q.shape[-1] ** -0.5
        m_new = torch.maximum(m, s.amax(-1))
        p, c = torch.exp(s - m_new[..., None]), torch.exp(m - m_new)
        l, o, m = c * l + p.sum(-1), c[..., None] * o + p @ v[:, :, j : j + block], m_new
    return o / l[..., None]


def two_passes_over_keys(q, k, v, block):  # per query tile: the maximum over the key tiles, then the rest again
    out = torch.empty_like(q)
    for i in range(0, q.shape[2], block):
        qi = q[:, :, i : i + block]
        m = torch.full(qi.shape[:-1], -math.inf)
        for j in range(0, k.shape[2], block):
            m = torch.maximum(m, (qi @ k[:, :, j : j + block].mT * q.shape[-1] ** -0.5).amax(-1))
        l, o = torch.zeros(qi.shape[:-1]), torch.zeros_like(qi)
        for j in range(0, k.shape[2], block):
            p = torch.exp(qi @ k[:, :, j : j + block].mT * q.shape[-1] ** -0.5 - m[..., None])
            l, o = l + p.sum(-1), o + p @ v[:, :, j : j + block]
        out[:, :, i : i + block] = o / l[..., None]
    return out


def scaled_and_split(q, k, v, block):  # a right answer that scales q and k whole and splits them first
    q, k = q * q.shape[-1] ** -0.25, k * q.shape[-1] ** -0.25
    outs = []
    for qi in q.split(block, dim=2):
        m, l, o = torch.full(qi.shape[:-1], -math.inf), torch.zeros(qi.shape[:-1]), torch.zeros_like(qi)
        for kj, vj in zip(k.split(block, dim=2), v.split(block, dim=2)):
            s = qi @ kj.mT
            m_new = torch.maximum(m, s.amax(-1))
            p, c = torch.exp(s - m_new[..., None]), torch.exp(m - m_new)
            l, o, m = c * l + p.sum(-1), c[..., None] * o + p @ vj, m_new
        outs.append(o / l[..., None])
    return torch.cat(outs, 2)


def padded_tiles_copied_first(q, k, v, block):  # a right answer: keys padded, viewed as tiles, copied in float64
    B, H, Tk, D = k.shape
    kt, vt = (F.pad(t, (0, 0, 0, -Tk % block)).view(B, H, -1, block, D).double() for t in (k, v))  # (B, H, n, b, D)
    outs = []
    for qi in q.double().split(block, dim=2):
        m, l, o = torch.full(qi.shape[:-1], -math.inf, dtype=qi.dtype), torch.zeros_like(qi[..., 0]), qi * 0
        for j in range(kt.shape[2]):
            s = (qi @ kt[:, :, j].mT * D**-0.5).masked_fill(torch.arange(block) + j * block >= Tk, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            p, c = torch.exp(s - m_new[..., None]), torch.exp(m - m_new)
            l, o, m = c * l + p.sum(-1), c[..., None] * o + p @ vt[:, :, j], m_new
        outs.append(o / l[..., None])
    return torch.cat(outs, 2).float()


def test_tiled_attention_passes_the_online_softmax():
    assert check_tiled_attention(tiled)
    assert check_tiled_attention(scaled_and_split)
    assert check_tiled_attention(padded_tiles_copied_first)
    # the course's kernel, tiles in both loops: its loads and stores are views and copies
    assert check_tiled_attention(lambda q, k, v, b: flash_attention(q, k, v, block_size=b))


def kept_score_tiles(q, k, v, block, copy_values=False):  # no online softmax: a second pass over kept scores
    outs = []
    for qi in q.split(block, 2):
        s, vs = [], []
        for kj, vj in zip(k.split(block, 2), v.split(block, 2)):
            s.append(qi @ kj.mT * q.shape[-1] ** -0.5)  # (B, H, b, b), kept
            vs.append(vj.clone() if copy_values else vj)  # a copy is followed: reading it later reads v
        m = torch.stack([sj.amax(-1) for sj in s]).amax(0)
        p = [torch.exp(sj - m[..., None]) for sj in s]
        outs.append(sum(pj @ vj for pj, vj in zip(p, vs)) / sum(pj.sum(-1) for pj in p)[..., None])
    return torch.cat(outs, 2)


def all_key_tiles_batched(q, k, v, block):  # keys as (n, block, D) tiles, one batched matmul: query rows only
    B, H, Tk, D = k.shape
    kt, vt = (F.pad(t, (0, 0, 0, -Tk % block)).view(B, H, -1, block, D) for t in (k, v))  # (B, H, n, b, D)
    padded = (torch.arange(0, kt.shape[2] * block, block)[:, None] + torch.arange(block) >= Tk)[:, None]  # (n, 1, b)
    outs = []
    for qi in q.split(block, 2):
        s = (qi[:, :, None] @ kt.mT * D**-0.5).masked_fill(padded, -math.inf)  # (B, H, n, b, b): 640 < 1,920
        p = torch.exp(s - s.amax((2, 4), keepdim=True))  # a plain softmax over dims (2, 4), no dim of 40
        outs.append((p / p.sum((2, 4), keepdim=True) @ vt).sum(2))
    return torch.cat(outs, 2)


def two_passes_over_packed_kv(q, k, v, block, pack=torch.cat):  # k and v packed into one tensor, then two passes
    kv = pack([k, v], -1) if pack is torch.cat else pack([k, v])  # (B, H, Tk, 2D) or (2, B, H, Tk, D)
    D = q.shape[-1]
    k, v = (kv[..., :D], kv[..., D:]) if pack is torch.cat else (kv[0], kv[1])  # views of the packed tensor
    return two_passes_over_keys(q, k, v, block)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (two_passes_over_packed_kv, "a second pass over the keys"),
        (lambda q, k, v, b: two_passes_over_packed_kv(q, k, v, b, pack=torch.stack), "a second pass over the keys"),
        (kept_score_tiles, "each value tile before the next key tile"),
        (lambda q, k, v, b: kept_score_tiles(q, k, v, b, copy_values=True), "each value tile before the next key"),
        (all_key_tiles_batched, "rows of q, k or v per op"),
        (rows_transposed, "all 40 keys at once"),
        (key_tiles_only, "all 48 queries at once"),
        (two_passes_over_keys, "a second pass over the keys"),
    ],
)
def test_tiled_attention_fails_answers_that_are_not_tiled_both_ways_in_one_pass(wrong, message, capsys):
    capsys.readouterr()
    assert not check_tiled_attention(wrong)
    assert message in capsys.readouterr().out


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
