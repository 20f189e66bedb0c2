"""Graders for lesson 05 (a transformer from scratch): where the parameters of a GPT are.

check_gpt2_parameters(fn)   fn(vocab_size, max_seq_len, d_model, n_layers, d_ff, tied) -> the number of
                            parameters of a GPT-2-style model (learned positions, pre-LN LayerNorms with
                            biases, biased linear layers, a final norm), with the output matrix tied to the
                            token embedding or not

The reference is not a formula: it builds our ``CausalLM`` on PyTorch's ``meta`` device (shapes, no
storage) and counts its parameters, so a 1.5B-parameter case costs nothing.
"""

from __future__ import annotations

import torch

from llmedu.checks.core import CheckResult, Grader
from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.counting import count_parameters

__all__ = ["check_gpt2_parameters"]

# GPT-2 small and XL (Radford et al. 2019, table 2), an odd-sized model with a narrow FFN, and two
# untied models: the lesson shows tied GPT-2s only.
_CASES = [
    (50257, 1024, 768, 12, 3072, True),
    (50257, 1024, 1600, 48, 6400, True),
    (101, 64, 96, 2, 136, True),
    (256, 128, 128, 4, 512, False),
    (32000, 2048, 512, 6, 1376, False),
]


def _reference(vocab_size, max_seq_len, d_model, n_layers, d_ff, tied) -> int:
    config = TransformerConfig.gpt2(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=1,  # the head count does not change the parameter count
        d_ff=d_ff,
        tie_embeddings=tied,
    )
    with torch.device("meta"):
        return count_parameters(CausalLM(config))


def check_gpt2_parameters(fn) -> CheckResult:
    """Grade ``fn(vocab_size, max_seq_len, d_model, n_layers, d_ff, tied)`` against a model built on ``meta``."""
    g = Grader("check_gpt2_parameters")
    for case in _CASES:
        V, T, d, L, f, tied = case
        got = g.call(fn, *case)
        g.compare(f"V={V}, T={T}, d={d}, L={L}, d_ff={f}, {'tied' if tied else 'untied'}", got, _reference(*case))
    return g.result()
