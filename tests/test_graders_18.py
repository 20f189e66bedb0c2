"""Lesson 18's graders enforce the method: the block tables after a fork are reasoned out and the fixed
``blocks_needed`` is arithmetic, so an answer that runs the library's paged cache fails even when its value is
right; a plausible wrong value fails; the right answer, worked out by hand, passes."""

from llmedu.checks.attention import _tables_after_fork, check_blocks_needed, check_fork_tables
from llmedu.inference import PagedKVCache


def _fork_tables_by_hand(prompt_len, S, n):
    """Blocks handed out 0, 1, 2, ...: the prompt's blocks, then for each appender in turn a private copy of a
    partly filled last block while others still hold it, or a fresh block after a full one."""
    n_prompt = -(-prompt_len // S)
    tables = {s: list(range(n_prompt)) for s in range(n)}
    holders, next_free = n, n_prompt
    for s in [*range(1, n), 0]:
        if prompt_len % S == 0:  # the last block is full: the new token starts a fresh block
            tables[s].append(next_free)
            next_free += 1
        elif holders > 1:  # partly filled and still shared: copy it before writing
            holders -= 1
            tables[s][-1] = next_free
            next_free += 1
    return tables


def _fork_tables_by_running(prompt_len, S, n):  # the right tables, by running the paged cache
    cache = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=1, num_blocks=64, block_size=S)
    cache.add(0)
    cache.reserve(0, prompt_len)
    for child in range(1, n):
        cache.fork(0, child)
    for seq in [*range(1, n), 0]:
        cache.reserve(seq, 1)
    return dict(cache.tables)


def test_fork_tables_right_answer_passes():
    assert check_fork_tables(_fork_tables_by_hand)


def test_fork_tables_plausible_wrong_answer_fails():
    def everyone_copies(prompt_len, S, n):  # forgets that the parent, appending last, holds the block alone
        tables = _fork_tables_by_hand(prompt_len, S, n)
        if prompt_len % S:
            tables[0][-1] = max(b for t in tables.values() for b in t) + 1
        return tables

    assert not check_fork_tables(everyone_copies)


def test_fork_tables_run_on_the_cache_fails():
    assert not check_fork_tables(_fork_tables_by_running)
    assert not check_fork_tables(_tables_after_fork)  # the grader's own reference runs the cache too


def _blocks_needed_right(length, n_new, S, n_blocks, shared):
    return -(-(length + n_new) // S) - n_blocks + int(length % S != 0 and shared)


def test_blocks_needed_right_answer_passes():
    assert check_blocks_needed(_blocks_needed_right)


def test_blocks_needed_plausible_wrong_answer_fails():
    # the ceiling fixed, but a full shared last block still copied
    assert not check_blocks_needed(lambda length, n, S, nb, shared: -(-(length + n) // S) - nb + int(shared))


def test_blocks_needed_asked_of_the_cache_fails():
    def ask_the_cache(length, n_new, S, n_blocks, shared):  # right values, from PagedKVCache.blocks_needed
        cache = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=1, num_blocks=64, block_size=S)
        cache.add(0)
        cache.reserve(0, length)
        if shared:
            cache.fork(0, 1)
        return cache.blocks_needed(0, n_new)

    assert [ask_the_cache(*c) for c in [(6, 1, 4, 2, True), (8, 1, 4, 2, True)]] == [1, 1]  # its values are right
    assert not check_blocks_needed(ask_the_cache)
