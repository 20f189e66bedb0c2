"""Per-rank Gantt charts: when each process computed and when it communicated.

The input is a flat list of events, each a mapping with ``rank``, ``lane`` (``"compute"`` or
``"comm"``), ``label``, ``start`` and ``end`` (seconds), as recorded by the wrappers of
``llmedu.parallel.data_parallel`` and gathered from every rank by ``launch``. Each rank gets two
rows, compute above communication, so overlap (or its absence) shows as bars stacked in time.
This module only draws; it knows nothing of how the events were made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import matplotlib.pyplot as plt

__all__ = ["plot_timeline"]

LANES = ("compute", "comm")
_REQUIRED = ("rank", "lane", "label", "start", "end")
# one hue per kind of work; the label's first word picks it ("backward: bucket 2" -> backward)
_COLOURS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "weight": "#64B5CD",  # a pipeline's weight-gradient pass (ZB-H1's W)
    "recv": "#CCCCCC",  # waiting for a neighbour's activation or gradient
    "send": "#937860",  # a blocking send: the rank waits until its message has left
    "optimizer": "#8172B2",
    "all-reduce": "#DD8452",
    "gather": "#C44E52",
    "broadcast": "#DA8BC3",
}


def plot_timeline(
    events: Iterable[Mapping],
    ax: plt.Axes | None = None,
    title: str | None = None,
    window: tuple[float, float] | None = None,
    label_spans: bool = True,
) -> plt.Figure:
    """Draw ``events`` as one compute row and one communication row per rank.

    ``window=(t0, t1)`` keeps only the events that overlap it (say, one training step).
    ``label_spans`` writes each span's label (after any "kind: ") inside its bar when the bar is
    wide enough; the colour says the kind (forward, backward, all-reduce...).
    """
    events = [dict(e) for e in events]
    for e in events:
        missing = [k for k in _REQUIRED if k not in e]
        if missing:
            raise ValueError(f"an event lacks {missing}: {e}")
        if e["lane"] not in LANES:
            raise ValueError(f"lane must be one of {LANES}, got {e['lane']!r}")
        if e["end"] < e["start"]:
            raise ValueError(f"an event ends before it starts: {e}")
    if window is not None:
        events = [e for e in events if e["end"] >= window[0] and e["start"] <= window[1]]
    if not events:
        raise ValueError("no events to draw" + (f" in the window {window}" if window else ""))

    ranks = sorted({e["rank"] for e in events})
    own_figure = ax is None
    if own_figure:
        _, ax = plt.subplots(figsize=(10, 0.9 + 0.8 * len(ranks)))
    row = {(r, lane): 2 * i + j for i, r in enumerate(ranks) for j, lane in enumerate(LANES)}
    t_min = min(e["start"] for e in events) if window is None else window[0]
    t_max = max(e["end"] for e in events) if window is None else window[1]
    scale, unit = (1e3, "ms") if t_max - t_min < 1.0 else (1.0, "s")

    labelled_until = {}  # row -> right end of the last labelled bar, so that labels never overlap
    for e in sorted(events, key=lambda e: e["start"]):
        y = row[(e["rank"], e["lane"])]
        left, width = (e["start"] - t_min) * scale, (e["end"] - e["start"]) * scale
        colour = _COLOURS.get(e["label"].split(":")[0].split()[0], "#937860")
        ax.barh(y, width, left=left, height=0.8, color=colour, edgecolor="white", linewidth=0.5)
        wide = width > 0.08 * (t_max - t_min) * scale
        if label_spans and wide and left >= labelled_until.get(y, -float("inf")):  # the kind is in the colour
            labelled_until[y] = left + width
            text = e["label"].split(": ", 1)[-1]  # "backward: bucket 2" -> "bucket 2"
            ax.text(left + width / 2, y, text, ha="center", va="center", fontsize=7, color="white", clip_on=True)

    ax.set_yticks(list(row.values()), [f"rank {r} {lane}" for (r, lane) in row])
    ax.set_ylim(-0.6, 2 * len(ranks) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(0, (t_max - t_min) * scale)
    ax.set_xlabel(f"time ({unit})")
    for i in range(1, len(ranks)):
        ax.axhline(2 * i - 0.5, color="grey", linewidth=0.5)
    used = {e["label"].split(":")[0].split()[0] for e in events}
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in _COLOURS.items() if k in used]
    ax.legend(handles, [k for k in _COLOURS if k in used], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title)
    if own_figure:
        ax.figure.tight_layout()
    return ax.figure
