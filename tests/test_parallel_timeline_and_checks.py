"""The per-rank timeline, the overlap measure, and the graders of lessons 09-10 (which must fail
on wrong answers as surely as they pass on ours)."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from llmedu.checks.collectives import (  # noqa: E402
    check_assign_buckets,
    check_hidden_communication,
    check_ring_all_reduce,
    check_ring_all_reduce_bytes,
    check_tree_schedule,
)
from llmedu.parallel.collectives import ring_all_reduce, ring_all_reduce_bytes, tree_schedule  # noqa: E402
from llmedu.parallel.data_parallel import assign_buckets, hidden_communication  # noqa: E402
from llmedu.viz.timeline import plot_timeline  # noqa: E402

EVENTS = [
    dict(rank=0, lane="compute", label="forward", start=0.0, end=0.010),
    dict(rank=0, lane="compute", label="backward: bucket 0", start=0.010, end=0.020),
    dict(rank=0, lane="comm", label="all-reduce: bucket 0", start=0.020, end=0.030),
    dict(rank=0, lane="compute", label="backward: bucket 1", start=0.020, end=0.025),
    dict(rank=1, lane="compute", label="forward", start=0.001, end=0.011),
    dict(rank=1, lane="comm", label="all-reduce: bucket 0", start=0.021, end=0.031),
]


def test_timeline_draws_one_bar_per_event_on_its_rank_and_lane():
    fig = plot_timeline(EVENTS, title="two ranks")
    ax = fig.axes[0]
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(bars) == len(EVENTS)
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 compute",
        "rank 0 comm",
        "rank 1 compute",
        "rank 1 comm",
    ]
    assert ax.get_xlabel() == "time (ms)"
    comm_rank1 = [b for b in bars if abs(b.get_y() + b.get_height() / 2 - 3) < 1e-9]  # row 3: rank 1 comm
    assert len(comm_rank1) == 1 and comm_rank1[0].get_x() == pytest.approx(21.0)
    assert len([p for p in plot_timeline(EVENTS, window=(0.0, 0.005)).axes[0].patches if isinstance(p, Rectangle)]) == 2


def test_timeline_rejects_bad_events():
    with pytest.raises(ValueError, match="lacks"):
        plot_timeline([dict(rank=0, lane="comm", start=0, end=1)])
    with pytest.raises(ValueError, match="lane"):
        plot_timeline([dict(rank=0, lane="disk", label="x", start=0, end=1)])
    with pytest.raises(ValueError, match="ends before"):
        plot_timeline([dict(rank=0, lane="comm", label="x", start=2, end=1)])
    with pytest.raises(ValueError, match="no events"):
        plot_timeline([])


def test_hidden_communication_measures_overlap_with_compute_on_the_same_rank():
    # rank 0: comm 20-30 ms overlaps compute 20-25 ms; rank 1: comm 21-31 ms overlaps nothing
    assert hidden_communication(EVENTS) == pytest.approx(5 / 20)


def test_graders_pass_on_ours_and_fail_on_mistakes():
    assert check_tree_schedule(tree_schedule)
    assert not check_tree_schedule(lambda n, root: [[(root, r)] for r in range(n) if r != root])  # linear: N - 1 rounds
    assert check_ring_all_reduce_bytes(ring_all_reduce_bytes)
    assert not check_ring_all_reduce_bytes(lambda numel, n, size: [2 * (n - 1) * numel * size // n] * n)  # even only
    assert check_assign_buckets(assign_buckets)
    assert not check_assign_buckets(lambda sizes, cap: [list(range(len(sizes)))[::-1]])
    assert check_hidden_communication(hidden_communication)
    assert not check_hidden_communication(lambda events: 0.5)


def test_ring_all_reduce_grader_runs_processes_and_catches_a_wrong_sum():
    assert check_ring_all_reduce(ring_all_reduce)
    assert not check_ring_all_reduce(lambda x: x * 3)  # right only where all ranks hold the same values
