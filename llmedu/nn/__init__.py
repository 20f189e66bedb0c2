"""The parts of a transformer, one concept per file.

positions     sinusoidal, scaled sinusoidal, learned, T5 relative bias, ALiBi, RoPE
norms         LayerNorm, RMSNorm, DeepNorm's constants and initialisation
activations   ReLU, GELU (exact, tanh), SiLU; the feed-forward network, plain or gated (SwiGLU, GeGLU)
attention     multi-head / grouped-query / multi-query attention, masks, KV cache, pluggable kernels
blocks        the serial block (pre-LN, post-LN, sandwich, DeepNorm) and the parallel block
"""

from .activations import FeedForward
from .attention import Attention, KVCache, get_attention, register_attention, set_attention
from .blocks import ParallelBlock, SerialBlock
from .norms import LayerNorm, RMSNorm

__all__ = [
    "Attention",
    "FeedForward",
    "KVCache",
    "LayerNorm",
    "ParallelBlock",
    "RMSNorm",
    "SerialBlock",
    "get_attention",
    "register_attention",
    "set_attention",
]
