"""FlashAttention-2 in readable PyTorch: tiles, an online softmax, and recomputation in backward.

Standard attention writes the (Tq, Tk) score matrix S = Q K^T / sqrt(D) and its softmax P to memory,
reads them back, and keeps P for the backward pass: O(T^2) bytes, and on a GPU a memory-bound
kernel. FlashAttention (Dao et al. 2022; FlashAttention-2, Dao 2023) never materialises S or P.
It walks over tiles of queries (Bq rows) and of keys/values (Bk columns) and keeps, per query row,
a running maximum m, a running sum l and an unnormalised output acc. When a new tile of scores
S_j arrives (FlashAttention-2, Algorithm 1):

    m_new = max(m, rowmax(S_j))
    l     = exp(m - m_new) * l   + rowsum(exp(S_j - m_new))
    acc   = exp(m - m_new) * acc + exp(S_j - m_new) V_j
    ...   and at the end  O = acc / l,   L = m + log(l)      (the logsumexp of each row)

Backward (Algorithm 2) saves only O and L (O(T) numbers per head beyond the inputs) and recomputes
each tile of probabilities exactly from them, P_ij = exp(S_ij - L_i); with D_i = rowsum(dO_i * O_i):

    dV_j += P_ij^T dO_i      dP_ij = dO_i V_j^T      dS_ij = P_ij * (dP_ij - D_i)
    dQ_i += dS_ij K_j / sqrt(D)                      dK_j += dS_ij^T Q_i / sqrt(D)

Every move between HBM and on-chip memory is marked: ``load(tile)`` and ``store(dst, value)`` (from
``traffic.py``, where they also count bytes, Section 3.2 of the paper). Also here: causal masking aligned bottom-right (query i sees keys j <= i + Tk - Tq, as in
``llmedu.nn.attention``) with the tiles above the diagonal skipped, not computed; any lengths
(the last tile is simply shorter); an additive or boolean mask (key padding, ALiBi); grouped-query
attention, by viewing the H query heads as (H_kv, H / H_kv) so that every key/value tile is read
once per group. Numerics follow the GPU kernel: scores, running statistics and accumulators are
fp32 (fp64 for fp64 inputs); P and dS are rounded to the input dtype before the matmuls that use them.

Left out: everything that makes the real kernel fast. Here one tile step is a handful of PyTorch
ops over every batch and head at once; on a GPU it is one thread block whose tiles live in SRAM,
with warp-level work partitioning; the outer loop (query tiles forward, key tiles backward) becomes the
grid and the inner loop runs inside each thread block. Also left out:
dropout, and gradients with respect to the mask.
"""

from __future__ import annotations

import math

import torch

from .traffic import add_into, load, store

__all__ = ["flash_attention", "FlashAttentionFunction", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = 128  # rows/columns per tile; 64-128 in the CUDA kernels (SRAM-bound there)


class FlashAttentionFunction(torch.autograd.Function):
    """Forward: Algorithm 1 of FlashAttention-2. Backward: Algorithm 2, recomputing P tile by tile.

    Called through ``flash_attention`` (below), which checks the inputs first; the tile helpers follow it.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, block_size, attn_mask):
        B, H, Tq, D = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        G, scale, offset = H // Hkv, D**-0.5, Tk - Tq
        wide = torch.promote_types(q.dtype, torch.float32)  # fp32 for bf16/fp16/fp32 inputs, fp64 for fp64
        qg = q.view(B, Hkv, G, Tq, D)  # query heads grouped by the key/value head they share
        mask = None if attn_mask is None else attn_mask.expand(B, H, Tq, Tk).view(B, Hkv, G, Tq, Tk)
        out = torch.empty(B, Hkv, G, Tq, D, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, Hkv, G, Tq, dtype=wide, device=q.device)  # the logsumexp L

        for q0, q1 in _tiles(Tq, block_size):
            q_i = load(qg[..., q0:q1, :], wide)  # (B, Hkv, G, Bq, D): read once, kept in SRAM
            m = torch.full(q_i.shape[:-1], -math.inf, dtype=wide, device=q.device)  # (B, Hkv, G, Bq) running max
            l = torch.zeros_like(m)  # (B, Hkv, G, Bq) running sum of exp(s - m)
            acc = torch.zeros_like(q_i)  # (B, Hkv, G, Bq, D) unnormalised output
            for k0, k1 in _tiles(Tk, block_size):
                if _skipped(causal, q1, k0, offset):
                    break  # every later tile is further in the future
                k_j = load(k[:, :, None, k0:k1], wide)  # (B, Hkv, 1, Bk, D): read once per query tile
                v_j = load(v[:, :, None, k0:k1], wide)  # (B, Hkv, 1, Bk, D), shared by the G query heads
                s = (q_i @ k_j.transpose(-2, -1)) * scale  # (B, Hkv, G, Bq, Bk)
                bias = _tile_bias(mask, causal, q0, q1, k0, k1, offset, wide, q.device)
                if bias is not None:
                    s = s + bias
                m_new = torch.maximum(m, s.amax(dim=-1))  # (B, Hkv, G, Bq)
                m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # rows that saw no key yet
                p = torch.exp(s - m_safe[..., None])  # (B, Hkv, G, Bq, Bk)
                alpha = torch.exp(m - m_safe)  # rescales what was summed under the old maximum
                l = alpha * l + p.sum(dim=-1)
                acc = alpha[..., None] * acc + _rounded(p, q.dtype) @ v_j  # (B, Hkv, G, Bq, D)
                m = m_new
            empty = l == 0  # queries that may see no key: output 0, logsumexp -inf
            store(out[..., q0:q1, :], acc / l.masked_fill(empty, 1.0)[..., None])  # written once, in q's dtype
            store(lse[..., q0:q1], (m + torch.log(l)).masked_fill(empty, -math.inf))

        out, lse = out.view(B, H, Tq, D), lse.view(B, H, Tq)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)  # beyond the inputs and output: lse, O(T)
        ctx.causal, ctx.block_size = causal, block_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        causal, block_size = ctx.causal, ctx.block_size
        B, H, Tq, D = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        G, scale, offset = H // Hkv, D**-0.5, Tk - Tq
        wide = torch.promote_types(q.dtype, torch.float32)
        qg = q.view(B, Hkv, G, Tq, D)
        do = grad_out.reshape(B, Hkv, G, Tq, D)
        mask = None if attn_mask is None else attn_mask.expand(B, H, Tq, Tk).view(B, Hkv, G, Tq, Tk)
        lse = lse.view(B, Hkv, G, Tq)
        delta = torch.empty(B, Hkv, G, Tq, dtype=wide, device=q.device)  # D_i, a pass of its own
        store(delta, (load(do, wide) * load(out.view(B, Hkv, G, Tq, D), wide)).sum(dim=-1))
        dq = torch.zeros(B, Hkv, G, Tq, D, dtype=wide, device=q.device)  # in HBM, added into by every key tile
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)

        for k0, k1 in _tiles(Tk, block_size):  # outer loop over keys: dK_j, dV_j stay local
            k_j = load(k[:, :, None, k0:k1], wide)  # (B, Hkv, 1, Bk, D): read once
            v_j = load(v[:, :, None, k0:k1], wide)
            dk_j = torch.zeros(B, Hkv, k1 - k0, D, dtype=wide, device=k.device)  # (B, Hkv, Bk, D)
            dv_j = torch.zeros_like(dk_j)
            for q0, q1 in _tiles(Tq, block_size):
                if _skipped(causal, q1, k0, offset):
                    continue
                q_i = load(qg[..., q0:q1, :], wide)  # (B, Hkv, G, Bq, D): read once per key tile
                do_i = load(do[..., q0:q1, :], wide)
                lse_i = load(lse[..., q0:q1])  # (B, Hkv, G, Bq)
                lse_i = lse_i.masked_fill(lse_i == -math.inf, math.inf)  # rows that saw no key: P = 0
                delta_i = load(delta[..., q0:q1])  # (B, Hkv, G, Bq)
                s = (q_i @ k_j.transpose(-2, -1)) * scale  # (B, Hkv, G, Bq, Bk), recomputed
                bias = _tile_bias(mask, causal, q0, q1, k0, k1, offset, wide, q.device)
                if bias is not None:
                    s = s + bias
                p = torch.exp(s - lse_i[..., None])  # (B, Hkv, G, Bq, Bk): exact probabilities
                dv_j += (_rounded(p, q.dtype).transpose(-2, -1) @ do_i).sum(dim=2)  # summed over the G heads
                dp = do_i @ v_j.transpose(-2, -1)  # (B, Hkv, G, Bq, Bk)
                ds = _rounded(p * (dp - delta_i[..., None]), q.dtype)  # softmax's Jacobian
                add_into(dq[..., q0:q1, :], (ds @ k_j) * scale)  # (B, Hkv, G, Bq, D), read and written
                dk_j += (ds.transpose(-2, -1) @ q_i).sum(dim=2) * scale  # (B, Hkv, Bk, D)
            store(dk[:, :, k0:k1], dk_j)  # written once
            store(dv[:, :, k0:k1], dv_j)

        dq_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        store(dq_out, load(dq).view(B, H, Tq, D))  # the fp32 sums, rounded to q's dtype: one more pass
        return dq_out, dk, dv, None, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention, computed tile by tile in O(T) memory.

    Args:
        q: (B, H, Tq, D) queries.
        k, v: (B, H_kv, Tk, D) keys and values; H_kv divides H (GQA/MQA).
        causal: query i sees keys j <= i + (Tk - Tq) (bottom-right aligned; needs Tq <= Tk).
        block_size: queries and keys per tile.
        attn_mask: None, or a tensor broadcastable to (B, H, Tq, Tk): bool (True = may attend)
            or float (added to the scores). A key padding mask is (B, 1, 1, Tk).
    Returns:
        (B, H, Tq, D). A query that may see no key at all gets zeros.
    """
    _check_inputs(q, k, v, causal, block_size, attn_mask)
    return FlashAttentionFunction.apply(q, k, v, causal, block_size, attn_mask)


# -- the tiles ----------------------------------------------------------------------------------------
def _tiles(n: int, size: int) -> list[tuple[int, int]]:
    """[(start, end), ...] covering range(n); the last tile is shorter when size does not divide n."""
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _tile_bias(
    mask, causal: bool, q0: int, q1: int, k0: int, k1: int, offset: int, wide: torch.dtype, device
) -> torch.Tensor | None:
    """The additive bias of one (Bq, Bk) tile: 0 where a query may attend, -inf where not (or None).

    ``mask`` is the user's mask viewed as (B, H_kv, G, Tq, Tk) (broadcast, never copied).
    """
    bias = None
    if mask is not None:
        tile = mask[..., q0:q1, k0:k1]
        bias = (
            torch.zeros(tile.shape, dtype=wide, device=device).masked_fill(~tile, -math.inf)
            if tile.dtype == torch.bool
            else tile.to(wide)
        )
    if causal and k1 - 1 > q0 + offset:  # some key of this tile is in the future of some query
        rows = torch.arange(q0, q1, device=device)[:, None]  # (Bq, 1)
        cols = torch.arange(k0, k1, device=device)[None, :]  # (1, Bk)
        future = torch.zeros(q1 - q0, k1 - k0, dtype=wide, device=device).masked_fill(cols > rows + offset, -math.inf)
        bias = future if bias is None else bias + future
    return bias


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (the precision of the kernel's matmul inputs), kept in its wide dtype."""
    return x.to(dtype).to(x.dtype)


def _skipped(causal: bool, q1: int, k0: int, offset: int) -> bool:
    """True when every key of the tile is in the future of every query: the tile is never computed."""
    return causal and k0 > (q1 - 1) + offset


# -- the inputs, checked before any tile is computed ------------------------------------------------
def _check_inputs(q, k, v, causal, block_size, attn_mask) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D tensor (batch, heads, tokens, head_dim), got {getattr(t, 'shape', t)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q has {q.shape[0]}, k and v have {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q has D={q.shape[-1]}, k and v have D={k.shape[-1]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key/value heads do not divide {q.shape[1]} query heads")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"more queries ({q.shape[2]}) than keys ({k.shape[2]}): causal attention needs Tq <= Tk")
    if attn_mask is not None:
        full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:
            if torch.broadcast_shapes(attn_mask.shape, full) != full:
                raise RuntimeError
        except RuntimeError:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Tq, Tk) = {full}"
            ) from None
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool (True = attend) or float (added to scores), got {attn_mask.dtype}")
        if attn_mask.requires_grad:
            raise ValueError("flash_attention does not compute gradients for attn_mask; pass attn_mask.detach()")
