"""What fp8 costs a gradient: fp8 and bf16 gradients against fp32's, on the same weights and batch.

One fp32 run of a small GPT (AdamW, Shakespeare bytes) is the trajectory. At every step, before the
fp32 update, copies of the same weights compute the gradient of the same batch three more ways:

    fp8 delayed   every nn.Linear an ``FP8Linear`` with delayed scaling (scale from the amax history of
                  the trajectory's own earlier steps: one step stale, as in Transformer Engine's recipe)
    fp8 current   the same layers with ``CurrentScaling``: each tensor scaled by its own amax before its
                  cast (torchao's float8 training; Transformer Engine's ``Float8CurrentScaling``)
    bf16          ``torch.autocast(dtype=bfloat16)``: the matmuls take bf16 inputs

and each gradient (all parameters, flattened) is compared with fp32's: cosine similarity, relative
error ||g - g_fp32|| / ||g_fp32||, and the share of the squared error that sits in the token embedding
(tied to the LM head, whose output projection is cast to fp8 too). Beside them, the batch's own
sampling noise at the same weights: ||g_B' - g_B|| / ||g_B|| with g_B' the fp32 gradient of an
independent batch, the error SGD already accepts when it trains on a batch instead of the corpus. Comparing gradients at the same weights measures the format's error
directly; comparing training curves would also measure when each run happens to leave a plateau, which
small perturbations of any kind decide. The shadow models never update the weights: their scaling
state sees exactly the tensors of the fp32 run.

Left out: the error that accumulates along an fp8 trajectory (the weights here are always fp32's),
per-block scaling (MXFP8), fp8 attention.
"""

from __future__ import annotations

import copy

import torch

from ..data import load_corpus
from ..models.config import TransformerConfig
from ..models.gpt import CausalLM, lm_loss
from ..parallel.mesh import byte_batches
from .fp8 import DelayedScaling, FP8Linear, Quantized, convert_to_fp8, fp8_counts

__all__ = ["CurrentScaling", "use_current_scaling", "gradient_errors", "GRADIENT_VARIANTS"]

GRADIENT_VARIANTS = ("fp8 delayed", "fp8 current", "bf16")
NOISE_SEED_OFFSET = 1_000_003  # the independent batches B' come from seed + this


class CurrentScaling(DelayedScaling):
    """A scale from the tensor's own amax, taken before the cast: nothing overflows, at the price of a pass over x.

    ``quantize`` sets ``scale = fp8 max / max|x| / 2**margin`` (lowered by fp32 ulps until max|x| * s stays within
    the format's max in fp32) and then casts as ``DelayedScaling`` does (whose
    bookkeeping of history and next scale is overwritten at the next call). An all-zero or non-finite tensor keeps
    the previous scale.
    """

    def __init__(self, fmt="e4m3", margin: int = 0):
        super().__init__(fmt, history_len=1, margin=margin)

    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> Quantized:
        amax = x.float().abs().max()  # () float32
        if amax.isfinite() and amax > 0:
            scale = self.format.max / float(amax) / 2**self.margin
            while float(amax * scale) > self.format.max:  # fp32 rounding of amax * s may pass max by an ulp
                scale *= 1 - 2.0**-23  # one fp32 ulp down (a float64 nextafter would take 2**29 tries)
            self.scale = scale
        return super().quantize(x)


def use_current_scaling(model: torch.nn.Module, margin: int = 0) -> torch.nn.Module:
    """Give every ``FP8Linear`` of ``model`` current scaling (E4M3 for x and W, E5M2 for dy), in place."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    if not layers:
        raise ValueError("the model has no FP8Linear layers: call convert_to_fp8(model) first")
    for layer in layers:
        layer.input_scaling = CurrentScaling("e4m3", margin)
        layer.weight_scaling = CurrentScaling("e4m3", margin)
        layer.grad_scaling = CurrentScaling("e5m2", margin)
    return model


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()  # (n_params,)


def _gradient(model: CausalLM, ids: torch.Tensor, variant: str) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    if variant == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model(ids), ids).float()
    else:
        loss = lm_loss(model(ids), ids)
    loss.backward()
    return _flat_grad(model)


def gradient_errors(
    steps: int = 100,
    batch: int = 8,
    seq_len: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    history_len: int = 16,
    **config_overrides,
) -> dict:
    """One fp32 AdamW run of ``steps`` steps; at each, every variant's gradient on the same weights and batch.

    Returns ``{"loss": [...], "grad_norm": [...]`` (the fp32 run's), ``"noise": [...]`` (||g_B' - g_B|| / ||g_B||
    for an independent batch B' at the same weights), ``"cosine": {variant: [...]}, "rel_error": {variant: [...]},
    "embedding_share": {variant: [...]}`` (the token embedding's share of ||g - g_fp32||^2), ``"fp8_steps":
    {"fp8 delayed" | "fp8 current": [per step: {kind: {"overflows": n, "underflows": n}}]}}``, kinds input,
    weight, grad. ``config_overrides`` change the ``TransformerConfig`` (default: 2 layers, d_model 64, 4 heads).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    config = TransformerConfig(
        **{"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": seq_len, **config_overrides}
    )
    text = load_corpus("shakespeare")
    batches = byte_batches(text, batch, seq_len, steps, seed=seed)
    others = byte_batches(text, batch, seq_len, steps, seed=seed + NOISE_SEED_OFFSET)  # B': independent windows
    torch.manual_seed(seed)
    model = CausalLM(config)
    shadows = {
        "fp8 delayed": convert_to_fp8(copy.deepcopy(model), history_len=history_len),
        "fp8 current": use_current_scaling(convert_to_fp8(copy.deepcopy(model))),
        "bf16": copy.deepcopy(model),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    out = {"loss": [], "grad_norm": [], "noise": []}
    out.update({key: {v: [] for v in shadows} for key in ("cosine", "rel_error", "embedding_share")})
    names = [name for name, _ in model.named_parameters()]  # _flat_grad's order
    n_embed = model.transformer.tok_embed.weight.numel()
    if names[0] != "transformer.tok_embed.weight":
        raise RuntimeError(f"expected the token embedding as the first parameter, got {names[0]!r}")
    counts = {v: [fp8_counts(shadows[v])] for v in shadows if v.startswith("fp8")}  # running totals, from zero
    for ids, other in zip(batches, others):  # (B, T) each
        g_other = _gradient(model, other, "fp32")  # the same weights, another batch: sampling noise
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(ids), ids)
        loss.backward()
        g32 = _flat_grad(model)
        out["loss"].append(loss.item())
        out["grad_norm"].append(float(g32.norm()))
        out["noise"].append(float((g_other - g32).norm() / g32.norm()))
        for variant, shadow in shadows.items():
            with torch.no_grad():
                for p, q in zip(shadow.parameters(), model.parameters()):  # the same order: the same modules
                    p.copy_(q)
            g = _gradient(shadow, ids, variant)
            out["cosine"][variant].append(float(g @ g32 / (g.norm() * g32.norm())))
            out["rel_error"][variant].append(float((g - g32).norm() / g32.norm()))
            sq = (g - g32).pow(2)  # (n_params,)
            out["embedding_share"][variant].append(float(sq[:n_embed].sum() / sq.sum()))
            if variant in counts:
                counts[variant].append(fp8_counts(shadow))
        optimizer.step()
    out["fp8_steps"] = {
        variant: [
            {kind: {k: after[kind][k] - before[kind][k] for k in after[kind]} for kind in after}
            for before, after in zip(totals, totals[1:])
        ]
        for variant, totals in counts.items()
    }
    return out
