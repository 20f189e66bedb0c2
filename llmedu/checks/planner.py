"""Graders for lesson 16: the cost model and the planner.

Lesson 16's exercises (each fails a function that asks ``llmedu.planner`` for the answer: the grader
records every call into the planner's files while the learner's function runs):

check_all_reduce_on_cluster(fn)
    fn(nbytes, group_size, stride, gpus_per_node, intra, inter) -> seconds of a ring all-reduce of a group
    laid out ``stride`` ranks apart, on the link the cost model gives it (``Cluster.link``: g rings at once)
check_states_gib(fn)
    fn(cfg, layout) -> GiB of model states (2 + 2 + 12 bytes a parameter, ZeRO-sharded) on the busiest rank
check_pick_40gb(fn)
    fn(model, nodes, batch, link) -> (Layout, predicted GiB) on nodes of 8 A100 40GB, which the presets do
    not know; graded on three scenarios drawn with a stated seed (the same at every run, none of those the
    lesson prints) and one drawn at check time from fresh randomness (named with the number that draws it
    again when it fails), so the function must be a rule, not a table of answers worked out beforehand
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

from ..models.config import TransformerConfig
from ..planner.clusters import ETHERNET, Link, cluster, collective_time
from ..planner.memory import Batch, Layout, held_parameters, uneven_splits
from ..planner.search import MODELS, NothingFits, evaluate, plan
from .core import CheckResult, Grader, call_watching

__all__ = [
    "check_all_reduce_on_cluster",
    "check_states_gib",
    "check_pick_40gb",
    "SCENARIOS_40GB",
    "draw_scenarios",
]

# -- lesson 16: the cost model by hand -------------------------------------------------------------------------
PLANNER = Path(__file__).resolve().parents[1] / "planner"


def _without_planner(g: Grader, fn, *args):
    """``fn(*args)`` through ``g.call``, failing the case if it called any function of ``llmedu.planner``, or
    ``_best_without_cp``, whose searches are the planner's answers."""
    searches = _best_without_cp.__code__

    def exempt(code):  # building a Layout or a Batch (to return one) is not asking the planner
        return code.co_qualname.split(".")[0] in ("Layout", "Batch") or (
            code.co_filename == searches.co_filename and code is not searches
        )

    saved = dict(_BEST)  # the answers to the scenarios drawn so far: out of the answer's reach while it runs
    _BEST.clear()
    try:
        got, called = call_watching(g, fn, args, (PLANNER, Path(searches.co_filename)), exempt)
    finally:
        _BEST.update(saved)
    g.expect(
        "your function works it out without the planner",
        called is None,
        f"it called llmedu.planner's {called}: reason from the lesson's costs instead",
    )
    return got


def _node(gpus_per_node: int, intra: tuple, inter: tuple):
    c = cluster("dgx-a100", nodes=2)
    return replace(
        c, gpus_per_node=gpus_per_node, intra=Link("intra", *intra, "exercise"), inter=Link("inter", *inter, "exercise")
    )


_CLUSTER_CASES = [  # (bytes, group size, stride, GPUs per node, intra (B/s, s), inter (B/s, s))
    (2e9, 8, 1, 8, (300e9, 5e-6), (25e9, 1e-5)),  # one node
    (2e9, 32, 1, 8, (300e9, 5e-6), (25e9, 1e-5)),  # 8 members on each of 4 nodes
    (2e9, 16, 8, 8, (300e9, 5e-6), (25e9, 1e-5)),  # one member a node (TP8 inside each)
    (5e8, 16, 4, 8, (300e9, 5e-6), (25e9, 1e-5)),  # 2 members a node
    (1e9, 4, 2, 8, (300e9, 5e-6), (25e9, 1e-5)),  # a span of 8: inside a node
    (1e9, 64, 1, 8, (300e9, 5e-6), (50e9, 1e-5)),  # 8 x 50 GB/s is more than NVLink carries
    (3e8, 8, 2, 4, (150e9, 3e-6), (12.5e9, 2e-5)),  # 2 a node on 4-GPU nodes
]


def check_all_reduce_on_cluster(fn) -> CheckResult:
    """Grade ``fn(nbytes, group_size, stride, gpus_per_node, intra, inter)`` against the ring all-reduce on
    ``Cluster.link(group_size, stride)``; intra and inter are (bandwidth B/s per direction, latency s)."""
    g = Grader("check_all_reduce_on_cluster")
    for n, p, stride, gpn, intra, inter in _CLUSTER_CASES:
        got = _without_planner(g, fn, n, p, stride, gpn, intra, inter)
        link = _node(gpn, intra, inter).link(p, stride)
        g.compare(
            f"{n:g} bytes over {p} ranks {stride} apart, {gpn} GPUs a node, intra {intra}, inter {inter}",
            got,
            collective_time("all_reduce", n, p, link),
            rtol=1e-6,
        )
    return g.result()


_STATES_CASES = [  # models and layouts the lesson does not print
    ("llama3-8b", Layout(dp=4, tp=2, pp=1, zero=0)),
    ("llama3-70b", Layout(dp=8, tp=4, pp=4, zero=1)),
    ("gpt3-175b", Layout(dp=16, tp=8, pp=6, zero=2)),
    (
        TransformerConfig.llama(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40, d_ff=13824),
        Layout(dp=32, tp=1, pp=1, zero=3),
    ),
    (
        TransformerConfig.gpt2(vocab_size=50304, d_model=2560, n_layers=30, n_heads=32, max_seq_len=2048),
        Layout(dp=2, tp=4, pp=4, zero=0),
    ),
    (  # tied embeddings on one stage: the matrix is held once
        TransformerConfig.gpt2(vocab_size=50304, d_model=2048, n_layers=24, n_heads=16, max_seq_len=2048),
        Layout(dp=8, tp=2, pp=1, zero=1),
    ),
]


def states_gib(cfg: TransformerConfig, layout: Layout) -> float:
    """Weights, gradients and Adam (2 + 2 + 12 bytes a parameter) of the busiest rank, ZeRO over dp, in GiB."""
    held = held_parameters(cfg, layout)
    return (
        held
        * (
            2 / (layout.dp if layout.zero >= 3 else 1)
            + 2 / (layout.dp if layout.zero >= 2 else 1)
            + 12 / (layout.dp if layout.zero >= 1 else 1)
        )
        / 2**30
    )


def check_states_gib(fn) -> CheckResult:
    """Grade ``fn(cfg, layout)`` -> GiB of model states on the busiest rank, within 1%."""
    g = Grader("check_states_gib")
    for model, layout in _STATES_CASES:
        cfg = MODELS[model] if isinstance(model, str) else model
        name = model if isinstance(model, str) else f"a {cfg.n_layers}-layer model of width {cfg.d_model}"
        g.compare(f"{name}, {layout}", _without_planner(g, fn, cfg, layout), states_gib(cfg, layout), rtol=0.01)
    return g.result()


# (model preset, nodes of 8 A100 40GB, batch sequences, sequence length, link between nodes): the lesson's
# examples, for trying a rule; the grader draws others
SCENARIOS_40GB = {
    "Llama-3-8B, 4096 tokens, on 2 nodes": ("llama3-8b", 2, 512, 4096, "InfiniBand HDR"),
    "GPT-3 175B on 32 nodes": ("gpt3-175b", 32, 1024, 2048, "InfiniBand HDR"),
    "Llama-3-70B, 4096 tokens, on 4 nodes with Ethernet": ("llama3-70b", 4, 256, 4096, "100 Gb Ethernet"),
}
LINKS = ("InfiniBand HDR", "100 Gb Ethernet")
SEED = 3  # the grader's draw: the same three scenarios at every run (its three models, both links)
_POOL = {  # model preset: (nodes, batch sequences, sequence lengths) the seeded draw picks from
    "llama3-8b": ((1, 2, 4), (128, 256, 512), (2048, 4096, 8192)),
    "llama3-70b": ((2, 4, 8, 16), (256, 512), (2048, 4096)),
    "gpt3-175b": ((16, 32, 48), (1024, 1536), (2048,)),
}
_FRESH = {  # model preset: (nodes, sequences per GPU, sequence lengths) the draw at check time picks from
    "llama3-8b": (range(1, 9), (2, 4, 6, 8), (2048, 4096, 8192)),
    "llama3-70b": (range(2, 17), (2, 4, 8), (2048, 4096)),
    "gpt3-175b": (range(16, 65, 4), (2, 4, 6), (2048,)),
}


def cluster_40gb(nodes: int, inter: str):
    """DGX-style nodes of 8 A100 SXM 40GB: the 80GB preset with half the memory, 40 GiB (NVIDIA's A100
    datasheet; nvidia-smi reports 40960 MiB)."""
    if inter not in LINKS:
        raise ValueError(f"link {inter!r} is not one of {LINKS}")
    c = cluster("dgx-a100", nodes=nodes, inter=ETHERNET if inter == "100 Gb Ethernet" else None)
    return replace(c, accelerator=replace(c.accelerator, name="A100 SXM 40GB", memory_bytes=40 * 2**30))


def draw_scenarios(n: int = 3, seed: int = SEED, *, fresh: bool = False, avoid: tuple = ()) -> list[tuple]:
    """``n`` scenarios (model, nodes, sequences, seq_len, link) that the lesson does not print (nor ``avoid``)
    and on which some layout without CP fits, drawn with ``seed``: the same ones for the same seed. From
    ``_POOL``, or with ``fresh`` from the wider ``_FRESH`` (hundreds of scenarios), as the check-time draw."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int (the same seed draws the same scenarios), got seed={seed!r}")
    rng, shown, out = random.Random(seed), set(SCENARIOS_40GB.values()) | set(avoid), []
    while len(out) < n:
        model = rng.choice(sorted(_POOL))
        if fresh:
            nodes, per_gpu, seq_lens = _FRESH[model]
            count = rng.choice(nodes)
            case = (model, count, 8 * count * rng.choice(per_gpu), rng.choice(seq_lens), rng.choice(LINKS))
        else:
            nodes, sequences, seq_lens = _POOL[model]
            case = (model, rng.choice(nodes), rng.choice(sequences), rng.choice(seq_lens), rng.choice(LINKS))
        if case in shown or case in out or _best_without_cp(*case) is None:
            continue
        out.append(case)
    return out


def _no_cp(layout: Layout) -> bool:
    return layout.cp == 1


_BEST: dict[tuple, object] = {}  # scenario -> the planner's best layout without CP (None: nothing fits)


def _best_without_cp(model: str, nodes: int, sequences: int, seq_len: int, link: str):
    """The planner's best layout without context parallelism for a scenario, or None if none fits. Each is a
    search of every layout, and checks meet the same scenarios again, so each is searched once."""
    case = (model, nodes, sequences, seq_len, link)
    if case not in _BEST:
        try:
            _BEST[case] = plan(
                MODELS[model], cluster_40gb(nodes, link), Batch(sequences, seq_len), top=1, where=_no_cp
            )[0]
        except NothingFits:
            _BEST[case] = None
    return _BEST[case]


def check_pick_40gb(fn, seed: int = SEED, fresh: int | None = None) -> CheckResult:
    """Grade ``fn(model, nodes, batch, link) -> (Layout, GiB)`` (model a ``TransformerConfig``, batch a
    ``Batch``) on three scenarios drawn with ``seed`` and a fourth drawn now with ``fresh`` (None: a new
    random number, printed in the case's name, so that a failure can be drawn again): the layout must fit
    90% of 40 GiB, be within 10% of the best predicted step without context parallelism, and its GiB must be
    within 15% of the model's."""
    if fresh is None:
        fresh = random.SystemRandom().randrange(10**6)
    g = Grader("check_pick_40gb")
    seeded = draw_scenarios(3, seed)
    (now,) = draw_scenarios(1, fresh, fresh=True, avoid=tuple(seeded))
    for i, (model, nodes, sequences, seq_len, inter) in enumerate([*seeded, now]):
        c, batch, cfg = cluster_40gb(nodes, inter), Batch(sequences, seq_len), MODELS[model]
        name = f"{model} on {nodes} x 8 A100 40GB ({inter}), {sequences} sequences of {seq_len} tokens"
        if i == len(seeded):
            name = f"drawn now (check_pick_40gb(fn, fresh={fresh}) draws it again): {name}"
        got = _without_planner(g, fn, cfg, nodes, batch, inter)
        ok = isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], Layout)
        if not g.expect(f"{name}: (Layout, GiB)", ok, f"got {got!r}"):
            continue
        layout, gib = got
        if not g.expect(f"{name}: uses {c.world_size} GPUs", layout.world == c.world_size, f"{layout}: {layout.world}"):
            continue
        wrong = uneven_splits(cfg, layout, batch)
        if not g.expect(f"{name}: each degree divides what it splits", not wrong, f"{layout}: {'; '.join(wrong)}"):
            continue
        mine = evaluate(cfg, layout, c, batch)
        best = _best_without_cp(model, nodes, sequences, seq_len, inter)
        need = mine.memory_total / 2**30
        g.expect(f"{name}: fits in 90% of 40 GiB", mine.fits, f"{layout} needs {need:.1f} GiB per GPU")
        g.expect(
            f"{name}: within 10% of the best predicted step",
            mine.time["total"] <= 1.1 * best.time["total"],
            f"{layout}: {mine.time['total']:.2f} s; a layout at {best.time['total']:.2f} s exists",
        )
        g.compare(f"{name}: your memory estimate for {layout} (GiB)", gib, need, rtol=0.15)
    return g.result()
