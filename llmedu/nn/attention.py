"""Multi-head attention with shared key/value heads, masks, a KV cache and pluggable kernels.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(D) + M) V          (Vaswani et al. 2017, eq. 1)

* Multi-head (MHA): H query heads, H key/value heads.
* Multi-query (MQA, Shazeer 2019): H query heads share one key/value head.
* Grouped-query (GQA, Ainslie et al. 2023): H query heads in groups of H / H_kv, one key/value head
  per group. MHA (H_kv = H) and MQA (H_kv = 1) are its two ends. Fewer key/value heads mean a
  smaller KV cache: 2 * layers * H_kv * D * bytes per token.
* M holds the masks and biases, added to the scores: a causal mask (a query may not see later keys),
  a padding mask (nobody looks at padding), and position biases (ALiBi, T5). Masked scores are
  set to the most negative finite float, not -inf, so that a fully masked row gives no NaN.

``math_attention`` below is the equation, step by step. Every attention *function* of the course
(it, PyTorch's fused ``sdpa_attention``, lesson 17's flash attention) has the signature

    fn(q, k, v, causal: bool, attn_mask) -> out
        q (B, H, Tq, D); k, v (B, H_kv, Tk, D); out (B, H, Tq, D)
        attn_mask: None or a float tensor broadcastable to (B, H, Tq, Tk), added to the scores
        causal: query i sees keys j <= i + (Tk - Tq) (aligned bottom-right, so that the last query
                of a decoding step sees the whole cache)

and the ``Attention`` module calls the one it is told by name; the names are registered at the end
of this file ("math", "sdpa"; ``import llmedu.kernels`` adds "flash"), and another is one call away::

    register_attention("mine", my_attention)
    set_attention(model, "mine")     # or TransformerConfig(attn_impl="mine") before building

The KV cache that decoding passes in as ``cache=`` is in ``kv_cache.py``: anything with the members of
``KVCacheLike`` will do: the contiguous ``KVCache``, a batch of lesson 18's paged cache, lesson 19's
learned prefix.

Left out: dropout on the attention probabilities and cross-attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import KVCacheLike
from .positions import apply_rope

__all__ = [
    "math_attention",
    "repeat_kv",
    "causal_mask",
    "padding_bias",
    "sdpa_attention",
    "Attention",
    "kv_cache_bytes",
    "AttentionFn",
    "ATTENTION_FUNCTIONS",
    "register_attention",
    "get_attention",
    "set_attention",
]


# -- the equation, written out ------------------------------------------------------------------------
def math_attention(q, k, v, causal: bool, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """The equation, step by step. Materialises the (B, H, Tq, Tk) score matrix."""
    n_heads, t_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
    k, v = repeat_kv(k, n_heads), repeat_kv(v, n_heads)  # (B, H, Tk, D)
    scores = (q @ k.transpose(-2, -1)) * head_dim**-0.5  # (B, H, Tq, Tk)
    if attn_mask is not None:
        scores = scores + attn_mask
    if causal:
        allowed = causal_mask(t_q, k.shape[2], q.device)  # (Tq, Tk)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = scores.float().softmax(dim=-1).to(q.dtype)  # (B, H, Tq, Tk), rows sum to one
    return probs @ v  # (B, H, Tq, D)


# -- masks ---------------------------------------------------------------------------------------------
def causal_mask(t_q: int, t_k: int, device=None) -> torch.Tensor:
    """(Tq, Tk) bool, True where query i may see key j: j <= i + (Tk - Tq)."""
    if t_q > t_k:
        raise ValueError(f"more queries ({t_q}) than keys ({t_k}): a causal mask needs Tq <= Tk")
    i = torch.arange(t_q, device=device)[:, None]
    j = torch.arange(t_k, device=device)[None, :]
    return j <= i + (t_k - t_q)


def padding_bias(attention_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, Tk) of 1 (token) / 0 (padding) -> (B, 1, 1, Tk) additive bias: 0, or the most negative float."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (batch, keys), got shape {tuple(attention_mask.shape)}")
    keep = attention_mask.bool()[:, None, None, :]
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, H_kv, T, D) -> (B, H, T, D): each key/value head serves H / H_kv query heads."""
    n_kv = x.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"{n_kv} key/value heads do not divide {n_heads} query heads")
    return x if n_kv == n_heads else x.repeat_interleave(n_heads // n_kv, dim=1)


# -- PyTorch's fused kernel: the same function -----------------------------------------------------
def sdpa_attention(q, k, v, causal: bool, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """PyTorch's fused attention (flash / memory-efficient kernels where the device has them)."""
    n_heads, t_q, t_k = q.shape[1], q.shape[2], k.shape[2]
    if n_heads % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key/value heads do not divide {n_heads} query heads")
    # enable_gqa: each key/value head is read where it is stored, not copied H / H_kv times first; a
    # decoding step of GQA/MQA then reads H / H_kv times fewer cache bytes (lesson 04 measures it)
    gqa = {"enable_gqa": True} if k.shape[1] != n_heads else {}
    if causal and attn_mask is None and t_q == t_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    if causal:  # SDPA's own is_causal is aligned top-left; build the bottom-right mask ourselves
        allowed = causal_mask(t_q, t_k, q.device)
        base = attn_mask if attn_mask is not None else torch.zeros((), dtype=q.dtype, device=q.device)
        attn_mask = base.masked_fill(~allowed, torch.finfo(q.dtype).min)
    if attn_mask is not None:  # SDPA wants the mask in q's dtype; fp16 cannot hold fp32's most negative float
        attn_mask = attn_mask.clamp(min=torch.finfo(q.dtype).min).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **gqa)


# -- the module ------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Grouped-query self-attention: ``n_kv_heads`` = ``n_heads`` is MHA, 1 is MQA."""

    def __init__(
        self, d_model: int, n_heads: int, n_kv_heads: int | None = None, bias: bool = True, impl: str = "sdpa"
    ):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.impl = impl  # looked up at call time, so a function registered later can be chosen
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        causal: bool,
        attn_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCacheLike | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d). With a ``cache``, x holds only the new tokens: their keys and values
        are stored as layer ``layer`` of the cache, and the queries attend to all the keys it returns."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if rope is not None:
            cos, sin = rope  # (T, D) each
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, Hkv, T_past + T, D)
        out = get_attention(self.impl)(q, k, v, causal, attn_mask)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.o_proj(out)  # (B, T, d)


# -- the size of a KV cache (the cache itself is in kv_cache.py) -----------------------------------------
def kv_cache_bytes(
    n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, batch: int = 1, bytes_per_value: int = 4
) -> int:
    """The formula: keys and values (2) for every layer, KV head, channel, token and sequence."""
    return 2 * n_layers * n_kv_heads * head_dim * seq_len * batch * bytes_per_value


# -- choosing the attention function by name --------------------------------------------------------
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, "torch.Tensor | None"], torch.Tensor]
ATTENTION_FUNCTIONS: dict[str, AttentionFn] = {}


def register_attention(name: str, fn: AttentionFn | None = None, *, overwrite: bool = False):
    """Register ``fn`` under ``name``; usable as ``register_attention("x", fn)`` or as a decorator."""

    def add(f: AttentionFn) -> AttentionFn:
        if name in ATTENTION_FUNCTIONS and not overwrite:
            raise ValueError(f"an attention function {name!r} is already registered (pass overwrite=True)")
        ATTENTION_FUNCTIONS[name] = f
        return f

    return add if fn is None else add(fn)


def get_attention(name: str) -> AttentionFn:
    if name not in ATTENTION_FUNCTIONS:
        hint = " ('flash' is registered by `import llmedu.kernels`)" if name == "flash" else ""
        raise KeyError(f"no attention function {name!r}; registered: {sorted(ATTENTION_FUNCTIONS)}{hint}")
    return ATTENTION_FUNCTIONS[name]


def set_attention(model: nn.Module, name: str) -> None:
    """Switch every ``Attention`` inside ``model`` to the registered function ``name``."""
    get_attention(name)  # an unknown name fails here, not at the next forward
    for module in model.modules():
        if isinstance(module, Attention):
            module.impl = name


register_attention("math", math_attention)
register_attention("sdpa", sdpa_attention)
