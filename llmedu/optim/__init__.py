"""Optimizers from scratch, and what their state costs.

adamw              AdamW (Loshchilov & Hutter 2019): Adam with decoupled weight decay, equal to torch's in fp32
quantization_map   the dynamic (tree) 8-bit data type (Dettmers 2016; Dettmers et al. 2022)
eight_bit          block-wise 8-bit quantization and AdamW8bit: 2 bytes of state per parameter instead of 8
"""

from .adamw import AdamW, adamw_update_
from .eight_bit import AdamW8bit, dequantize_blockwise, quantize_blockwise, state_bytes
from .quantization_map import dynamic_map

__all__ = [
    "AdamW",
    "AdamW8bit",
    "adamw_update_",
    "dequantize_blockwise",
    "dynamic_map",
    "quantize_blockwise",
    "state_bytes",
]
