"""What training a model costs: FLOPs, then days on a given chip at a given utilisation.

Training a dense transformer with N parameters on D tokens takes about

    C = 6 * N * D  FLOPs                      (Kaplan et al., "Scaling Laws for Neural Language
                                               Models", 2020, section 2.1)

2ND for the forward pass (a multiply-add per parameter per token) and 4ND for the backward pass
(gradients with respect to activations and to weights). GPT-3 has N = 175e9 and was trained on
D = 300e9 tokens (Brown et al., "Language Models are Few-Shot Learners", 2020), so C = 3.15e23;
the paper's own Table D.1 gives 3.14e23.

No chip sustains its peak. Model FLOPs utilisation, MFU = achieved model FLOP/s / peak FLOP/s
(Chowdhery et al., "PaLM", 2022, appendix B), was about 46% for PaLM on TPU v4; 40% is a fair
planning figure for a well-tuned large run. So

    days = C / (n_chips * peak * MFU) / 86400.

What is left out: the attention FLOPs that 6ND ignores (small while the context is short next to
the model width), recomputation (it costs FLOPs that MFU does not count), failures and restarts,
and whether the chips' memory and interconnect can hold the job at all (``chips_to_hold``
answers the first part).
"""

from __future__ import annotations

import math

from .specs import Accelerator

__all__ = [
    "GPT3_PARAMS",
    "GPT3_TOKENS",
    "ADAM_MIXED_PRECISION_BYTES_PER_PARAM",
    "training_flops",
    "training_days",
    "chips_to_hold",
]

GPT3_PARAMS = 175e9  # Brown et al. 2020, Table 2.1
GPT3_TOKENS = 300e9  # Brown et al. 2020, section 2.2
# fp16 weights (2) + fp16 gradients (2) + fp32 master weights, momentum and variance (12):
# Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020.
ADAM_MIXED_PRECISION_BYTES_PER_PARAM = 16
SECONDS_PER_DAY = 86400


def training_flops(n_params: float, n_tokens: float) -> float:
    """6 * N * D: the FLOPs to train N parameters on D tokens (forward 2ND, backward 4ND)."""
    _check_positive(n_params=n_params, n_tokens=n_tokens)
    return 6.0 * n_params * n_tokens


def training_days(flops: float, chip: Accelerator | float, *, mfu: float = 0.4, n_chips: int = 1) -> float:
    """Days to do ``flops`` on ``n_chips`` chips, each sustaining ``mfu`` of its 16-bit peak.

    ``chip`` is a row of the spec table or a peak in FLOP/s.
    """
    peak = chip.peak_flops_16bit if isinstance(chip, Accelerator) else chip
    if peak is None:
        raise ValueError(f"{chip.name} has no 16-bit peak in its source")
    _check_positive(flops=flops, peak=peak)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction of the peak in (0, 1], got {mfu!r}")
    if not isinstance(n_chips, int) or n_chips < 1:
        raise ValueError(f"n_chips must be a positive int, got {n_chips!r}")
    return flops / (n_chips * peak * mfu) / SECONDS_PER_DAY


def chips_to_hold(
    n_params: float, chip: Accelerator, bytes_per_param: float = ADAM_MIXED_PRECISION_BYTES_PER_PARAM
) -> int:
    """The fewest chips whose memory holds the weights, gradients and Adam state (activations not counted)."""
    _check_positive(n_params=n_params, bytes_per_param=bytes_per_param)
    return math.ceil(n_params * bytes_per_param / chip.memory_bytes)


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
