"""Time to target loss: the wall-clock a run needs to first reach a fixed held-out MLM loss.

Speed-run leaderboards report this (e.g. Keller Jordan's modded-nanoGPT: time to 3.28 validation
loss on FineWeb), and it is the honest speed figure for a recipe: tokens/s alone ignores how much
each token teaches, and the loss at the end of a budget mixes speed with the schedule's length.

``pretrain(..., eval_every=N)`` records the held-out loss every N optimizer steps into
``val_history`` (a list of {"step", "elapsed", "val_loss"}); the first entry at or below the target
gives the time. The resolution is one evaluation interval: the run may have crossed the target up
to N steps before the entry that shows it, so the time is an upper bound, off by at most the
seconds of N steps (``resolution_seconds``: the time since the evaluation before the hit, where the
loss was still above the target).

Left out: interpolating between evaluations (the loss is noisy on a few batches; a linear guess
would look more precise than it is).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["time_to_target"]


def time_to_target(val_history: Sequence[dict], target: float) -> dict:
    """{"reached", "seconds", "step", "resolution_seconds"} of the first evaluation with loss <= target.

    Not reached: {"reached": False, "seconds": None, "step": None, "best_loss": lowest loss seen}.
    """
    if not val_history:
        raise ValueError("the history holds no held-out evaluation: pretrain with eval_every=N")
    if not target > 0:
        raise ValueError(f"the target is an MLM loss in nats, a positive number; got {target}")
    previous = 0.0  # the start: no evaluation before the first one
    for entry in val_history:
        if entry["val_loss"] <= target:
            return {
                "reached": True,
                "seconds": entry["elapsed"],
                "step": entry["step"],
                "resolution_seconds": round(entry["elapsed"] - previous, 3),
            }
        previous = entry["elapsed"]
    best = min(e["val_loss"] for e in val_history)
    return {"reached": False, "seconds": None, "step": None, "best_loss": best}
