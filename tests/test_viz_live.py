"""llmedu.viz.LiveMonitor: what it records, what it draws, and how much time it may take."""

import math

import pytest
import torch

from llmedu.viz import LiveMonitor


class FakeClock:
    """A clock that advances only when told to, so the redraw policy can be tested exactly."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_records_aligned_series_with_gaps():
    mon = LiveMonitor(live=False)
    mon.log(0, loss=2.0, memory={"params": 1.0, "grads": 0.0})
    mon.log(1, loss=torch.tensor(1.5))  # 0-d tensors are accepted; memory missing at this step
    mon.log(2, lr=0.1)
    assert mon.steps == [0, 1, 2]
    assert mon.history["loss"][:2] == [2.0, 1.5] and math.isnan(mon.history["loss"][2])
    assert mon.history["memory"] == [{"params": 1.0, "grads": 0.0}, {}, {}]
    assert math.isnan(mon.history["lr"][0]) and mon.history["lr"][2] == 0.1
    # the text line reports each series' last real value, not the padding of the steps it missed
    assert "loss=1.5" in mon._summary() and "memory=1 (total)" in mon._summary() and "lr=0.1" in mon._summary()


def test_figure_has_one_panel_per_metric_and_stacks_dicts():
    mon = LiveMonitor(title="t", xlabel="op", live=False)
    for i in range(5):
        mon.log(i, loss=1 / (i + 1), tokens_per_s=100.0, memory={"a": 1.0, "b": float(i)})
    fig = mon.figure()
    axes = fig.get_axes()
    assert [ax.get_title().split(":")[0] for ax in axes] == ["loss", "tokens_per_s", "memory"]
    assert len(axes[2].collections) == 2  # one stacked band per key
    assert {ax.get_xlabel() for ax in axes} == {"op"}
    top = axes[2].collections[1].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(1.0 + 4.0)  # the bands are stacked, not overlaid


def test_redraws_stay_within_the_overhead_budget(capsys):
    clock = FakeClock()
    mon = LiveMonitor(live=True, overhead=0.02, min_interval=0.5, clock=clock)
    draw_cost = 0.1  # pretend each redraw takes 100 ms: rendering happens inside _summary here
    render = mon._summary

    def slow_render():
        clock.now += draw_cost
        return render()

    mon._summary = slow_render
    # a fast loop: 10 ms per step for 100 simulated seconds
    for step in range(10_000):
        clock.now += 0.01
        mon.log(step, loss=1.0)
    loop_seconds = clock.now - mon.draws * draw_cost
    # with a 100 ms draw, redraws are spaced >= 5 s apart: at most 2% of the time goes to drawing
    assert mon.draws >= 10
    assert mon.draws * draw_cost <= 0.02 * loop_seconds * 1.05 + draw_cost
    assert "LiveMonitor[" in capsys.readouterr().out  # a terminal gets the one-line summary


def test_close_saves_a_static_figure(tmp_path):
    path = tmp_path / "board.png"
    with LiveMonitor(live=False, save=str(path)) as mon:
        mon.log(0, loss=1.0)
        mon.log(1, loss=0.5)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(RuntimeError, match="closed"):
        mon.log(2, loss=0.1)


def test_sharey_puts_scalar_panels_on_one_range_and_reference_lines_on_each():
    def panels(**kw):
        mon = LiveMonitor(live=False, **kw)
        for i in range(4):
            mon.log(i, flat=0.69 + 0.001 * i, falling=2.0 - 0.4 * i, memory={"a": 1.0})
        return mon.figure().get_axes()

    own = panels()  # default: each panel its own range, so the flat series fills its panel
    assert own[0].get_ylim()[1] - own[0].get_ylim()[0] < 0.01
    flat, falling, memory = panels(sharey=True, reference={"chance, ln 2": math.log(2)})
    assert flat.get_ylim() == falling.get_ylim()  # one range for the scalar series
    assert falling.get_ylim()[0] <= 0.69 and falling.get_ylim()[1] >= 2.0
    assert memory.get_ylim() != flat.get_ylim()  # stacked panels keep their own
    for ax in (flat, falling):
        (line,) = [ln for ln in ax.get_lines() if ln.get_label() == "chance, ln 2"]
        assert line.get_ydata()[0] == pytest.approx(math.log(2))
    with pytest.raises(TypeError, match="single numbers"):
        LiveMonitor(reference={"x": {"a": 1.0}})


def test_bad_input_is_refused():
    mon = LiveMonitor(live=False)
    with pytest.raises(ValueError, match="at least one metric"):
        mon.log(0)
    with pytest.raises(TypeError, match="number or a dict"):
        mon.log(0, loss="low")
    mon.log(0, loss=1.0)
    with pytest.raises(TypeError, match="logged as a number"):
        mon.log(1, loss={"a": 1.0})
    with pytest.raises(ValueError, match="overhead"):
        LiveMonitor(overhead=0)
