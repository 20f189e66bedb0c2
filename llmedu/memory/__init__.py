"""Where the bytes of a training step go: measured, estimated, simulated.

tracker     MemoryTracker: live bytes by category (parameters, gradients, optimizer state,
            activations, other) over a step, and the peak
estimate    the formulas: 2+2+K bytes per parameter and ZeRO's shards (Rajbhandari et al. 2020),
            activations per transformer layer (Korthikanti et al. 2022)
simulate    the same tracker on fake tensors: the memory of a 7B model without allocating it
"""

from .estimate import (
    activation_bytes_per_layer,
    adamw_fp32_bytes,
    mixed_precision_adam_bytes,
    ring_attention_kv_bytes,
    zero_bytes_per_rank,
)
from .simulate import TinyGPT, simulate_training_step, training_step
from .tracker import CATEGORIES, MemoryTracker, Sample

__all__ = [
    "ring_attention_kv_bytes",
    "CATEGORIES",
    "MemoryTracker",
    "Sample",
    "TinyGPT",
    "activation_bytes_per_layer",
    "adamw_fp32_bytes",
    "mixed_precision_adam_bytes",
    "simulate_training_step",
    "training_step",
    "zero_bytes_per_rank",
]
