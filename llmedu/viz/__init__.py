"""Drawing only what it is handed: live training boards and per-rank timelines."""

from .live import LiveMonitor
from .timeline import plot_timeline

__all__ = ["LiveMonitor", "plot_timeline"]
