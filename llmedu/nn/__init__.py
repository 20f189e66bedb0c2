"""The parts of a transformer, one concept per file.

positions     sinusoidal, scaled sinusoidal, learned, T5 relative bias, ALiBi, RoPE
norms         LayerNorm, RMSNorm, DeepNorm's constants and initialisation
activations   ReLU, GELU (exact, tanh), SiLU; the feed-forward network, plain or gated (SwiGLU, GeGLU)
attention     multi-head / grouped-query / multi-query attention, masks, pluggable kernels
kv_cache      what the model asks of a KV cache (KVCacheLike), and the contiguous KVCache
blocks        the serial block (pre-LN, post-LN, sandwich, DeepNorm) and the parallel block
moe           mixture of experts: top-k router, capacity and dropped tokens, Switch's load-balancing loss, ST-MoE's z-loss
functional    softmax, log-softmax, log-sum-exp and cross-entropy, stable (the max subtracted) and equal to torch's
"""

from .activations import FeedForward
from .attention import Attention, get_attention, register_attention, set_attention
from .blocks import ParallelBlock, SerialBlock
from .functional import cross_entropy, log_softmax, logsumexp, softmax
from .kv_cache import KVCache, KVCacheLike
from .moe import MoE, MoEFeedForward, MoEStats
from .norms import LayerNorm, RMSNorm

__all__ = [
    "Attention",
    "FeedForward",
    "KVCache",
    "KVCacheLike",
    "LayerNorm",
    "MoE",
    "MoEFeedForward",
    "MoEStats",
    "ParallelBlock",
    "RMSNorm",
    "SerialBlock",
    "cross_entropy",
    "get_attention",
    "log_softmax",
    "logsumexp",
    "register_attention",
    "set_attention",
    "softmax",
]
