"""Mixed precision from scratch: number formats, fp32 master weights, a dynamic loss scaler.

Micikevicius et al. 2018, "Mixed Precision Training", train in 16 bits with three ideas:

1. **fp32 master weights.** The forward and backward passes run on 16-bit copies of the weights,
   but the update ``w <- w - lr * g`` is applied to an fp32 copy. In fp16 an update smaller than
   half the spacing between neighbouring numbers (2^-11 relative to w) is rounded away: a weight of
   1.0 ignores every increase below 2^-11 = 0.00049 and every decrease below 2^-12 = 0.00024 (the
   spacing just below 1.0 is half that above it). ``MasterWeights`` keeps that copy.
2. **Loss scaling.** fp16 has 5 exponent bits: it cannot hold magnitudes below 2^-24 (6e-8), and
   many activation gradients are smaller (the paper's Figure 3). Multiplying the loss by S
   multiplies every gradient by S (the chain rule is linear), lifting them into range; dividing by S
   before the update undoes it. Too large an S overflows to inf, so the *dynamic* scaler
   (``LossScaler``) halves S and skips the step when a gradient is inf/NaN, and doubles S after
   ``growth_interval`` clean steps: S rides just below the overflow line.
3. **fp32 accumulation** (the paper's Sec. 3.3, "arithmetic precision"): dot products and large
   reductions add their terms in fp32 and round once at the end. Matmul units and PyTorch's reduction
   kernels (sum, softmax, layer_norm) already do so whatever their output dtype; what stalls is a
   16-bit *buffer* added to again and again (a bf16 ``.grad`` across micro-batches, bf16 weights
   without a master copy). CUDA's autocast fp32 list (exp, log, pow, softmax, norms, losses) is about
   range and output precision; the CPU's bf16 list is shorter (softmax and layer_norm return bf16).

bf16 (Google Brain's format, studied for training by Kalamkar et al. 2019) keeps fp32's 8 exponent
bits and keeps 7 of its 23 mantissa bits (conversion rounds to nearest even): the same range as fp32,
so no loss scaling is needed, at about 2.4 significant decimal digits (8 significant bits). With
``torch.autocast`` the parameters stay fp32 (they *are* the master weights) and each op casts its
inputs to 16 bits as it runs: that is the practical path, policy ``Precision("bf16")``.

``LossScaler`` makes the same decisions as ``torch.amp.GradScaler`` (the tests replay one gradient
sequence through both). Left out: per-optimizer bookkeeping for several optimizers, the fused
inf-check kernels, fp8 (per-tensor scales, Micikevicius et al. 2022).
"""

from __future__ import annotations

import contextlib
import math
import struct
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["PRECISIONS", "Precision", "LossScaler", "MasterWeights", "format_info", "bit_pattern"]

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_BITS = {torch.float32: (8, 23), torch.bfloat16: (8, 7), torch.float16: (5, 10)}  # exponent, mantissa


# -- the number formats ---------------------------------------------------------------------------
def format_info(dtype: torch.dtype) -> dict:
    """Bit layout and range of a floating-point format (the numbers come from ``torch.finfo``)."""
    if dtype not in _BITS:
        raise ValueError(f"format_info knows {list(_BITS)}, got {dtype}")
    exponent, mantissa = _BITS[dtype]
    info = torch.finfo(dtype)
    return {
        "bits": 1 + exponent + mantissa,
        "exponent bits": exponent,
        "mantissa bits": mantissa,
        "max": info.max,
        "smallest normal": info.tiny,
        "smallest subnormal": info.smallest_normal * 2.0**-mantissa,
        "eps (1 -> next)": info.eps,
        "decimal digits": math.log10(2.0 ** (mantissa + 1)),
    }


def bit_pattern(value: float, dtype: torch.dtype) -> str:
    """``value`` rounded to ``dtype`` as 'sign exponent mantissa' bits, e.g. '0 01111 0000000000'."""
    if dtype not in _BITS:
        raise ValueError(f"bit_pattern knows {list(_BITS)}, got {dtype}")
    exponent, mantissa = _BITS[dtype]
    if dtype == torch.float32:
        raw = struct.unpack(">I", struct.pack(">f", value))[0]
    else:  # bf16 and fp16 are 16-bit: read the rounded value's bits as an int16
        raw = torch.tensor([value], dtype=dtype).view(torch.int16).item() & 0xFFFF
    bits = format(raw, f"0{1 + exponent + mantissa}b")
    return f"{bits[0]} {bits[1 : 1 + exponent]} {bits[1 + exponent :]}"


# -- the dynamic loss scaler ----------------------------------------------------------------------
class LossScaler:
    """Scale the loss up, unscale the gradients, skip steps that overflowed, adapt the scale.

    Per optimizer step::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)        # optional: before clipping gradients
        scaler.step(optimizer)            # skipped when a gradient is inf or NaN
        scaler.update()                   # back off on overflow, grow after a clean streak
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0  # steps since the last overflow (GradScaler's "growth tracker")
        self._found_inf: bool | None = None  # the verdict of this step's unscale_, until update()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times S: its gradients are the true gradients times S."""
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the (fp32) gradients by S in place; return True if any of them is inf or NaN.

        Call it before clipping: a norm clipped to 1.0 on gradients still scaled by S would clip them S times too hard.
        """
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called for this step; call update() first")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for g in grads:  # checked before any gradient changes, as torch.amp.GradScaler.unscale_ refuses them too
            if g.dtype == torch.float16:
                raise ValueError(
                    f"unscale_ got an fp16 gradient of shape {tuple(g.shape)}: dividing it by S = {self.scale_value:g} "
                    "in fp16 loses again every true gradient below fp16's range (2^-24), undoing the scaling. Give the "
                    "optimizer fp32 parameters (autocast keeps them fp32), or call MasterWeights.grads_to_master() first"
                )
        inv_scale = 1.0 / self.scale_value
        finite = True
        for g in grads:
            g.mul_(inv_scale)  # in fp32: a scaled 2^-14 comes back as 2^-30, which fp32 holds
            finite = finite and bool(torch.isfinite(g).all())
        self._found_inf = not finite
        return self._found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` unless a gradient overflowed; returns whether it stepped."""
        if self._found_inf is None:
            self.unscale_(optimizer)
        if self._found_inf:
            return False  # the weights keep their values; only the scale changes, in update()
        optimizer.step()
        return True

    def update(self) -> None:
        """Halve S after an overflow; multiply it by ``growth_factor`` after a clean streak."""
        if self._found_inf is None:
            raise RuntimeError("update() needs unscale_() or step() first in this step")
        if self._found_inf:
            self.scale_value *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.clean_steps = 0
        self._found_inf = None

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


# -- fp32 master weights for a model stored in 16 bits --------------------------------------------
class MasterWeights:
    """Cast ``model`` to ``dtype`` in place and keep fp32 copies of its weights for the optimizer.

    Build the optimizer on ``masters.params`` (fp32), not on the model. Per step::

        scaler.scale(loss_fn(model, batch)).backward()   # 16-bit forward and backward
        masters.grads_to_master()                        # 16-bit grads -> fp32 .grad of the copies
        scaler.step(optimizer); scaler.update()          # the update happens in fp32
        masters.master_to_model()                        # round the new weights to 16 bits

    Memory per parameter, a count: 2 (16-bit weight) + 4 (fp32 master) + the optimizer's state (8
    for Adam) = 14 bytes between steps; from ``grads_to_master`` to the optimizer's ``zero_grad``
    the fp32 gradient (4) is held for the whole model too: 18 bytes at the peak (the 16-bit
    gradient, 2, is freed tensor by tensor as it is copied). The ZeRO paper's (2 + 2 + K) = 16 with
    K = 12 assumes a 16-bit gradient and no fp32 gradient held for the whole model at once.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"master weights are for 16-bit models; got dtype {dtype}")
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        if any(p.dtype != torch.float32 for p in self.model_params):
            raise ValueError("MasterWeights needs an fp32 model: the masters are copied from it before the cast")
        self.params = [p.detach().clone().requires_grad_(True) for p in self.model_params]  # fp32
        model.to(dtype)  # the same Parameter objects now hold 16-bit data

    @torch.no_grad()
    def grads_to_master(self) -> None:
        for p, master in zip(self.model_params, self.params):
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None  # the 16-bit gradient is not needed any more

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, master in zip(self.model_params, self.params):
            p.copy_(master)  # rounds to the model's 16-bit format


# -- the policy the trainer uses ------------------------------------------------------------------
@dataclass
class Precision:
    """How the trainer computes: 'fp32', 'bf16' (autocast) or 'fp16' (autocast + loss scaler).

    With autocast the weights, gradients and optimizer state stay fp32; matmuls and convolutions
    run in 16 bits. Which other ops stay fp32 is set by PyTorch's per-device autocast op lists: on
    CUDA softmax, norms and losses run in fp32; on the CPU with bf16 (checked on torch 2.13) softmax, layer_norm
    and scaled_dot_product_attention of bf16 inputs return bf16, while cross-entropy stays fp32.
    """

    name: str = "fp32"
    scaler: LossScaler | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.name not in PRECISIONS:
            raise ValueError(f"unknown precision {self.name!r}; choose one of {PRECISIONS}")
        if self.name == "fp16" and self.scaler is None:
            self.scaler = LossScaler()
        if self.name != "fp16" and self.scaler is not None:
            raise ValueError(f"a loss scaler is only used with fp16, not {self.name}")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    def autocast(self, device_type: str):
        """The context for the forward pass (and the loss): autocast, or nothing for fp32."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)
