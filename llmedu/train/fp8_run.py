"""A small GPT trained three times from the same start: fp32, bf16 autocast, and simulated fp8.

    fp32   every op in float32: the reference curve
    bf16   torch.autocast(dtype=bfloat16): matmuls take bf16 inputs (8 significant bits), fp32 weights
    fp8    every nn.Linear swapped for ``FP8Linear`` (E4M3 forward, E5M2 gradients, delayed scaling);
           norms, attention's softmax and the loss stay fp32, as in Transformer Engine. The token
           embedding *lookup* stays fp32, but the LM head is an nn.Linear tied to the embedding, so
           it becomes an FP8Linear too: the embedding matrix is cast to E4M3 for the output
           projection (a choice of this simulation, not the library's only option)

The model is ``llmedu.models.gpt.CausalLM`` on the bytes of the Shakespeare corpus (vocabulary 256),
the batches are ``llmedu.parallel.mesh.byte_batches`` and every run sees the same batches, so the
three curves differ only by the number formats. ``compare_precisions`` returns the curves and the fp8
overflow/underflow counts per tensor kind (input, weight, gradient).

Left out: fp8 attention (the QK^T and PV matmuls), a loss scaler for the fp8 gradients (delayed
scaling of dy takes its place), learning-rate schedules and evaluation on held-out text.
"""

from __future__ import annotations

import copy

import torch

from ..data import load_corpus
from ..models.config import TransformerConfig
from ..models.gpt import CausalLM, lm_loss
from ..parallel.mesh import byte_batches
from .fp8 import convert_to_fp8, fp8_counts

__all__ = ["compare_precisions", "PRECISIONS_COMPARED"]

PRECISIONS_COMPARED = ("fp32", "bf16", "fp8")


def _train(
    model: CausalLM, batches: list[torch.Tensor], precision: str, lr: float, after_step=None
) -> tuple[list[float], list[float]]:
    """AdamW on ``batches``, one step each; the loss and the gradient norm of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, grad_norms = [], []
    for ids in batches:  # (B, T)
        if precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(model(ids), ids).float()
        else:  # fp32, or fp8 inside the FP8Linear layers of a converted model
            loss = lm_loss(model(ids), ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        optimizer.step()  # the parameters are fp32 in all three runs: they are the master weights
        losses.append(loss.item())
        if after_step is not None:
            after_step(model)
    return losses, grad_norms


def compare_precisions(
    steps: int = 100,
    batch: int = 8,
    seq_len: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    history_len: int = 16,
    margin: int = 0,
    precisions: tuple[str, ...] = PRECISIONS_COMPARED,
    **config_overrides,
) -> dict:
    """Train a tiny GPT for ``steps`` steps in each precision.

    Returns ``{"losses": {name: [...]}, "grad_norms": {name: [...]}, "fp8_counts": totals,
    "fp8_steps": [per step: {kind: {"overflows": n, "underflows": n}}]}``, kinds input, weight, grad.

    ``config_overrides`` change the ``TransformerConfig`` (default: 2 layers, d_model 64, 4 heads).
    """
    unknown = set(precisions) - set(PRECISIONS_COMPARED)
    if unknown:
        raise ValueError(f"unknown precisions {sorted(unknown)}; choose from {PRECISIONS_COMPARED}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    config = TransformerConfig(
        **{"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": seq_len, **config_overrides}
    )
    batches = byte_batches(load_corpus("shakespeare"), batch, seq_len, steps, seed=seed)
    torch.manual_seed(seed)
    initial = CausalLM(config)  # one initialization, copied into every run
    result = {"losses": {}, "grad_norms": {}, "fp8_counts": None, "fp8_steps": []}
    totals = []  # fp8_counts after each step: the per-step counts are their differences

    def snapshot(model: CausalLM) -> None:
        totals.append(fp8_counts(model))

    for name in precisions:
        model = copy.deepcopy(initial)
        if name == "fp8":
            convert_to_fp8(model, history_len=history_len, margin=margin)
        after = snapshot if name == "fp8" else None
        result["losses"][name], result["grad_norms"][name] = _train(model, batches, name, lr, after)
        if name == "fp8":
            result["fp8_counts"] = fp8_counts(model)
    zero = {kind: {"overflows": 0, "underflows": 0} for kind in ("input", "weight", "grad")}
    for before, after in zip([zero, *totals], totals):
        result["fp8_steps"].append({kind: {k: after[kind][k] - before[kind][k] for k in after[kind]} for kind in after})
    return result
