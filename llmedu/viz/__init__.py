"""Drawing only what it is handed: live training boards and per-rank timelines."""

from .live import LiveMonitor

__all__ = ["LiveMonitor"]
