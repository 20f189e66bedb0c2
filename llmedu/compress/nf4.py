"""NF4: 4-bit NormalFloat with block-wise absmax scales and double quantization (QLoRA).

Dettmers, Pagnoni, Holtzman & Zettlemoyer 2023, "QLoRA: Efficient Finetuning of Quantized LLMs",
Section 3 and Appendix E. Pretrained weights are close to normally distributed, so the 16 codes are
placed at *quantiles* of N(0, 1), giving each code about the same share of the weights, then scaled
into [-1, 1]. To have an exact 0 with 16 codes the two halves are built apart: 8 positive quantiles
and 7 negative ones, from the probabilities evenly spaced between 1/2 and ``offset``:

    offset = 1 - (1/(2*15) + 1/(2*16)) / 2 = 0.9677083         (between the 15- and 16-code choices)
    positive = Phi^-1(linspace(offset, 1/2, 9)[:-1])           8 values
    negative = -Phi^-1(linspace(offset, 1/2, 8)[:-1])          7 values
    NF4 = sort(positive + [0] + negative) / max                 16 values in [-1, 1]

This is bitsandbytes' ``create_normal_map(0.9677083)``; our tests check it value for value against
the table QLoRA publishes and bitsandbytes ships.

Block-wise quantization (``block_size`` = 64): each block of 64 consecutive weights is divided by its
absmax and every element becomes the index of its nearest NF4 value; two 4-bit indices share a byte.
*Double quantization* then quantizes the fp32 absmaxes themselves: subtract their mean, and store
them with the 8-bit dynamic data type in blocks of 256 (``llmedu.optim.eight_bit``), one fp32 scale
per 256 blocks. Memory per parameter (a count, not a measurement):

    4 + 32/64 = 4.5 bits          without double quantization
    4 + 8/64 + 32/(64*256) = 4.127 bits    with it (plus one fp32 mean per tensor)

Left out: FP4 (bitsandbytes' other 4-bit type), the CUDA dequantize kernels, paged optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from ..optim.eight_bit import dequantize_blockwise, quantize_blockwise
from ..optim.quantization_map import dynamic_map, nearest_code

__all__ = ["NF4_OFFSET", "nf4_code", "NF4Tensor", "quantize_nf4", "dequantize_nf4", "nf4_bits_per_parameter"]

NF4_OFFSET = 0.9677083  # 1 - (1/(2*15) + 1/(2*16)) / 2 = 0.96770833..., to the 7 digits QLoRA used


def nf4_code(offset: float = NF4_OFFSET) -> torch.Tensor:
    """The 16 NF4 values, ascending, from normal quantiles: (16,) float32, with code[7] == 0."""
    if not 0.5 < offset < 1:
        raise ValueError(f"offset must lie in (0.5, 1) (a probability above the median), got {offset}")
    normal_quantile = torch.special.ndtri  # Phi^-1, the inverse CDF of N(0, 1)
    # linspace in float32 as bitsandbytes does, the quantiles in float64 as scipy's norm.ppf
    positive = normal_quantile(torch.linspace(offset, 0.5, 9)[:-1].double())  # (8,)
    negative = -normal_quantile(torch.linspace(offset, 0.5, 8)[:-1].double())  # (7,)
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).float().sort().values  # (16,)
    return values / values.max()  # the normalisation in float32, as bitsandbytes does


@cache
def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 and the signed dynamic 8-bit map, built once (every dequantization needs both)."""
    return nf4_code(), dynamic_map(True)


@dataclass
class NF4Tensor:
    """A tensor in NF4: packed 4-bit codes and its block scales (fp32, or 8-bit when double-quantized)."""

    packed: torch.Tensor  # (numel / 2,) uint8: two codes per byte, the first in the high nibble
    shape: torch.Size
    block_size: int
    absmax: torch.Tensor | None = None  # (n_blocks,) fp32, without double quantization
    absmax_codes: torch.Tensor | None = None  # (n_blocks,) uint8 codes of absmax - offset, with it
    absmax_scales: torch.Tensor | None = None  # (ceil(n_blocks / dq_block_size),) fp32
    absmax_offset: float | torch.Tensor = 0.0  # the mean of the absmaxes, subtracted before their quantization
    dq_block_size: int = 256

    @property
    def double_quant(self) -> bool:
        return self.absmax_codes is not None

    def nbytes(self) -> int:
        """Bytes stored: packed codes plus scales (what 4.5 or 4.127 bits per parameter count)."""
        tensors = [self.packed, self.absmax, self.absmax_codes, self.absmax_scales]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + 4 * self.double_quant

    def block_absmax(self) -> torch.Tensor:
        """(n_blocks,) fp32: the scales, dequantized when double quantization stored them in 8 bits."""
        if not self.double_quant:
            return self.absmax
        return dequantize_blockwise(self.absmax_codes, self.absmax_scales, _tables()[1], self.dq_block_size) + (
            self.absmax_offset
        )


def _check_block(name: str, block_size, numel: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 or block_size % 2:
        raise ValueError(f"{name} must be a positive even int (two 4-bit codes per byte), got {block_size!r}")
    if numel % block_size:
        raise ValueError(
            f"{name}={block_size} does not divide the tensor's {numel} elements; choose a divisor "
            f"(64 divides every dimension that is a multiple of 64)"
        )


def quantize_nf4(
    w: torch.Tensor, block_size: int = 64, double_quant: bool = True, dq_block_size: int = 256
) -> NF4Tensor:
    """w (any shape, float) -> NF4Tensor: nearest NF4 code of w / absmax, block by block."""
    if not w.is_floating_point():
        raise TypeError(f"can only quantize floating-point tensors, got {w.dtype}")
    _check_block("block_size", block_size, w.numel())
    if isinstance(dq_block_size, bool) or not isinstance(dq_block_size, int) or dq_block_size <= 0:
        raise ValueError(f"dq_block_size must be a positive int, got {dq_block_size!r}")
    blocks = w.detach().float().reshape(-1, block_size)  # (n_blocks, B)
    absmax = blocks.abs().amax(dim=1)  # (n_blocks,)
    normed = blocks / absmax.where(absmax > 0, 1.0)[:, None]  # (n_blocks, B) in [-1, 1]
    codes = nearest_code(normed, _tables()[0].to(w.device)).reshape(-1)  # (numel,) uint8 in 0..15
    packed = (codes[0::2] << 4) | codes[1::2]  # (numel / 2,): high nibble first, as bitsandbytes
    out = NF4Tensor(packed=packed, shape=w.shape, block_size=block_size, dq_block_size=dq_block_size)
    if not double_quant:
        out.absmax = absmax
        return out
    out.absmax_offset = absmax.mean().item()
    out.absmax_codes, out.absmax_scales = quantize_blockwise(absmax - out.absmax_offset, _tables()[1], dq_block_size)
    return out


def dequantize_nf4(t: NF4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NF4Tensor -> a dense tensor of its shape: ``NF4[code] * absmax`` per block."""
    codes = torch.stack([t.packed >> 4, t.packed & 0xF], dim=1).reshape(-1)  # (numel,) uint8
    values = _tables()[0].to(t.packed.device)[codes.long()].reshape(-1, t.block_size)  # (n_blocks, B)
    return (values * t.block_absmax()[:, None]).reshape(t.shape).to(dtype)


def nf4_bits_per_parameter(block_size: int = 64, double_quant: bool = True, dq_block_size: int = 256) -> float:
    """Storage per weight in bits, a count: 4 + the block scale's share (QLoRA Section 3)."""
    if double_quant:
        return 4 + 8 / block_size + 32 / (block_size * dq_block_size)
    return 4 + 32 / block_size
