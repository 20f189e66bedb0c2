"""8-bit AdamW: both moments stored as 8-bit codes, quantized block-wise with the dynamic data type.

Dettmers, Lewis, Shleifer & Zettlemoyer 2022, "8-bit Optimizers via Block-wise Quantization"
(ICLR), Section 2. fp32 AdamW keeps m and v in 4 + 4 = 8 bytes per parameter, usually more than
the parameters themselves. Here each is 1 byte (a code of ``quantization_map.dynamic_map``) plus
one fp32 scale per block of ``block_size`` elements:

    bytes per parameter = 2 + 2 * 4 / block_size          (2.004 at block size 2048, the paper's)

Block-wise quantization of a tensor x (Section 2.1):

    split x (flattened) into blocks of B elements; pad the last one with zeros (they change no absmax)
    N_b    = max |x| over the block b                              the block's absmax (fp32)
    code_i = argmin_j | code[j] - x_i / N_b |                      nearest value of the map (uint8)
    x_i   ~= code[code_i] * N_b                                    dequantize

One absmax per *block*, not per tensor: an outlier (Adam's moments have them) only coarsens its
own block; and every block is independent, which is what makes it fast on a GPU. The quantization
error of an element is at most half the gap between the two codes around x_i / N_b, times N_b:
at most ``N_b * 0.0140625 / 2`` (the widest gap, 0.9/64 in the top decade of the signed map).

Each step (Section 2, and as bitsandbytes does it): dequantize m and v to fp32, do the AdamW
update of ``adamw.adamw_update_`` in fp32 (the parameter update uses the fresh fp32 moments),
quantize m with the signed map and v (>= 0) with the unsigned map, keep only the codes and absmax.
Like bitsandbytes, tensors with fewer than ``min_8bit_size`` elements (biases, norms) keep fp32
moments: they are a small share of the memory, and quantizing them saves nothing worth the error.

The parameters themselves are updated in their own dtype. On bf16 parameters an update smaller than
half a bf16 ulp of the weight (``lr * m / sqrt(v)`` below ~2^-9 of |w|) rounds away, every step: keep
fp32 master weights (lesson 07's ``precision``) when the parameters are bf16, as the paper does.

Left out: the paper's stable embedding layer (Section 2.3: a LayerNorm after the embedding, and its
moments in 32-bit), the fused CUDA kernel that does all of this without the fp32 temporaries
(here the dequantized m and v of one tensor exist for the length of its update), paged optimizer
states. bitsandbytes' ``AdamW8bit`` is the production version (recent releases quantize the optimizer
states in blocks of 256 elements, not the paper's 2048).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable

import torch
from torch.nn import functional as F

from .adamw import adamw_update_, check_hyperparameters
from .quantization_map import dynamic_map, nearest_code

__all__ = ["AdamW8bit", "quantize_blockwise", "dequantize_blockwise", "state_bytes"]


def _check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int (elements per absmax), got {block_size!r}")
    return block_size


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """(n,) -> (n_blocks, block_size), the last block padded with zeros."""
    n_blocks = math.ceil(flat.numel() / block_size)
    return F.pad(flat, (0, n_blocks * block_size - flat.numel())).view(n_blocks, block_size)


def quantize_blockwise(
    x: torch.Tensor, code: torch.Tensor, block_size: int = 2048
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, float) -> (codes: uint8 of x's shape, absmax: (ceil(x.numel() / block_size),) fp32)."""
    _check_block_size(block_size)
    if not x.is_floating_point():
        raise TypeError(f"can only quantize floating-point tensors, got {x.dtype}")
    blocks = _blocks(x.detach().reshape(-1).float(), block_size)  # (n_blocks, B)
    absmax = blocks.abs().amax(dim=1)  # (n_blocks,)
    normed = blocks / absmax.where(absmax > 0, 1.0)[:, None]  # (n_blocks, B) in [-1, 1]; an all-zero block stays 0
    codes = nearest_code(normed, code)  # (n_blocks, B) uint8
    return codes.view(-1)[: x.numel()].view(x.shape), absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block_size: int = 2048
) -> torch.Tensor:
    """(codes: uint8, absmax: (n_blocks,)) -> fp32 tensor of codes' shape: ``code[codes] * absmax`` per block."""
    _check_block_size(block_size)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8 (indices into the 256-value map), got {codes.dtype}")
    n_blocks = math.ceil(codes.numel() / block_size)
    if absmax.shape != (n_blocks,):
        raise ValueError(
            f"{codes.numel()} codes in blocks of {block_size} need {n_blocks} absmax values, got shape "
            f"{tuple(absmax.shape)}: was it quantized with another block_size?"
        )
    values = code.to(codes.device)[codes.reshape(-1).long()]  # (n,) in [-1, 1]
    blocks = _blocks(values, block_size) * absmax[:, None]  # (n_blocks, B)
    return blocks.view(-1)[: codes.numel()].view(codes.shape)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's per-parameter state (moments, codes, absmax, steps)."""
    return sum(
        t.numel() * t.element_size()
        for per_param in optimizer.state.values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor)
    )


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose moments live as block-wise 8-bit codes (Dettmers et al. 2022).

    State of a parameter with at least ``min_8bit_size`` elements: ``step``, ``exp_avg_codes`` and
    ``exp_avg_sq_codes`` (uint8, the parameter's shape), ``exp_avg_absmax`` and ``exp_avg_sq_absmax``
    (fp32, one per block), and the ``block_size`` they were quantized with: state saved with another
    block size is refused on loading (its absmax would scale the wrong elements). Smaller parameters
    keep fp32 ``exp_avg`` and ``exp_avg_sq`` as in AdamW.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block_size: int = 2048,
        min_8bit_size: int = 4096,
    ):
        check_hyperparameters(lr, betas, eps, weight_decay)
        _check_block_size(block_size)
        if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
            raise ValueError(f"min_8bit_size must be an int >= 0, got {min_8bit_size!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for group in self.param_groups:
            check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        self.block_size, self.min_8bit_size = block_size, min_8bit_size
        self.signed_map = dynamic_map(signed=True)  # (256,) for m, which has both signs
        self.unsigned_map = dynamic_map(signed=False)  # (256,) for v >= 0: one more bit of fraction
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(signed, unsigned) maps on ``device``, copied there once: not a host-to-GPU copy per step."""
        if device not in self._on_device:
            self._on_device[device] = (self.signed_map.to(device), self.unsigned_map.to(device))
        return self._on_device[device]

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = torch.tensor(0.0)
        if p.numel() < self.min_8bit_size:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            return
        state["block_size"] = self.block_size
        zero = torch.zeros_like(p, dtype=torch.float32)
        for name, code in zip(("exp_avg", "exp_avg_sq"), self._maps(p.device)):
            state[f"{name}_codes"], state[f"{name}_absmax"] = quantize_blockwise(zero, code, self.block_size)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Dequantize, update in fp32, re-quantize; ``closure`` (optional) recomputes and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not support sparse gradients (nn.Embedding(sparse=True))")
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                quantized = "exp_avg_codes" in state
                signed, unsigned = self._maps(p.device)
                if quantized:  # (p's shape) fp32 moments, for the length of this update only
                    m = dequantize_blockwise(state["exp_avg_codes"], state["exp_avg_absmax"], signed, self.block_size)
                    v = dequantize_blockwise(
                        state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], unsigned, self.block_size
                    )
                else:
                    m, v = state["exp_avg"], state["exp_avg_sq"]
                p32 = p if p.dtype == torch.float32 else p.float()  # the update is done in fp32
                hyper = group["lr"], beta1, beta2, group["eps"], group["weight_decay"]
                adamw_update_(p32, p.grad.float(), m, v, int(state["step"].item()), *hyper)
                if p32 is not p:
                    p.copy_(p32)
                if quantized:
                    m_codes, m_absmax = quantize_blockwise(m, signed, self.block_size)
                    v_codes, v_absmax = quantize_blockwise(v, unsigned, self.block_size)
                    state["exp_avg_codes"], state["exp_avg_absmax"] = m_codes, m_absmax
                    state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"] = v_codes, v_absmax
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer``'s, but keep the codes uint8 and the absmax fp32.

        torch casts every state tensor except ``step`` to the parameter's dtype (right for fp32
        moments, wrong for indices and scales): put back a copy of the saved tensors as they were.
        State quantized with another ``block_size`` is refused before anything changes.
        """
        for i, saved in state_dict["state"].items():
            if "exp_avg_codes" not in saved:
                continue
            blocks, n, n_absmax = saved.get("block_size"), saved["exp_avg_codes"].numel(), len(saved["exp_avg_absmax"])
            if blocks is None:  # saved before the block size was recorded: the number of blocks is all there is
                if n_absmax != math.ceil(n / self.block_size):
                    raise ValueError(
                        f"the 8-bit state of parameter {i} has {n_absmax} blocks for {n} elements, block_size="
                        f"{self.block_size} makes {math.ceil(n / self.block_size)}: it was quantized with another one"
                    )
                warnings.warn(f"the 8-bit state of parameter {i} records no block_size: not checked", stacklevel=2)
            elif blocks != self.block_size:
                raise ValueError(
                    f"the 8-bit state of parameter {i} was quantized in blocks of {blocks} elements, this AdamW8bit "
                    f"uses block_size={self.block_size}: its absmax values would scale the wrong elements; build the "
                    f"optimizer with block_size={blocks} to load it"
                )
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for p, i in zip(params, saved_ids):
            for name, value in state_dict["state"].get(i, {}).items():
                if name.endswith(("_codes", "_absmax")):
                    self.state[p][name] = value.to(p.device, copy=True)
