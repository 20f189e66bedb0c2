"""The per-rank timeline (llmedu.viz.timeline) and the overlap measure computed from the same events."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from llmedu.parallel.data_parallel import hidden_communication  # noqa: E402
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
