"""The dynamic (tree) 8-bit data type: 256 numbers in [-1, 1] spread over seven decades.

Dettmers 2016, "8-Bit Approximations for Parallelism in Deep Learning" (ICLR), and
Dettmers, Lewis, Shleifer & Zettlemoyer 2022, "8-bit Optimizers via Block-wise Quantization"
(ICLR), "dynamic tree quantization" and its unsigned variant (Section 2.2). An 8-bit code is read as

    sign | run of zero bits | indicator bit (1) | linear fraction bits
     s       e zeros              1                  7 - 1 - e bits (signed)

and stands for ``(-1)^s * 10^-e * fraction``, the fraction linear in [0.1, 1]. Each zero moved
into the exponent costs one fraction bit: large values get fine steps, tiny ones (down to
10^-6) coarse but *relative* steps. Adam's moments need exactly that: their magnitudes span
many decades, and a linear 8-bit grid (steps of 1/127) would round most of them to zero.

    signed map (first moment m)     e = 0..6 gives 2^(6-e) magnitudes each, with both signs:
                                    2 * 127 = 254 codes, plus 0 and 1                = 256
    unsigned map (second moment v)  no sign bit (v >= 0): one fraction bit more,
                                    2^(7-e) magnitudes each, 254 codes, plus 0 and 1 = 256

Each decade's 2^k values are the midpoints of k equal bins of [0.1, 1], scaled by 10^-e. This
is how ``bitsandbytes.functional.create_dynamic_map`` builds it, value for value (our tests
compare the two when bitsandbytes is installed), and it has a wrinkle: the 256th code is +1 and
there is no -1, so the signed map's most negative value is -0.99297 (the midpoint of the last
bin). A block whose absmax comes from a negative number stores it with a 0.7% error.

Left out: bitsandbytes' other maps (linear, quantile, NF4/FP4 for QLoRA).
"""

from __future__ import annotations

import torch

__all__ = ["dynamic_map", "nearest_code"]

EXPONENT_BITS = 7  # decades 10^0 .. 10^-6


def dynamic_map(signed: bool = True) -> torch.Tensor:
    """The 256 values of the dynamic data type, sorted ascending: (256,) float32.

    ``signed=True`` spans [-0.99297, 1] (for Adam's first moment), ``signed=False`` [0, 1] (second moment).
    """
    values = [torch.tensor([0.0, 1.0])]  # the two codes outside the exponent-fraction scheme
    fraction_bits = 6 if signed else 7  # of the 8 bits: a sign (if signed) and the indicator are spent
    for zeros in range(EXPONENT_BITS):  # e leading zeros: the decade 10^-e
        n = 2 ** (fraction_bits - zeros)  # each zero in the exponent takes one bit from the fraction
        edges = torch.linspace(0.1, 1.0, n + 1)  # (n+1,) edges of n equal bins of [0.1, 1]
        fractions = (edges[:-1] + edges[1:]) / 2  # (n,) the bins' midpoints
        magnitudes = 10.0**-zeros * fractions  # (n,) in (10^-e * 0.1, 10^-e)
        values += [magnitudes, -magnitudes] if signed else [magnitudes]
    code = torch.cat(values).sort().values  # (256,)
    assert code.numel() == 256, code.numel()
    return code


def nearest_code(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The index (uint8) of the value of the sorted ``code`` nearest to each element of ``x``.

    A binary search: ``torch.bucketize`` finds, for every x, how many of the 255 midpoints
    between neighbouring codes lie below it; that count is the index of the nearest code
    (a tie, x exactly on a midpoint, goes to the lower code).
    """
    code = code.to(x.device)  # the map is built on the CPU; the states may live on a GPU
    midpoints = (code[1:] + code[:-1]) / 2  # (255,) the decision boundaries, sorted like the code
    return torch.bucketize(x, midpoints).to(torch.uint8)  # x's shape, values 0..255
