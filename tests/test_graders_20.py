"""Lesson 20's graders fail a plausible wrong value and a right value asked of the library, and pass a right one."""

import math

from llmedu.checks.long_sequences import check_hiding_block, check_kv_traffic, check_striped_pairs
from llmedu.parallel.long_sequence_study import step_model
from llmedu.parallel.sequence_layout import ring_bytes_sent


def _traffic(b, heads, kv_heads, t, d, n, size):
    block = 2 * b * kv_heads * (t // n) * d * size  # K and V of one rank's tokens, the K/V heads only
    return dict(ring_sent=(n - 1) * block, gather_sent=(n - 1) * block, ring_held=min(2, n - 1) * block,
                gather_held=(n - 1) * block)  # fmt: skip


def test_check_kv_traffic():
    assert check_kv_traffic(_traffic)

    def with_q_heads(b, heads, kv_heads, t, d, n, size):  # K/V counted with Q's heads: no GQA
        return _traffic(b, heads, heads, t, d, n, size)

    def two_blocks_always(b, heads, kv_heads, t, d, n, size):  # at n = 2 there is only one other block
        return _traffic(b, heads, kv_heads, t, d, n, size) | dict(ring_held=4 * b * kv_heads * (t // n) * d * size)

    def asked(b, heads, kv_heads, t, d, n, size):  # the right value, asked of the library
        sent = ring_bytes_sent(b, kv_heads, t, d, n, size)
        return _traffic(b, heads, kv_heads, t, d, n, size) | dict(ring_sent=sent)

    assert asked(1, 32, 8, 4096, 64, 4, 2) == _traffic(1, 32, 8, 4096, 64, 4, 2)
    for wrong in (with_q_heads, two_blocks_always, asked):
        assert not check_kv_traffic(wrong), wrong.__name__


def _smallest(heads, kv_heads, d, size, flops, alpha, beta):
    a, b = 4 * d * heads / flops, 2 * kv_heads * d * size / beta  # compute a c^2 against transfer alpha + b c
    c = max(1, math.ceil((b + math.sqrt(b * b + 4 * a * alpha)) / (2 * a)) - 1)
    while a * c * c < alpha + b * c:
        c += 1
    return c


def test_check_hiding_block():
    assert check_hiding_block(_smallest)

    def without_latency(heads, kv_heads, d, size, flops, alpha, beta):  # Liu et al.'s bandwidth-only bound
        return _smallest(heads, kv_heads, d, size, flops, 0.0, beta)

    def with_q_heads(heads, kv_heads, d, size, flops, alpha, beta):
        return _smallest(heads, heads, d, size, flops, alpha, beta)

    def asked(heads, kv_heads, d, size, flops, alpha, beta):  # the library's overlap model does the comparing
        c = 1
        while step_model(4 * c * c * d * heads / flops, alpha + 2 * c * kv_heads * d * size / beta, True) > (
            4 * c * c * d * heads / flops
        ):
            c += 1
        return c

    assert asked(4, 4, 64, 4, 20e9, 1e-3, 3e6) == _smallest(4, 4, 64, 4, 20e9, 1e-3, 3e6)
    for wrong in (without_latency, with_q_heads, asked, lambda *args: float(_smallest(*args))):
        assert not check_hiding_block(wrong)


def _striped(t, n):
    m = t // n  # tokens per rank: rank r holds r, r + n, ...
    return [[m * (m - 1) // 2 + (m if (r - s) % n <= r else 0) for s in range(n)] for r in range(n)]


def test_check_striped_pairs():
    assert check_striped_pairs(_striped)
    assert check_striped_pairs(lambda t, n: [tuple(row) for row in _striped(t, n)])  # tuples are lists too

    def all_diagonal(t, n):  # every tile counted as a causal square
        m = t // n
        return [[m * (m + 1) // 2] * n for _ in range(n)]

    def mirrored(t, n):  # the stripes read the other way: a higher rank's key at the same stride taken as past
        m = t // n
        return [[m * (m - 1) // 2 + (m if (r - s) % n >= r else 0) for s in range(n)] for r in range(n)]

    def asked(t, n):  # the right value through the library's tile walker
        from llmedu.parallel.sequence_layout import tiles

        list(tiles(0, 0, n, "contiguous", True))
        return _striped(t, n)

    for wrong in (all_diagonal, mirrored, asked):
        assert not check_striped_pairs(wrong), wrong.__name__
