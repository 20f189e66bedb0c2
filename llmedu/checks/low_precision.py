"""Graders for lesson 08's predictions: coupled against decoupled weight decay, and the 8-bit dynamic map's error.

check_decay_ratio(fn)          fn(w, grad, lr, weight_decay, steps) -> how many times more Adam with L2 decay added
                               to the gradient (coupled) shrinks a weight than AdamW does (decoupled), when the
                               weight's loss gradient alternates +grad, -grad (no net push) for ``steps`` steps
check_dynamic_map_error(fn)    fn(decade, signed) -> the largest relative round-trip error |q(x) - x| / x of the
                               dynamic 8-bit map for 0 < x in the decade [10^-(decade+1), 10^-decade] of the
                               block's absmax (Dettmers et al. 2022, Section 2.2)

The references are measured: the decay from three float64 runs of the library's ``adamw_update_`` (with decay
coupled, decoupled, and none), the map's error from ``dynamic_map`` and ``nearest_code`` at every decision
boundary of the map inside the decade and at its two ends (the relative error is largest at one of them). Both
exercises ask for a prediction, so an answer that calls torch (running the optimizer, building the map) fails
with a message that says so; for the first case of each, a wrong answer hears only "too high" or "too low".
"""

from __future__ import annotations

import torch

from llmedu.checks.core import CheckResult, Grader
from llmedu.checks.precision import _compare_headline, _recorded
from llmedu.optim.adamw import adamw_update_
from llmedu.optim.quantization_map import dynamic_map, nearest_code

__all__ = ["check_decay_ratio", "check_dynamic_map_error"]

BETAS, EPS = (0.9, 0.999), 1e-8


def _final_weight(w: float, grad: float, lr: float, weight_decay: float, steps: int, coupled: bool) -> float:
    """One weight after ``steps`` Adam steps in float64, its loss gradient +grad, -grad, +grad, ..."""
    p, m, v = (torch.tensor([x], dtype=torch.float64) for x in (w, 0.0, 0.0))
    for t in range(1, steps + 1):
        g = torch.tensor([grad if t % 2 else -grad], dtype=torch.float64)
        if coupled:  # L2 in the loss: the decay enters m and v, and is divided by sqrt(v_hat) like the gradient
            adamw_update_(p, g + weight_decay * p, m, v, t, lr, *BETAS, EPS, 0.0)
        else:
            adamw_update_(p, g, m, v, t, lr, *BETAS, EPS, weight_decay)
    return float(p)


def measured_decay_ratio(w: float, grad: float, lr: float, weight_decay: float, steps: int) -> float:
    """(w_none - w_coupled) / (w_none - w_decoupled): each decay measured against the run without decay."""
    none = _final_weight(w, grad, lr, 0.0, steps, coupled=False)
    coupled = _final_weight(w, grad, lr, weight_decay, steps, coupled=True)
    decoupled = _final_weight(w, grad, lr, weight_decay, steps, coupled=False)
    return (none - coupled) / (none - decoupled)


DECAY_CASES = [  # (w, grad, lr, weight_decay, steps): lr * steps small against |w|, so w barely moves
    (0.5, 1e-3, 1e-4, 0.1, 200),  # the exercise: a weight with small gradients
    (0.5, 2.0, 1e-4, 0.1, 200),  # large gradients: the decay is divided by about |grad|
    (1.0, 0.0, 1e-4, 0.1, 200),  # no loss gradient at all: only the decay is in m and v
    (-0.3, 0.05, 1e-4, 0.01, 300),  # a negative weight, a smaller decay
    (0.2, 0.02, 1e-5, 0.1, 100),  # gradient and decay of the same size
]


def check_decay_ratio(fn) -> CheckResult:
    """Grade ``fn(w, grad, lr, weight_decay, steps)`` against float64 runs of coupled and decoupled decay (5%)."""
    g = Grader("check_decay_ratio")
    ops: list[str] = []
    for case in DECAY_CASES:
        expected = measured_decay_ratio(*case)
        got = g.call(_recorded(fn, ops), *case)
        description = "w={}, grad={}, lr={}, weight_decay={}, steps={}".format(*case)
        if not g.expect(
            f"{description}: the method",
            not ops,
            f"your function calls torch ({', '.join(sorted(set(ops)))}): running the two optimizers is the "
            "grader's measurement; predict the ratio from what m_hat and v_hat become",
        ):
            break
        compare = _compare_headline if case == DECAY_CASES[0] else Grader.compare
        if not compare(g, description, got, expected, rtol=0.05):
            break
    return g.result()


def measured_map_error(decade: int, signed: bool) -> float:
    """max |q(x) - x| / x over 0 < x in [10^-(decade+1), 10^-decade], from the library's map and nearest code."""
    code = dynamic_map(signed)  # (256,) float32, sorted
    lo, hi = 10.0 ** -(decade + 1), 10.0**-decade
    boundaries = ((code[1:].double() + code[:-1].double()) / 2).float()  # (255,) where the nearest code changes
    x = torch.cat([boundaries[(boundaries >= lo) & (boundaries <= hi)], torch.tensor([lo, hi])])  # float32
    q = code[nearest_code(x, code).long()]  # the round trip at absmax 1
    return float(((q.double() - x.double()).abs() / x.double()).max())


MAP_CASES = [  # (decade, signed)
    (3, True),  # the exercise: values a thousandth of their block's absmax, in the first moment's map
    (0, True),  # the top decade: the finest steps
    (0, False),  # the second moment's map: one more fraction bit
    (5, False),
    (6, True),  # the last decade: below its first code, only 0
    (1, True),
]


def check_dynamic_map_error(fn) -> CheckResult:
    """Grade ``fn(decade, signed)`` against the map's error at its decision boundaries (rtol 1e-4)."""
    g = Grader("check_dynamic_map_error")
    ops: list[str] = []
    for decade, signed in MAP_CASES:
        expected = measured_map_error(decade, signed)
        got = g.call(_recorded(fn, ops), decade, signed)
        description = f"decade={decade}, signed={signed}"
        if not g.expect(
            f"{description}: the method",
            not ops,
            f"your function calls torch ({', '.join(sorted(set(ops)))}): building the map and scanning it is the "
            "grader's measurement; derive the largest error from how the map places its values",
        ):
            break
        compare = _compare_headline if (decade, signed) == MAP_CASES[0] else Grader.compare
        if not compare(g, description, got, expected, rtol=1e-4):
            break
    return g.result()
