"""Graders for the tensor-parallel lesson (12): what a step sends, what a rank holds, what a step costs.

check_tp_step_all_reduces(fn)  fn(n_layers) -> (forward, backward): the all-reduce calls of one training
                               step of ``tensor_parallel(CausalLM(gpt2 config))`` with
                               ``vocab_parallel_lm_loss``: the blocks, the vocabulary-parallel embedding,
                               the tied column-parallel head and the loss
check_tp_params_per_rank(fn)   fn(d_model, d_ff, n_heads, n_kv_heads, n) -> parameters one rank holds of
                               one block's attention and MLP (biases on, as GPT-2): split weights and
                               biases are 1/n, the row-parallel layers' biases are whole on every rank
check_tp_step_time(fn)         fn(compute_s, n, n_layers, tokens, d_model, bytes_per_value, alpha, bandwidth)
                               -> the predicted seconds of the blocks' forward and backward on n ranks:
                               the one-rank compute split n ways, plus 4 ring all-reduces of
                               (tokens, d_model) per layer in the critical path (nothing overlaps them)
"""

from __future__ import annotations

from collections.abc import Callable

from .core import CheckResult, Grader

__all__ = ["check_tp_step_all_reduces", "check_tp_params_per_rank", "check_tp_step_time"]


def tp_step_all_reduces(n_layers: int) -> tuple[int, int]:
    """The reference. Forward: g in the embedding, g after attention and MLP, three in the loss
    (max, sum of exponentials, target logit). Backward: f before attention and MLP, f before the head."""
    return 1 + 2 * n_layers + 3, 2 * n_layers + 1


def tp_params_per_rank(d_model: int, d_ff: int, n_heads: int, n_kv_heads: int, n: int) -> int:
    """The reference: Q, K, V and up split by output features (weights and biases), o and down by input
    features (weights only; their biases are added once, after g, so each rank holds them whole)."""
    kv = d_model // n_heads * n_kv_heads  # key/value features
    attention = (d_model * (d_model + 2 * kv) + d_model + 2 * kv) // n + d_model * d_model // n + d_model
    mlp = (d_model * d_ff + d_ff) // n + d_ff * d_model // n + d_model
    return attention + mlp


def tp_step_time(compute_s, n, n_layers, tokens, d_model, bytes_per_value, alpha, bandwidth) -> float:
    """The reference: compute / n + 4 L ring all-reduces of tokens x d_model values (alpha-beta)."""
    if n == 1:
        return compute_s
    size = tokens * d_model * bytes_per_value
    one = 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / bandwidth
    return compute_s / n + 4 * n_layers * one


def check_tp_step_all_reduces(fn: Callable[[int], tuple]) -> CheckResult:
    g = Grader("check_tp_step_all_reduces")
    for n_layers in (1, 2, 12, 48):
        got = g.call(fn, n_layers)
        got = tuple(got) if isinstance(got, (list, tuple)) else got
        g.compare(f"n_layers={n_layers}: (forward, backward)", got, tp_step_all_reduces(n_layers))
    return g.result()


def check_tp_params_per_rank(fn: Callable) -> CheckResult:
    g = Grader("check_tp_params_per_rank")
    for args in [
        (32, 128, 4, 4, 1),
        (32, 128, 4, 4, 2),
        (768, 3072, 12, 12, 4),
        (4096, 16384, 32, 8, 8),
        (64, 256, 8, 2, 2),
    ]:
        d, ff, h, hkv, n = args
        g.compare(
            f"d_model={d}, d_ff={ff}, heads={h}, kv heads={hkv}, n={n}", g.call(fn, *args), tp_params_per_rank(*args)
        )
    return g.result()


def check_tp_step_time(fn: Callable) -> CheckResult:
    g = Grader("check_tp_step_time")
    cases = [
        (0.1, 1, 12, 4096, 768, 2, 5e-6, 100e9),  # one rank: no communication
        (0.1, 2, 12, 4096, 768, 2, 5e-6, 100e9),
        (0.1, 8, 12, 4096, 768, 2, 5e-6, 100e9),
        (2.0, 8, 80, 8192, 8192, 2, 5e-6, 450e9),  # 70B-like layers over NVLink, per direction
        (2.0, 8, 80, 8192, 8192, 2, 5e-6, 50e9),  # the same over InfiniBand NDR
        (0.05, 2, 2, 512, 256, 4, 1e-4, 2e9),  # this machine's order of magnitude
    ]
    for args in cases:
        c, n, layers, t, d, b, a, bw = args
        case = f"compute {c} s, n={n}, layers={layers}, tokens={t}, d={d}, {b} bytes, alpha={a:g} s, {bw / 1e9:g} GB/s"
        g.compare(case, g.call(fn, *args), tp_step_time(*args), rtol=1e-6)
    return g.result()
