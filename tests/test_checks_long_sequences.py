"""The references of lesson 20's graders (llmedu.checks.long_sequences) agree with the library's own counts.

The graders refuse answers that call llmedu (``tests/test_graders_20.py``); here the library's functions,
called by the test instead, give the values the graders expect.
"""

import pytest

from llmedu.checks.long_sequences import hiding_block, kv_traffic, striped_pairs
from llmedu.parallel.link import Link
from llmedu.parallel.long_sequence_study import step_model
from llmedu.parallel.sequence_layout import ring_bytes_sent


@pytest.mark.parametrize("args", [(1, 1, 8192, 64, 2, 4), (2, 8, 4096, 128, 4, 2), (1, 32, 131072, 128, 16, 2)])
def test_ring_bytes_are_the_librarys_count_with_the_kv_heads(args):
    b, kv_heads, t, d, n, size = args
    counted = kv_traffic(b, 4 * kv_heads, kv_heads, t, d, n, size)
    assert counted["ring_sent"] == ring_bytes_sent(*args)  # Q's heads do not travel: only the K/V heads count
    assert counted["gather_sent"] == counted["ring_sent"]  # a ring all-gather moves each block n - 1 times too
    assert counted["ring_sent"] != n * 2 * b * kv_heads * (t // n) * d * size  # N steps, not N-1
    assert counted["ring_sent"] != (n - 1) * b * kv_heads * (t // n) * d * size  # K only


def test_a_ring_holds_at_most_two_other_blocks():
    one = 2 * 1 * 8 * (4096 // 2) * 64 * 2  # one K/V block at n = 2
    assert kv_traffic(1, 32, 8, 4096, 64, 2, 2)["ring_held"] == one
    assert kv_traffic(1, 32, 8, 4096, 64, 8, 2)["ring_held"] == 2 * (one // 4)
    assert kv_traffic(1, 32, 8, 4096, 64, 8, 2)["gather_held"] == 7 * (one // 4)


def test_hiding_block_is_where_the_links_model_stops_setting_the_pace():
    heads, kv_heads, d, size, flops, alpha, beta = 4, 4, 64, 4, 20e9, 1e-3, 3e6
    c = hiding_block(heads, kv_heads, d, size, flops, alpha, beta)
    link = Link(alpha, beta)  # the same alpha-beta time as the lesson's Link gives a K/V message
    for tokens, hidden in ((c, True), (c - 1, False)):
        compute = 4 * tokens**2 * d * heads / flops
        transfer = link.message_time(2 * tokens * kv_heads * d * size)
        assert (step_model(compute, transfer, True) == compute) is hidden


def test_striped_pairs_cover_the_causal_triangle_and_the_diagonal_steps():
    for t, n in ((8, 2), (32, 4), (40, 5)):
        rows, m = striped_pairs(t, n), t // n
        assert sum(map(sum, rows)) == t * (t + 1) // 2  # every visible pair once
        for r in range(n):  # rank (r - s) mod n <= r: its keys at the same stride position are visible
            assert rows[r] == [m * (m - 1) // 2 + (m if (r - s) % n <= r else 0) for s in range(n)]
