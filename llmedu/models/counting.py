"""Counting parameters and FLOPs, and the model FLOPs utilisation (MFU) they give.

Training a transformer costs about 6N FLOPs per token, N the weights that take part in a matmul:
2N for the forward pass (a multiply and an add per weight) and 4N for the backward pass (gradients
with respect to activations and to weights). N leaves out the embedding tables (a lookup is not a
matmul) but keeps the output projection, even when it is tied to the token embeddings; it leaves
out biases and norm gains too, which are additions, not multiplications (``matmul_parameters``).
Attention adds what no weight accounts for, the score and value products: 2 * 2 * n_layers * T *
d_model per token forward, so 12 * n_layers * T * d_model for training (Kaplan et al. 2020,
table 1; Chowdhery et al. 2022, appendix B).

    MFU = (FLOPs per token * tokens per second) / peak FLOP/s of the hardware

Left out: the causal mask's halving of attention work (kernels that skip masked blocks).
"""

from __future__ import annotations

from torch import nn

from .config import TransformerConfig

__all__ = ["count_parameters", "matmul_parameters", "flops_per_token", "mfu"]


def count_parameters(model: nn.Module, embeddings: bool = True) -> int:
    """Distinct parameters (a tied matrix counts once); ``embeddings=False`` drops token/position tables."""
    skip = set()
    if not embeddings:
        for module in model.modules():
            if isinstance(module, nn.Embedding) or type(module).__name__ == "LearnedPositions":
                skip.update(id(p) for p in module.parameters())
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def matmul_parameters(model: nn.Module) -> int:
    """The N of 6N: weights of every ``nn.Linear`` (a tied output projection counts: its matmul is real)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def flops_per_token(config: TransformerConfig, n_params: int, seq_len: int, training: bool = True) -> float:
    """6N + 12 L T d for a training step (2N + 4 L T d forward only); N from ``matmul_parameters``."""
    forward = 2 * n_params + 4 * config.n_layers * seq_len * config.d_model
    return 3 * forward if training else forward


def mfu(flops_per_tok: float, tokens_per_second: float, peak_flops: float) -> float:
    """Fraction of the hardware's peak that the model's useful arithmetic achieves."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return flops_per_tok * tokens_per_second / peak_flops
