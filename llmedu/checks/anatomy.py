"""Graders for lessons 05 (a transformer from scratch) and 06 (memory anatomy) that need more than the page.

Lesson 05:
    check_next_token_loss(fn)   fn(logits (B, T, V), ids (B, T)) -> the mean cross-entropy of predicting token
                                t + 1 from position t. Fails the unshifted loss (position t "predicts" the token it
                                already sees), the shift the wrong way, a sum, a softmax that underflows on large
                                logits, and an answer that calls the library's ``lm_loss``
Lesson 06:
    check_activation_batch(fn)  fn(n_params, n_layers, hidden, n_heads, seq_len) -> the smallest micro-batch b at
                                which the activations of all layers (Korthikanti et al., 16-bit with dropout:
                                s·b·h·(34 + 5·a·s/h) per layer) reach the model states of mixed-precision Adam (16Ψ).
                                Fails a floor, a per-layer count, weights alone (2Ψ or 4Ψ), and an answer that
                                asks ``llmedu.memory.estimate``
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .core import CheckResult, Grader, call_watching

__all__ = ["check_next_token_loss", "check_activation_batch"]

_LIBRARY = Path(__file__).resolve().parent.parent  # llmedu/


def _number(x):
    """A Python float from a 0-d tensor or a number; None for anything else."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return None


# -- lesson 05 ---------------------------------------------------------------------------------------
def check_next_token_loss(fn) -> CheckResult:
    g = Grader("check_next_token_loss")
    for B, T, V, scale in ((2, 6, 11, 1.0), (3, 9, 17, 2.0), (2, 5, 7, 200.0)):  # the last: large logits
        gen = torch.Generator().manual_seed(T)
        logits = torch.randn(B, T, V, generator=gen) * scale  # (B, T, V)
        ids = torch.randint(0, V, (B, T), generator=gen)  # (B, T)
        ids[0, 0] = 0  # a token the shifted loss never predicts
        expected = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).item()
        name = f"logits of shape {(B, T, V)}" + (", values up to a few hundred" if scale > 10 else "")
        got, called = call_watching(g, fn, (logits.clone(), ids.clone()), _LIBRARY / "models")
        if called is not None:
            g.expect(name, False, f"your function calls the library's {called}: write the shift and the loss yourself")
        value = _number(got)
        if value is None:
            g.expect(name, False, f"got {type(got).__name__}: return the loss as a number or a 0-d tensor")
            continue
        wrong = {
            "you did not shift: position t is scored on token t, its own input, instead of the token after it": (
                F.cross_entropy(logits.reshape(-1, V), ids.reshape(-1))
            ),
            "you shifted the wrong way: position t + 1 is scored on token t, the past": F.cross_entropy(
                logits[:, 1:].reshape(-1, V), ids[:, :-1].reshape(-1)
            ),
            "you summed the losses: take the mean over the B (T - 1) predictions": F.cross_entropy(
                logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="sum"
            ),
        }
        for why, loss in wrong.items():
            if abs(value - loss.item()) < 1e-5 * max(1.0, abs(loss.item())):
                g.expect(name, False, why)
        if math.isnan(value) or math.isinf(value):
            g.expect(
                name,
                False,
                f"got {value}: softmax(x).log() underflows for large logits; use log_softmax (or F.cross_entropy)",
            )
        g.compare(name, value, expected, rtol=1e-5, atol=1e-6)
    return g.result()


# -- lesson 06 ---------------------------------------------------------------------------------------
_CASES_06 = [  # name: (Ψ, L, h, a, s)
    ("Llama-2 7B at 2048 tokens", (6_738_415_616, 32, 4096, 32, 2048)),
    ("GPT-2 small at 1024 tokens", (124_439_808, 12, 768, 12, 1024)),
    ("a 175B GPT-3 shape at 2048 tokens", (175_000_000_000, 96, 12288, 96, 2048)),
    ("this lesson's model (d = 256, 4 layers) at 128 tokens", (3_323_392, 4, 256, 4, 128)),
    ("Llama-2 7B at 16 tokens", (6_738_415_616, 32, 4096, 32, 16)),
]


def _activation_batch(n_params, n_layers, hidden, n_heads, seq_len, states_per_param=16, layers=True) -> int:
    """ceil(16Ψ / (L (34 s h + 5 a s²))), in integers: s·h·(34 + 5as/h) = 34sh + 5as²."""
    per_sequence = (n_layers if layers else 1) * (34 * seq_len * hidden + 5 * n_heads * seq_len**2)
    return max(1, -(-states_per_param * n_params // per_sequence))


def check_activation_batch(fn) -> CheckResult:
    g = Grader("check_activation_batch")
    for name, args in _CASES_06:
        expected = _activation_batch(*args)
        got, called = call_watching(g, fn, args, _LIBRARY / "memory")
        if called is not None:
            g.expect(name, False, f"your function asks the library ({called}): solve the inequality for b yourself")
        if isinstance(got, float) and got.is_integer():
            got = int(got)
        if not isinstance(got, int) or isinstance(got, bool):
            g.expect(name, False, f"got {got!r}: a micro-batch is a whole number of sequences (an int)")
            continue
        psi, L, h, a, s = args
        hints = {
            expected - 1: "at that batch the activations are still below 16Ψ: round up",
            _activation_batch(*args, layers=False): f"that is one layer's activations; all {L} layers keep theirs",
            _activation_batch(*args, states_per_param=2): "2Ψ is the 16-bit weights alone; Adam's states are 16Ψ",
            _activation_batch(*args, states_per_param=4): "4Ψ is fp32 weights alone; Adam's states are 16Ψ",
        }
        hints.pop(expected, None)
        if got in hints:
            g.expect(name, False, f"got {got}: {hints[got]}")
        g.compare(name, got, expected)
    return g.result()
