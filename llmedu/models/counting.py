"""Counting parameters and FLOPs, and the model FLOPs utilisation (MFU) they give.

Training a transformer costs about 6N FLOPs per token, N the weights that take part in a matmul:
2N for the forward pass (a multiply and an add per weight) and 4N for the backward pass (gradients
with respect to activations and to weights). N leaves out the embedding tables (a lookup is not a
matmul) but keeps the output projection, even when it is tied to the token embeddings; it leaves
out biases and norm gains too, which are additions, not multiplications (``matmul_parameters``).
Attention adds what no weight accounts for, the score and value products: 2 * 2 * n_layers * T *
d_model per token forward, so 12 * n_layers * T * d_model for training (Chowdhery et al. 2022,
appendix B: 6N + 12LHQT with HQ = d_model). Kaplan et al. 2020, table 1, count one such product per
layer, 2 * n_layers * n_ctx * d_attn forward, half of this term.

    MFU = (FLOPs per token * tokens per second) / peak FLOP/s of the hardware

A mixture of experts (``llmedu.nn.moe``) breaks the tie between parameters and FLOPs, which is why it
exists: a layer of E expert FFNs holds E FFNs' weights, but a token runs only the k its router picks
(Shazeer et al. 2017; Fedus et al. 2021, sec. 2). ``active=True`` counts k/E of every mixture's
expert weights, the N of 6N for an MoE model (Mixtral 8x7B: 46.7B parameters, 12.9B active, Jiang
et al. 2024, sec. 2); the router's small (E, d) matmul counts in full. It counts the k experts a
token is sent to: tokens dropped over capacity cost less, which this leaves out.

Left out: the causal mask's halving of attention work (kernels that skip masked blocks).
"""

from __future__ import annotations

from torch import nn

from ..nn.moe import MoE
from .config import TransformerConfig

__all__ = ["count_parameters", "matmul_parameters", "flops_per_token", "mfu"]


def _idle_experts(model: nn.Module, linear_weights_only: bool) -> int:
    """Parameters of the E - k experts each token skips, summed over ``model``'s mixtures of experts."""
    idle = 0
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        expert = moe.experts[0]  # the experts are alike
        if linear_weights_only:
            one = sum(m.weight.numel() for m in expert.modules() if isinstance(m, nn.Linear))
        else:
            one = sum(p.numel() for p in expert.parameters())
        idle += (moe.n_experts - moe.router.top_k) * one
    return idle


def count_parameters(model: nn.Module, embeddings: bool = True, active: bool = False) -> int:
    """Distinct parameters (a tied matrix counts once); ``embeddings=False`` drops token/position tables.

    ``active=True``: only k of each mixture's E experts, the parameters one token uses.
    """
    skip = set()
    if not embeddings:
        for module in model.modules():
            if isinstance(module, nn.Embedding) or type(module).__name__ == "LearnedPositions":
                skip.update(id(p) for p in module.parameters())
    total = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    return total - _idle_experts(model, linear_weights_only=False) if active else total


def matmul_parameters(model: nn.Module, active: bool = False) -> int:
    """The N of 6N: weights of every ``nn.Linear`` (a tied output projection counts: its matmul is real).

    ``active=True``: k of each mixture's E experts, so that ``flops_per_token`` gives an MoE's cost.
    """
    total = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return total - _idle_experts(model, linear_weights_only=True) if active else total


def flops_per_token(config: TransformerConfig, n_params: int, seq_len: int, training: bool = True) -> float:
    """6N + 12 L T d for a training step (2N + 4 L T d forward only); N from ``matmul_parameters``
    (``active=True`` for a mixture of experts)."""
    forward = 2 * n_params + 4 * config.n_layers * seq_len * config.d_model
    return 3 * forward if training else forward


def mfu(flops_per_tok: float, tokens_per_second: float, peak_flops: float) -> float:
    """Fraction of the hardware's peak that the model's useful arithmetic achieves."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return flops_per_tok * tokens_per_second / peak_flops
