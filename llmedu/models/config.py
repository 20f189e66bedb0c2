"""One dataclass that selects every variant of the course's transformer.

An ablation is one field: ``replace(cfg, position="alibi")``, ``replace(cfg, norm_placement="post")``.
``moe=MoEConfig(n_experts=8, top_k=2)`` replaces every block's FFN by a mixture of that many FFNs
of the same shape (``llmedu.nn.moe``), and says how much of its auxiliary losses the training loss adds.
The classmethods ``gpt2``, ``bert`` and ``llama`` give the settings of those families (at any size);
``__post_init__`` rejects impossible combinations before any weight is allocated.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass

from ..nn.activations import ACTIVATIONS
from ..nn.blocks import PLACEMENTS

__all__ = ["TransformerConfig", "MoEConfig", "POSITIONS", "NORMS", "BLOCKS"]

POSITIONS = ("learned", "sinusoidal", "scaled_sinusoidal", "relative", "alibi", "rope", "none")
NORMS = ("layernorm", "rmsnorm")
BLOCKS = ("serial", "parallel")
# sizes and counts: ints only (a bool is an int to Python, but never a size)
_INT_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "max_seq_len",
    "relative_buckets",
    "relative_max_distance",
    "type_vocab_size",
)


@dataclass
class MoEConfig:
    """A mixture of experts in place of every FFN (``llmedu.nn.moe.MoEFeedForward``).

    Each expert is an FFN of the config's ``d_ff`` and ``activation``; a token runs ``top_k`` of them,
    so the FFN's parameters grow ``n_experts``-fold and its FLOPs per token ``top_k``-fold.
    ``Transformer.moe_loss()`` is ``aux_loss_coef * load-balancing loss + z_loss_coef * z-loss``,
    summed over the layers: Switch's 0.01 (Fedus et al. 2021, sec. 2.2) and ST-MoE's 0.001 (Zoph et
    al. 2022, eq. 5's coefficient). Mixtral: ``MoEConfig(8, 2, capacity_factor=None)``, with SwiGLU and no biases.
    Switch: ``MoEConfig(E, 1, renormalize=False)``; a renormalised top-1 gate is always 1, and the router
    then learns from its auxiliary losses only.
    """

    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = 1.25  # None: no token is ever dropped
    renormalize: bool = True  # gates renormalised over the k chosen experts (Mixtral)
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    def __post_init__(self):
        if self.n_experts < 1:
            raise ValueError(f"moe.n_experts must be >= 1, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"moe.top_k must be in 1..n_experts={self.n_experts}, got {self.top_k}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"moe.capacity_factor must be > 0 (or None for no limit), got {self.capacity_factor}")
        if self.aux_loss_coef < 0 or self.z_loss_coef < 0:
            raise ValueError(f"the loss coefficients must be >= 0, got {self.aux_loss_coef}, {self.z_loss_coef}")


@dataclass
class TransformerConfig:
    # sizes
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as n_heads (MHA); 1: MQA; in between: GQA
    d_ff: int | None = None  # None: 4 * d_model
    max_seq_len: int = 512  # rows of a learned position table; the KV cache's default size
    # variants
    position: str = "learned"  # one of POSITIONS
    rope_base: float = 10000.0
    relative_buckets: int = 32
    relative_max_distance: int = 128
    norm: str = "layernorm"  # one of NORMS
    norm_eps: float = 1e-5
    norm_placement: str = "pre"  # pre, post, sandwich, deepnorm
    activation: str = "gelu"  # relu, gelu, gelu_tanh, silu, swiglu, geglu
    block: str = "serial"  # serial or parallel
    bias: bool = True  # biases in the linear layers and LayerNorms
    causal: bool = True  # False for an encoder (BERT)
    type_vocab_size: int = 0  # BERT's segment embeddings; 0 for none
    embedding_norm: bool = False  # a norm right after the embeddings (BERT)
    tie_embeddings: bool = True  # output projection shares the token embedding matrix
    moe: MoEConfig | None = None  # a mixture of experts in place of every FFN; None: dense
    # training
    dropout: float = 0.0
    init_std: float = 0.02
    attn_impl: str = "sdpa"  # a name registered in llmedu.nn.attention
    fused: bool = False  # norms and activations as torch's single kernels (same maths, faster)

    def __post_init__(self):
        if isinstance(self.moe, dict):  # from to_dict(), or a saved config
            self.moe = MoEConfig(**self.moe)
        for name in _INT_FIELDS:  # before any arithmetic: d_model=128.0 would make float shapes further on
            value = getattr(self, name)
            if value is None and name in ("n_kv_heads", "d_ff"):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}): give a whole number")
            setattr(self, name, int(value))  # a NumPy integer becomes a plain int (JSON can write it)
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.type_vocab_size < 0:
            raise ValueError(f"type_vocab_size must be >= 0 (0: no segment embeddings), got {self.type_vocab_size}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}")
        choices = {
            "position": POSITIONS,
            "norm": NORMS,
            "norm_placement": PLACEMENTS,
            "block": BLOCKS,
            "activation": tuple(ACTIVATIONS),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        if self.block == "parallel" and self.norm_placement != "pre":
            raise ValueError("the parallel block is pre-LN only; set norm_placement='pre'")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {self.head_dim}")
        if self.position in ("sinusoidal", "scaled_sinusoidal") and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    # -- families ----------------------------------------------------------------------------------------
    @classmethod
    def gpt2(cls, **overrides) -> TransformerConfig:
        """GPT-2: learned positions, pre-LN LayerNorm, tanh-GELU, biases, tied embeddings."""
        settings = dict(
            position="learned",
            norm="layernorm",
            norm_placement="pre",
            activation="gelu_tanh",
            bias=True,
            causal=True,
            tie_embeddings=True,
            max_seq_len=1024,
        )
        return cls(**{**settings, **overrides})

    @classmethod
    def bert(cls, **overrides) -> TransformerConfig:
        """BERT: learned positions and segments, post-LN with a norm after the embeddings, exact GELU."""
        settings = dict(
            position="learned",
            norm="layernorm",
            norm_eps=1e-12,
            norm_placement="post",
            activation="gelu",
            bias=True,
            causal=False,
            type_vocab_size=2,
            embedding_norm=True,
            tie_embeddings=True,
        )
        return cls(**{**settings, **overrides})

    @classmethod
    def llama(cls, **overrides) -> TransformerConfig:
        """LLaMA: RoPE, pre-norm RMSNorm, SwiGLU, no biases, untied output projection."""
        settings = dict(
            position="rope",
            norm="rmsnorm",
            norm_eps=1e-6,
            norm_placement="pre",
            activation="swiglu",
            bias=False,
            causal=True,
            tie_embeddings=False,
        )
        return cls(**{**settings, **overrides})
