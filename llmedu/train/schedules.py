"""Learning-rate schedules: the learning rate as a function of the step.

A schedule here is a plain function ``step -> factor``; the trainer sets each parameter group's
learning rate to ``factor * base_lr`` before every optimizer step. Keeping the factor separate from
the base rate lets groups with different rates (no weight decay on norms, a higher rate for a head)
share one shape.

    constant            1
    warmup_linear       0 -> 1 linearly over `warmup` steps, then 1 -> `final` linearly until `total`
    warmup_cosine       0 -> 1 over `warmup`, then  final + (1 - final) * (1 + cos(pi * t)) / 2
                        with t going 0 -> 1 until `total` (Loshchilov & Hutter 2017, SGDR, eq. 5)
    triangular          a triangle wave between `low` and 1 with a half-period of `step_size`
                        (Smith 2017, "Cyclical Learning Rates", sec. 3.1)
    one_cycle           warm up from 1/div_factor to 1 with a half cosine, then anneal to
                        1/(div_factor * final_div_factor) (Smith & Topin 2018, "Super-Convergence")

Warm-up exists because Adam's second-moment estimates are noisy in the first steps and post-LN
transformers diverge without it (Xiong et al. 2020); the cosine tail is the GPT-2/3 and LLaMA
default. The tests check every shape against ``torch.optim.lr_scheduler``.

Left out: restarts (SGDR's warm restarts), schedules driven by a validation loss, inverse-sqrt.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["Schedule", "constant", "warmup_linear", "warmup_cosine", "triangular", "one_cycle"]

Schedule = Callable[[int], float]  # step (0, 1, 2, ...) -> multiplier of the base learning rate


def _check(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def constant() -> Schedule:
    """The base learning rate at every step."""
    return lambda step: 1.0


def _warmup_then(warmup: int, total: int, decay: Callable[[float], float]) -> Schedule:
    """Linear warm-up over ``warmup`` steps, then ``decay(t)`` as t goes 0 -> 1 until step ``total``."""
    _check(warmup=warmup, total=total)
    if total <= warmup:
        raise ValueError(f"total ({total}) must be larger than warmup ({warmup})")

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        return decay(min(step - warmup, total - warmup) / (total - warmup))

    return factor


def warmup_linear(warmup: int, total: int, final: float = 0.0) -> Schedule:
    """Linear warm-up over ``warmup`` steps, then linear decay to ``final`` at step ``total``."""
    return _warmup_then(warmup, total, lambda t: 1.0 + (final - 1.0) * t)


def warmup_cosine(warmup: int, total: int, final: float = 0.0) -> Schedule:
    """Linear warm-up over ``warmup`` steps, then a half cosine down to ``final`` at ``total``."""
    return _warmup_then(warmup, total, lambda t: final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * t)))


def triangular(step_size: int, low: float) -> Schedule:
    """Up from ``low`` to 1 in ``step_size`` steps, back down in as many, and again (CLR)."""
    _check(step_size=step_size)
    if step_size == 0 or not 0 <= low <= 1:
        raise ValueError(f"need step_size > 0 and 0 <= low <= 1, got {step_size} and {low}")

    def factor(step: int) -> float:
        cycle_position = abs(step / step_size % 2 - 1)  # 1 at the ends of a cycle, 0 in the middle
        return low + (1.0 - low) * (1.0 - cycle_position)

    return factor


def one_cycle(total: int, pct_start: float = 0.3, div_factor: float = 25.0, final_div_factor: float = 1e4) -> Schedule:
    """One cycle: half-cosine from 1/div_factor up to 1, then half-cosine down to the floor."""
    _check(total=total)
    if not 0 < pct_start < 1 or total < 2:
        raise ValueError(f"need 0 < pct_start < 1 and total >= 2, got {pct_start} and {total}")
    start, floor = 1.0 / div_factor, 1.0 / (div_factor * final_div_factor)
    peak = pct_start * total - 1  # the step where the rate is highest (as torch counts it)

    def cosine(a: float, b: float, t: float) -> float:  # a -> b as t goes 0 -> 1
        return b + (a - b) * 0.5 * (1.0 + math.cos(math.pi * t))

    def factor(step: int) -> float:
        if step <= peak:
            return cosine(start, 1.0, step / peak)
        return cosine(1.0, floor, min(1.0, (step - peak) / (total - 1 - peak)))

    return factor
