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
check_internode_rows(fn)     fn(choices, home, experts_per_node) -> (flat, once): the token rows node
                             ``home`` dispatches to other nodes, one per (token, remote expert) pair, and
                             one per (token, remote node) as DeepSeek-V3 sends them

Each exercise asks for a rule worked out by hand, so each grader fails an answer that calls into llmedu
(``assign``, ``load_balancing_loss``, ``all_to_all_bytes``, this file's references) or ``transformers``
(Mixtral's model or its ``load_balancing_loss_func``); the parameter count also fails any ``torch.nn``
module built (``Module.__init__``), on the meta device or not. Each reference value is computed after the
answer has run, so nothing the answer could read is filled in before it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from llmedu.checks.core import CheckResult, Grader, call_watching

__all__ = ["check_dropped", "check_moe_parameters", "check_router", "check_all_to_all_bytes", "check_internode_rows"]

_LIBRARY = Path(__file__).resolve().parent.parent  # llmedu/
_GRADING = str(_LIBRARY / "checks" / "core.py")  # the Grader itself, which runs the answer
_CONFIG = str(_LIBRARY / "models" / "config.py")  # reading a config's properties (head_dim, ...) is allowed
_TORCH_NN = str(Path(torch.nn.__file__).resolve().parent)  # torch/nn: any module built, on any device
_spec = importlib.util.find_spec("transformers")  # its folder, without importing it
_TRANSFORMERS = [str(Path(_spec.origin).resolve().parent)] if _spec and _spec.origin else []


def _by_hand(g: Grader, fn, args: tuple, what: str, torch_nn: bool = False):
    """``fn(*args)``, failing the check when it calls into llmedu or transformers (or torch.nn, if asked)."""
    roots = [str(_LIBRARY), *_TRANSFORMERS] + ([_TORCH_NN] if torch_nn else [])

    def allowed(code) -> bool:
        where = code.co_filename
        return where in (_GRADING, _CONFIG) or not any(where.startswith(r) for r in roots)

    got, called = call_watching(g, fn, args, Path("/"), allowed)
    if called is not None:
        g.expect(what, False, f"your function calls {called}: work it out yourself")
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
        got = _by_hand(g, fn, ([list(c) for c in choices], n_experts, cf), "the capacity rule")
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


def _counted(shape: tuple) -> tuple[int, int]:
    """(total, active) parameters of the model built on the meta device (shapes only, nothing allocated).

    Every layer is the same, so it builds the model with 1 and 2 layers and adds the second's extra
    (one layer) for each further layer: the same count, in a fraction of the time of 56 layers of 8 experts."""
    from llmedu.models.counting import count_parameters
    from llmedu.models.gpt import CausalLM

    counts = []
    for layers in (1, 2):
        with torch.device("meta"):
            model = CausalLM(_mixtral_shaped(shape[0], layers, *shape[2:]))
        counts.append(torch.tensor([count_parameters(model), count_parameters(model, active=True)]))
    one, per_layer = counts[0], counts[1] - counts[0]
    total, active = (one + (shape[1] - 1) * per_layer).tolist()
    return total, active


def check_moe_parameters(fn) -> CheckResult:
    """Grade ``fn(config) -> (total, active)`` on Mixtral-shaped configs, against the built (meta) model."""
    g = Grader("check_moe_parameters")
    for shape in _CONFIGS:
        if g.failure is not None:
            break
        d, layers, _, _, d_ff, vocab, experts, k = shape
        what = f"d={d}, layers={layers}, d_ff={d_ff}, vocab={vocab}, E={experts}, k={k}"
        # reading the config (its properties, in config.py) is allowed; building any model is not
        got = _by_hand(g, fn, (_mixtral_shaped(*shape),), what, torch_nn=True)
        g.compare(what, tuple(got) if isinstance(got, (list, tuple)) else got, _counted(shape))
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
        got = _by_hand(g, fn, (logits.clone(), k), f"N={n} tokens, E={e}, top-{k}")
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
            what = f"kept={kept}, rank {rank}, d={d}, {v} bytes"
            got = _by_hand(g, fn, (kept, rank, d, v), what)
            g.compare(what, got, all_to_all_bytes(torch.tensor(kept), rank, d, v))
    return g.result()


def _internode_rows(choices: list[list[int]], home: int, experts_per_node: int) -> tuple[int, int]:
    flat = sum(1 for c in choices for e in c if e // experts_per_node != home)  # one row per remote expert
    once = sum(len({e // experts_per_node for e in c} - {home}) for c in choices)  # one per remote node
    return flat, once


def _random_choices(n_tokens: int, n_experts: int, k: int, seed: int) -> list[list[int]]:
    scores = torch.rand(n_tokens, n_experts, generator=torch.Generator().manual_seed(seed))
    return scores.topk(k, dim=-1).indices.tolist()  # k distinct experts per token


_NODES = [  # (choices (N, k), home node, experts per node)
    ([[0, 1], [2, 3], [4, 6], [1, 5]], 0, 2),  # the exercise's first case: 8 experts on 4 nodes
    (_random_choices(12, 16, 1, 1), 1, 4),  # top-1: every remote row goes to one node
    (_random_choices(32, 16, 4, 2), 2, 4),
    (_random_choices(32, 64, 2, 3), 3, 8),
    (_random_choices(64, 256, 8, 4), 0, 32),  # DeepSeek-V3's shape: top-8 of 256 routed experts, 8 nodes
]


def check_internode_rows(fn) -> CheckResult:
    """Grade ``fn(choices, home, experts_per_node) -> (flat, once)``: rows dispatched from node ``home`` to
    other nodes, per (token, expert) pair and per (token, node)."""
    g = Grader("check_internode_rows")
    for choices, home, per_node in _NODES:
        what = f"{len(choices)} tokens, top-{len(choices[0])}, {per_node} experts per node, home node {home}"
        got = _by_hand(g, fn, ([list(c) for c in choices], home, per_node), what)
        g.compare(what, tuple(got) if isinstance(got, (list, tuple)) else got, _internode_rows(choices, home, per_node))
    return g.result()
