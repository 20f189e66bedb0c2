"""Graders of lessons 17 and 18: each passes the right answer and fails a plausible wrong one."""

import math

import torch

from llmedu.checks.attention import (
    check_blocks_needed,
    check_causal_tiles,
    check_fork_tables,
    check_kv_waste,
    check_online_logsumexp,
    check_slot_of,
    check_tiled_attention,
)


def _online_logsumexp(x, block, rescale=True):
    m = torch.full(x.shape[:-1], -math.inf)
    s = torch.zeros(x.shape[:-1])
    for j in range(0, x.shape[-1], block):
        b = x[..., j : j + block]
        m_new = torch.maximum(m, b.max(-1).values)
        safe = torch.where(m_new == -math.inf, 0.0, m_new)  # rows that are all -inf so far
        s = (s * torch.exp(m - safe) if rescale else s) + torch.exp(b - safe[..., None]).sum(-1)
        m = m_new
    return m + torch.log(s)


def _unguarded(x, block):  # the textbook update: NaN once a block is all -inf (m = m_new = -inf)
    m = torch.full(x.shape[:-1], -math.inf)
    s = torch.zeros(x.shape[:-1])
    for j in range(0, x.shape[-1], block):
        b = x[..., j : j + block]
        m_new = torch.maximum(m, b.max(-1).values)
        s = s * torch.exp(m - m_new) + torch.exp(b - m_new[..., None]).sum(-1)
        m = m_new
    return m + torch.log(s)


def test_online_logsumexp_grader():
    assert check_online_logsumexp(_online_logsumexp)
    assert not check_online_logsumexp(_unguarded)
    assert not check_online_logsumexp(lambda x, b: _online_logsumexp(x, b, rescale=False))  # forgets e^(m_old-m)
    assert not check_online_logsumexp(lambda x, b: torch.log(torch.exp(x).sum(-1)))  # overflows near 1000


def test_online_logsumexp_grader_fails_the_right_value_computed_without_blocks(capsys):
    def max_first(x, block):  # a stable logsumexp, but the maximum of the whole row first: two passes, not one
        m = x.max(-1).values
        safe = torch.where(m == -math.inf, 0.0, m)
        return safe + torch.log(
            sum(torch.exp(x[..., j : j + block] - safe[..., None]).sum(-1) for j in range(0, x.shape[-1], block))
        )

    capsys.readouterr()
    assert check_online_logsumexp(
        lambda x, b: _online_logsumexp(torch.nn.functional.pad(x, (0, 3), value=-math.inf), b)
    )
    for wrong in (lambda x, b: torch.logsumexp(x, -1), max_first):
        assert not check_online_logsumexp(wrong)
        assert "columns at a time" in capsys.readouterr().out


def _tiled(q, k, v, block, rescale=True):
    scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for i in range(0, q.shape[2], block):
        qi = q[:, :, i : i + block]
        m = torch.full(qi.shape[:-1], -math.inf)
        l = torch.zeros(qi.shape[:-1])
        o = torch.zeros_like(qi)
        for j in range(0, k.shape[2], block):
            s = qi @ k[:, :, j : j + block].transpose(-1, -2) * scale
            m_new = torch.maximum(m, s.max(-1).values)
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new) if rescale else torch.ones_like(m)
            l = c * l + p.sum(-1)
            o = c[..., None] * o + p @ v[:, :, j : j + block]
            m = m_new
        out[:, :, i : i + block] = o / l[..., None]
    return out


def test_tiled_attention_grader():
    assert check_tiled_attention(_tiled)
    assert not check_tiled_attention(lambda q, k, v, b: _tiled(q, k, v, b, rescale=False))


def test_tiled_attention_grader_fails_the_right_value_computed_without_tiles(capsys):
    def naive(q, k, v, block):  # the whole (Tq, Tk) score matrix
        return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v

    def naive_per_head(q, k, v, block):  # one head's (Tq, Tk) matrix at a time
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            for h in range(q.shape[1]):
                out[b, h] = naive(q[b, h], k[b, h], v[b, h], block)
        return out

    capsys.readouterr()
    assert not check_tiled_attention(lambda q, k, v, b: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert "fused attention" in capsys.readouterr().out
    for wrong in (naive, naive_per_head):
        assert not check_tiled_attention(wrong)
        assert "no (Tq, Tk) matrix" in capsys.readouterr().out


def test_causal_tiles_grader():
    def right(Tq, Tk, block):
        offset = Tk - Tq  # bottom-right aligned: query i sees keys 0 .. i + offset
        return sum(
            sum(1 for k0 in range(0, Tk, block) if k0 <= min(q0 + block, Tq) - 1 + offset) for q0 in range(0, Tq, block)
        )

    assert check_causal_tiles(right)
    half = lambda Tq, Tk, b: math.ceil(Tq / b) * (math.ceil(Tq / b) + 1) // 2  # square only: n(n+1)/2
    assert not check_causal_tiles(half)
    top_left = lambda Tq, Tk, b: right(Tq, Tq, b) if Tq <= Tk else right(Tq, Tk, b)  # forgets the offset
    assert not check_causal_tiles(top_left)
    assert not check_causal_tiles(lambda Tq, Tk, b: math.ceil(Tq / b) * math.ceil(Tk / b) // 2)  # "about half"


def test_slot_of_grader():
    assert check_slot_of(lambda p, t, s: (t[p // s], p % s))
    assert not check_slot_of(lambda p, t, s: (p // s, p % s))  # the logical block, not the physical one


def test_kv_waste_grader():
    def right(lengths, max_len, S, bpt):
        return sum(max_len - L for L in lengths) * bpt, sum(-(-L // S) * S - L for L in lengths) * bpt

    assert check_kv_waste(right)
    assert check_kv_waste(lambda *a: list(right(*a)))  # a list is accepted as well as a tuple
    # S - L % S: a full last block counted as wasting a whole block
    assert not check_kv_waste(lambda ls, m, S, b: (right(ls, m, S, b)[0], sum(S - L % S for L in ls) * b))
    # the bound (S - 1 per sequence) instead of the waste itself
    assert not check_kv_waste(lambda ls, m, S, b: (right(ls, m, S, b)[0], len(ls) * (S - 1) * b))
    assert not check_kv_waste(lambda ls, m, S, b: (sum(m - L for L in ls), right(ls, m, S, b)[1]))  # slots, not bytes


def _fork_tables(prompt_len, S, n, copy_when_full=False):
    """A simulation written apart from PagedKVCache: blocks handed out 0, 1, 2, ... in order."""
    n_prompt = -(-prompt_len // S)
    tables = {s: list(range(n_prompt)) for s in range(n)}
    holders = {b: n for b in range(n_prompt)}
    next_free = n_prompt
    for s in [*range(1, n), 0]:
        last = tables[s][-1]
        if prompt_len % S == 0 and not copy_when_full:  # the last block is full: append a fresh one
            tables[s].append(next_free)
            next_free += 1
        elif holders[last] > 1:  # partly filled (or, wrongly, full) and shared: copy it
            holders[last] -= 1
            tables[s][-1] = next_free
            next_free += 1
            if prompt_len % S == 0:
                tables[s].append(next_free)
                next_free += 1
    return tables


def test_fork_tables_grader():
    assert check_fork_tables(_fork_tables)
    assert not check_fork_tables(lambda p, S, n: _fork_tables(p, S, n, copy_when_full=True))

    def parent_copies_too(p, S, n):  # forgets that the parent, last, holds the block alone by then
        tables = _fork_tables(p, S, n)
        if p % S:
            tables[0][-1] = max(b for t in tables.values() for b in t) + 1
        return tables

    assert not check_fork_tables(parent_copies_too)


def test_blocks_needed_grader():
    def right(length, n_new, S, n_blocks, shared):
        return -(-(length + n_new) // S) - n_blocks + int(length % S != 0 and shared)

    assert check_blocks_needed(right)
    # the buggy version shown in the lesson: floor instead of ceiling, and a copy even of a full block
    assert not check_blocks_needed(lambda length, n, S, nb, shared: (length + n) // S - nb + int(shared))
    # one bug fixed, the other left
    assert not check_blocks_needed(lambda length, n, S, nb, shared: -(-(length + n) // S) - nb + int(shared))
    assert not check_blocks_needed(lambda length, n, S, nb, shared: right(length, n, S, nb, False))
