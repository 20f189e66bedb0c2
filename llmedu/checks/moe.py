"""Graders for the mixture-of-experts lesson (21): capacity, parameters, the router, the all-to-all.

check_dropped(fn)            fn(choices, n_experts, capacity_factor) -> (capacity, dropped): the
                             capacity C = ceil(cf * N * k / E) and the sorted (token, j) pairs over it,
                             j the rank of the choice (0 = first), with GShard's priority: every first
                             choice before any second choice, tokens in order within each
check_moe_parameters(fn)     fn(config) -> (total, active) parameters of a Mixtral-shaped
                             ``TransformerConfig.llama(..., moe=MoEConfig(...))``: every expert, and
                             the k experts one token uses
check_router(fn)             fn(logits, top_k) -> (experts, gates, aux_loss): softmax, top-k, gates
                             renormalised over the k, Switch's load-balancing loss E * sum_i f_i P_i
check_all_to_all_bytes(fn)   fn(kept, rank, d_model, bytes_per_value) -> bytes rank sends to other
                             ranks in one forward pass: counts (int64), dispatch and combine

Each exercise asks for a rule worked out by hand, so each grader fails an answer that asks the library
instead (``assign``, ``load_balancing_loss``, a model built and counted, ``all_to_all_bytes``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from llmedu.checks.core import CheckResult, Grader, call_watching

__all__ = ["check_dropped", "check_moe_parameters", "check_router", "check_all_to_all_bytes"]

_LIBRARY = Path(__file__).resolve().parent.parent  # llmedu/


def _by_hand(g: Grader, fn, args: tuple, folder: Path, what: str, exempt=lambda code: False):
    """``fn(*args)``, failing the check when it calls a function of the library under ``folder``."""
    got, called = call_watching(g, fn, args, folder, exempt)
    if called is not None:
        g.expect(what, False, f"your function calls the library's {called}: work it out yourself")
    return got


_ROUTINGS = [  # (choices (N, k), E, capacity factor)
    ([[0], [0], [0], [0], [1], [0]], 2, 1.0),
    ([[1, 0], [0, 1], [0, 1]], 2, 1.0),
    ([[0, 1], [0, 2], [0, 1], [3, 0], [0, 1], [2, 3]], 4, 1.0),
    ([[0, 1], [0, 2], [0, 1], [3, 0], [0, 1], [2, 3]], 4, 0.5),
    ([[2, 1], [2, 1], [2, 0], [1, 2], [2, 3], [0, 2], [2, 1], [3, 2]], 4, 1.25),
]


def _dropped(choices: list[list[int]], n_experts: int, capacity_factor: float) -> tuple[int, list[tuple[int, int]]]:
    from llmedu.nn.moe import assign, expert_capacity

    experts = torch.tensor(choices)  # (N, k)
    n, k = experts.shape
    capacity = expert_capacity(n, n_experts, k, capacity_factor)
    a = assign(experts, torch.ones(n, k), n_experts, capacity)
    kept = {(int(t), int(e)) for t, e in zip(a.token, a.expert)}
    dropped = sorted((t, j) for t in range(n) for j in range(k) if (t, choices[t][j]) not in kept)
    return capacity, dropped


def check_dropped(fn) -> CheckResult:
    """Grade ``fn(choices, n_experts, capacity_factor) -> (capacity, sorted dropped (token, j) pairs)``."""
    g = Grader("check_dropped")
    for choices, n_experts, cf in _ROUTINGS:
        got = _by_hand(g, fn, ([list(c) for c in choices], n_experts, cf), _LIBRARY / "nn", "the capacity rule")
        if isinstance(got, tuple) and len(got) == 2:
            got = (got[0], [tuple(p) for p in got[1]])
        g.compare(f"choices={choices}, E={n_experts}, capacity factor {cf}", got, _dropped(choices, n_experts, cf))
    return g.result()


def _mixtral_shaped(d, layers, heads, kv_heads, d_ff, vocab, experts, top_k):
    from llmedu.models.config import MoEConfig, TransformerConfig

    return TransformerConfig.llama(
        vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, d_ff=d_ff,
        moe=MoEConfig(n_experts=experts, top_k=top_k, capacity_factor=None),
    )  # fmt: skip


_CONFIGS = [  # Mixtral 8x7B, 8x22B (Mistral AI 2024: 141B, 39B active), and two small shapes
    (4096, 32, 32, 8, 14336, 32000, 8, 2),
    (6144, 56, 48, 8, 16384, 32768, 8, 2),
    (64, 2, 4, 2, 96, 100, 4, 1),
    (128, 3, 8, 8, 256, 1000, 16, 4),
]


@functools.cache
def _counted(shape: tuple) -> tuple[int, int]:
    """(total, active) parameters of the model built on the meta device (shapes only, nothing allocated)."""
    from llmedu.models.counting import count_parameters
    from llmedu.models.gpt import CausalLM

    with torch.device("meta"):
        model = CausalLM(_mixtral_shaped(*shape))
    return count_parameters(model), count_parameters(model, active=True)


def check_moe_parameters(fn) -> CheckResult:
    """Grade ``fn(config) -> (total, active)`` on Mixtral-shaped configs, against the built (meta) model."""
    g = Grader("check_moe_parameters")
    for shape in _CONFIGS:
        config, expected = _mixtral_shaped(*shape), _counted(shape)
        d, layers, _, _, d_ff, vocab, experts, k = shape
        what = f"d={d}, layers={layers}, d_ff={d_ff}, vocab={vocab}, E={experts}, k={k}"
        # reading the config (its properties, in config.py) is allowed; building and counting a model is not
        got = _by_hand(g, fn, (config,), _LIBRARY / "models", what, lambda code: code.co_filename.endswith("config.py"))
        g.compare(what, tuple(got) if isinstance(got, (list, tuple)) else got, expected)
    return g.result()


def _router(logits: torch.Tensor, top_k: int):
    from llmedu.nn.moe import load_balancing_loss

    probs = logits.softmax(-1)  # (N, E)
    top_p, experts = probs.topk(top_k, dim=-1)  # (N, k)
    return experts, top_p / top_p.sum(-1, keepdim=True), load_balancing_loss(probs, experts, logits.shape[-1])


def check_router(fn) -> CheckResult:
    """Grade ``fn(logits (N, E), top_k) -> (experts (N, k), gates (N, k), aux_loss)``: float64 logits, compared
    to 1e-6, so that counts divided in the default float32 (off by ~1e-8) pass and a factor k does not."""
    g = Grader("check_router")
    gen = torch.Generator().manual_seed(0)
    for n, e, k in [(6, 4, 2), (10, 8, 2), (5, 4, 1), (7, 3, 3)]:
        logits = torch.randn(n, e, generator=gen, dtype=torch.float64) * 2
        got = _by_hand(g, fn, (logits.clone(), k), _LIBRARY / "nn", f"N={n} tokens, E={e}, top-{k}")
        experts, gates, aux = _router(logits, k)
        if isinstance(got, tuple) and len(got) == 3:
            got = (got[0], got[1], float(got[2]))
        g.compare(f"N={n} tokens, E={e}, top-{k}", got, (experts, gates, float(aux)), atol=1e-6)
    return g.result()


_KEPT = [  # (kept (N ranks, E), d_model, bytes per value)
    ([[3, 1], [0, 4]], 8, 4),
    ([[2, 2, 1, 3], [0, 5, 2, 1]], 16, 2),
    ([[1, 0, 2, 3], [4, 4, 0, 0], [0, 1, 1, 1], [2, 2, 2, 2]], 32, 4),
    ([[5, 0, 0, 1, 2, 0, 0, 3], [1, 1, 1, 1, 1, 1, 1, 1]], 64, 2),
]


def check_all_to_all_bytes(fn) -> CheckResult:
    """Grade ``fn(kept, rank, d_model, bytes_per_value) -> int``: forward bytes to other ranks."""
    from llmedu.parallel.experts import all_to_all_bytes

    g = Grader("check_all_to_all_bytes")
    for kept, d, v in _KEPT:
        for rank in range(len(kept)):
            expected = all_to_all_bytes(torch.tensor(kept), rank, d, v)
            what = f"kept={kept}, rank {rank}, d={d}, {v} bytes"
            g.compare(what, _by_hand(g, fn, (kept, rank, d, v), _LIBRARY / "parallel", what), expected)
    return g.result()
