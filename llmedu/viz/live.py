"""A live board for training loops: loss, throughput, memory by category, any metric.

    with LiveMonitor(title="GPT on Shakespeare") as mon:
        for step in range(steps):
            ...
            mon.log(step, loss=loss.item(), tokens_per_s=tps,
                    memory_mib={"parameters": p, "gradients": g, "activations": a})

Every metric gets a panel; a metric logged as a dict becomes a stacked-area panel (one band per
key), which is how memory by category is drawn.

Where the figure goes:

* In Jupyter the figure is one display output that is replaced in place, so JupyterLab shows it
  growing while the cell runs. A notebook executed headless (nbval, nbconvert) handles the same
  replacement messages, so it is left with exactly one final figure, not one per update.
* In a terminal there is nothing to redraw: a one-line summary is printed at most every few
  seconds and ``close()`` saves the figure if ``save=`` names a file.

The cost is bounded by construction. Drawing a figure takes tens of milliseconds, so a redraw is
allowed only when the time since the last one is at least ``draw_time / overhead``: with the
default ``overhead=0.02`` the monitor spends at most about 2% of the loop's wall-clock time
drawing, however fast the loop is. ``log`` itself only appends numbers to lists.
"""

from __future__ import annotations

import base64
import io
import math
import numbers
import time
from collections.abc import Callable, Mapping

__all__ = ["LiveMonitor"]


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell"


class LiveMonitor:
    """Collects metrics step by step and draws them, live where a notebook can show it.

    Args:
        title: the figure's title.
        xlabel: what the x axis counts (default "step").
        overhead: the largest fraction of wall-clock time spent drawing (see the module docstring).
        min_interval: never redraw more often than this many seconds.
        save: a path; ``close()`` writes the final figure there (PNG, SVG or PDF by extension).
        live: redraw while running (default: only in a notebook). The final figure is always drawn.
        sharey: put every scalar panel on one y-range, so that series in different panels can be
            compared by eye (the default gives each panel its own range, which makes a flat series
            look as steep as a falling one).
        reference: horizontal lines drawn on every scalar panel, name -> value (e.g. the loss of
            guessing, ``{"chance, ln 2": 0.693}``): the baseline a reader needs to judge a curve.
        clock: the time function, replaceable in tests.
    """

    def __init__(
        self,
        title: str | None = None,
        *,
        xlabel: str = "step",
        overhead: float = 0.02,
        min_interval: float = 0.5,
        save: str | None = None,
        live: bool | None = None,
        sharey: bool = False,
        reference: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if not 0 < overhead < 1:
            raise ValueError(f"overhead must be a fraction in (0, 1), got {overhead}")
        self.title = title
        self.xlabel = xlabel
        self.overhead = overhead
        self.min_interval = min_interval
        self.save = save
        self.notebook = _in_notebook()
        self.live = self.notebook if live is None else live
        self.sharey = sharey
        self.reference = {name: _check_value(name, value) for name, value in (reference or {}).items()}
        if any(isinstance(v, dict) for v in self.reference.values()):
            raise TypeError("reference lines are single numbers, name -> value")
        self.clock = clock
        self.steps: list[float] = []
        self.history: dict[str, list] = {}
        self.draws = 0
        self.draw_seconds = 0.0
        self._handle = None
        self._next_draw = clock() + min_interval
        self._closed = False

    # -- recording ------------------------------------------------------------------------------
    def log(self, step: float | None = None, **metrics) -> None:
        """Record the metrics of one step (default step: the number of steps logged so far)."""
        if self._closed:
            raise RuntimeError("this LiveMonitor is closed; create a new one")
        if not metrics:
            raise ValueError("log() needs at least one metric, e.g. mon.log(step, loss=2.3)")
        for name, value in metrics.items():
            value = _check_value(name, value)
            kind = dict if isinstance(value, dict) else float
            series = self.history.setdefault(name, [])
            if series and (dict if isinstance(series[0], dict) else float) is not kind:
                raise TypeError(f"metric {name!r} was logged as a {_kind(series[0])}, now as a {_kind(value)}")
            # a metric may be missing at some steps: pad so every series aligns with self.steps
            series.extend([_missing(value)] * (len(self.steps) - len(series)))
            series.append(value)
        self.steps.append(len(self.steps) if step is None else step)
        for series in self.history.values():
            if len(series) < len(self.steps):
                series.append(_missing(series[0]))
        if self.live and self.clock() >= self._next_draw:
            self._draw()

    # -- drawing --------------------------------------------------------------------------------
    def figure(self):
        """A new matplotlib figure of everything logged so far."""
        from matplotlib.figure import Figure

        names = list(self.history)
        cols = min(3, max(1, len(names)))
        rows = max(1, math.ceil(len(names) / cols))
        fig = Figure(figsize=(4.2 * cols, 3.0 * rows), layout="constrained")
        if self.title:
            fig.suptitle(self.title)
        shared = None  # the first scalar panel, whose y-range the others share when sharey is set
        for i, name in enumerate(names):
            series = self.history[name]
            scalar = not isinstance(series[0], dict)
            ax = fig.add_subplot(rows, cols, i + 1, sharey=shared if scalar and self.sharey else None)
            if scalar and shared is None:
                shared = ax
            if isinstance(series[0], dict):
                keys = list(dict.fromkeys(k for point in series for k in point))
                bands = [[point.get(k, 0.0) for point in series] for k in keys]
                ax.stackplot(self.steps, bands, labels=keys, alpha=0.85)
                ax.legend(loc="upper left", fontsize="small")
                ax.set_title(name, fontsize="medium")
            else:
                ax.plot(self.steps, series)
                for j, (label, value) in enumerate(self.reference.items()):
                    ax.axhline(value, color=f"C{j + 1}", linestyle="--", linewidth=1, label=label)
                if self.reference:
                    ax.legend(loc="best", fontsize="small")
                last = next((v for v in reversed(series) if not math.isnan(v)), math.nan)
                ax.set_title(f"{name}: {last:.4g}", fontsize="medium")
            ax.set_xlabel(self.xlabel)
            ax.grid(alpha=0.3)
        return fig

    def _png(self) -> bytes:
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png", dpi=80)
        return buf.getvalue()

    def _summary(self) -> str:
        parts = [f"step {self.steps[-1]:g}"] if self.steps else ["no steps yet"]
        for name, series in self.history.items():
            # the last real value: a series logged on other steps than its neighbours is padded (NaN, {})
            v = next((x for x in reversed(series) if (x if isinstance(x, dict) else x == x)), series[-1])
            parts.append(f"{name}={sum(v.values()):.4g} (total)" if isinstance(v, dict) else f"{name}={v:.4g}")
        return f"LiveMonitor[{self.title or ''}] " + ", ".join(parts)

    def _draw(self) -> None:
        start = self.clock()
        if self.notebook:
            from IPython.display import display

            bundle = {
                "image/png": base64.b64encode(self._png()).decode("ascii"),
                "text/plain": self._summary(),
            }
            if self._handle is None:
                self._handle = display(bundle, raw=True, display_id=True)
            else:
                self._handle.update(bundle, raw=True)
        else:
            print(self._summary(), flush=True)
        now = self.clock()
        self.draws += 1
        self.draw_seconds += now - start
        # the next redraw waits long enough that drawing stays within `overhead` of the time spent
        self._next_draw = now + max(self.min_interval, (now - start) / self.overhead)

    def close(self) -> None:
        """Draw the final figure (and save it if asked); later ``log`` calls are errors."""
        if self._closed:
            return
        self._closed = True
        if not self.steps:
            return
        if self.notebook:
            self._draw()
        else:
            print(self._summary(), flush=True)
        if self.save:
            self.figure().savefig(self.save, dpi=120)

    def __enter__(self) -> LiveMonitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_value(name: str, value):
    if isinstance(value, Mapping):
        return {str(k): _check_value(f"{name}[{k!r}]", v) for k, v in value.items()}
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()  # a 0-d tensor or NumPy scalar
    if not isinstance(value, numbers.Real):
        raise TypeError(f"metric {name!r} must be a number or a dict of numbers, got {type(value).__name__}")
    return float(value)


def _missing(like):
    return {} if isinstance(like, dict) else math.nan


def _kind(value) -> str:
    return "dict" if isinstance(value, dict) else "number"
