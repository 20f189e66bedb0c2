"""Interleaved 1F1B and ZB-H1: valid schedules, their bubbles, and the gradients of one process.

The schedules are checked without processes by ``simulate`` (each action waits for its inputs; a
schedule whose ranks wait on each other is refused). The executor runs them on real processes with
a GPT of 8 blocks cut into p x v chunks; every rank also computes the full-batch gradient in its own
process (the oracle). Tolerance 1e-5 in fp32, as in test_parallel_pipeline_parallel.py: m micro-batch
gradients are added where the oracle takes one mean, ~1e-7 relative on gradients of order 1; a
chunk run twice, a gradient sent to the wrong chunk or a W never run is off by 1e-3 or more.
"""

import pytest
import torch
import torch.distributed as dist

from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.parallel import launch
from llmedu.parallel.pipeline_parallel import Pipeline, PipelineStage, stage_chunks
from llmedu.parallel.pipeline_schedules import Action, bubble_fraction, schedule, simulate, theoretical_bubble

ATOL = 1e-5
BATCH, SEQ = 24, 8
BASE = dict(vocab_size=64, d_model=32, n_layers=8, n_heads=4, max_seq_len=SEQ)
CONFIGS = {
    "gpt2 tied": dict(BASE, activation="gelu_tanh"),
    "llama untied": dict(BASE, n_kv_heads=2, position="rope", norm="rmsnorm", activation="swiglu", bias=False)
    | dict(tie_embeddings=False),
}


# -- the schedules, without processes -----------------------------------------------------------------------
def _cases():
    for p in (1, 2, 3, 4):
        for m in range(1, 9):
            for name in ("naive", "gpipe", "1f1b", "zb-h1"):
                yield name, p, m, 1
            if m % p == 0:
                for v in (1, 2, 3):
                    yield "interleaved", p, m, v


def test_every_stage_runs_each_micro_batch_once_forward_then_backward():
    for name, p, m, v in _cases():
        for r in range(p):
            actions = schedule(name, m, p, r, v)
            for c in range(v):
                kinds = sorted(a.kind for a in actions if a.chunk == c)
                backward = ["B"] * m if name != "zb-h1" else ["I"] * m + ["W"] * m
                assert kinds == sorted(["F"] * m + backward), (name, p, m, v, r, c)
                for i in range(m):  # F before its backward; I before its W
                    order = [a.kind for a in actions if a.micro == i and a.chunk == c]
                    assert order == (["F", "I", "W"] if name == "zb-h1" else ["F", "B"]), (name, p, m, v, r, i)


def test_simulated_bubble_equals_theory_so_the_schedules_respect_dependencies_across_stages():
    """``simulate`` starts each action only when the stage before (after, for a backward) has sent
    its input, and raises if ranks wait on each other: it finishing proves the lists can run."""
    for name, p, m, v in _cases():
        events = simulate([schedule(name, m, p, r, v) for r in range(p)])
        if name == "zb-h1" and m < p:
            continue  # the formula assumes a full pipe
        assert bubble_fraction(events) == pytest.approx(theoretical_bubble(p, m, name, v), abs=1e-12), (name, p, m, v)


def test_interleaving_and_splitting_the_backward_shrink_the_bubble():
    p, m = 4, 8
    one_f_one_b = theoretical_bubble(p, m, "1f1b")
    assert theoretical_bubble(p, m, "interleaved", 2) < one_f_one_b
    # in idle time (not share of the step): ZB-H1 idles (p-1) t per rank, 1F1B (p-1)(t + 2t)
    idle = {n: (p - 1) if n == "zb-h1" else 3 * (p - 1) for n in ("zb-h1", "1f1b")}
    for name in idle:
        events = simulate([schedule(name, m, p, r) for r in range(p)])
        step = max(e["end"] for e in events)
        assert step - 3 * m == idle[name]
    # interleaved: idle (p-1)/v of a stage's (t_f + t_b) = Narayanan's (p-1)/(v m) of the ideal time
    v = 2
    events = simulate([schedule("interleaved", m, p, r, v) for r in range(p)])  # chunk actions: F 1, B 2
    ideal = 3 * m * v
    assert (max(e["end"] for e in events) - ideal) / ideal == pytest.approx((p - 1) / (v * m))


def test_interleaved_warmup_absorbs_message_latency():
    """Megatron's 2(p-r-1) warm-up forwards for chunk 0: with a latency per message the idle time grows
    by a fixed amount, not with m (with p-r-1 it would grow with every micro-batch)."""
    p, v, times = 4, 2, {"F": 0.5, "B": 1.0}  # a chunk is half a stage
    idle = []
    for m in (8, 16, 32):
        events = simulate([schedule("interleaved", m, p, r, v) for r in range(p)], times, latency=0.1)
        idle.append(max(e["end"] for e in events) - 1.5 * m * v)
    assert idle[0] > 0 and idle[0] == pytest.approx(idle[1]) == pytest.approx(idle[2])


def test_simulate_refuses_broken_schedules():
    A = Action
    with pytest.raises(ValueError, match="before F0"):
        simulate([[A("B", 0), A("F", 0)]])
    with pytest.raises(ValueError, match="twice"):
        simulate([[A("F", 0), A("F", 0), A("B", 0)]])
    with pytest.raises(ValueError, match="before I0"):
        simulate([[A("F", 0), A("W", 0), A("I", 0)]])
    # rank 1 waits for F1 first, while rank 0 waits for the gradient of micro-batch 0
    deadlock = [[A("F", 0), A("B", 0), A("F", 1), A("B", 1)], [A("F", 1), A("F", 0), A("B", 0), A("B", 1)]]
    with pytest.raises(ValueError, match="wait on each other"):
        simulate(deadlock)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        schedule("interleaved", 6, 4, 0, 2)  # Megatron-LM's requirement
    with pytest.raises(ValueError, match="must be >= 1"):
        schedule("interleaved", 4, 4, 0, 0)
    with pytest.raises(ValueError, match="runs one chunk per rank"):
        schedule("1f1b", 4, 4, 0, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule("zb-v", 4, 4, 0)
    with pytest.raises(ValueError, match="full pipe"):
        theoretical_bubble(4, 2, "zb-h1")
    model = CausalLM(TransformerConfig(**BASE))
    with pytest.raises(ValueError, match="8 layers cannot be cut into 2 ranks x 3 chunks"):
        stage_chunks(model, 0, 2, 3)
    with pytest.raises(ValueError, match="must be >= 1"):
        stage_chunks(model, 0, 2, 0)


# -- on real processes ----------------------------------------------------------------------------------------
def _data():
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _grads(chunks) -> dict:
    return {PipelineStage.full_name(n): q.grad.clone() for ch in chunks for n, q in ch.named_parameters()}


def _runs(p: int) -> list[tuple[str, int, int]]:  # sorted: every rank must run them in the same order
    runs = {("zb-h1", m, 1) for m in (1, 3, 4, 8)} | {("interleaved", m, 2) for m in (p, 2 * p)}
    return sorted(runs | {("interleaved", 2 * p, 8 // p)})  # the last: one block per chunk


def _worker() -> dict:
    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    ids = _data()
    errors = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        oracle = CausalLM(TransformerConfig(**cfg))
        loss = lm_loss(oracle(ids), ids)
        loss.backward()
        full = dict(oracle.named_parameters(remove_duplicate=False))  # lm_head.weight too when tied
        for sched, m, v in _runs(p):
            torch.manual_seed(0)
            chunks = stage_chunks(CausalLM(TransformerConfig(**cfg)), rank, p, v)
            pipe = Pipeline(chunks, list(range(p)), lm_loss, act_shape=lambda x: (*x.shape[:2], cfg["d_model"]))
            got = pipe.step(ids, ids, m, sched)
            key = f"{name} {sched} m={m} v={v}"
            errors[key + " grad"] = max((g - full[n].grad).abs().max().item() for n, g in _grads(chunks).items())
            if got is not None:
                errors[key + " loss"] = abs(got.item() - loss.item())
            errors[key + " peak"] = pipe.peak_in_flight
    alone = Pipeline(stage_chunks(CausalLM(TransformerConfig(**BASE)), 0, 1, 2), [rank], lm_loss, lambda x: x.shape)
    try:  # a pipeline of this rank alone, two chunks: refused before anything is sent
        alone.step(ids, ids, 2, "interleaved")
    except ValueError as err:
        errors["one rank, two chunks"] = str(err)
    return errors


def _torch_worker() -> dict:
    """torch.distributed.pipelining's interleaved schedules on the same weights; the gradients of every
    rank come back by full parameter name, to be compared in the test (the cuts of ours and theirs
    differ for ZB-H1, one chunk against two)."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

    torch.set_num_threads(1)
    rank, p, m, v = dist.get_rank(), dist.get_world_size(), 4, 2
    cfg = CONFIGS["llama untied"]
    ids = _data()
    act_shape = lambda x: (*x.shape[:2], cfg["d_model"])  # noqa: E731
    out = {}
    for ours_name, (theirs_cls, ours_v) in {
        "interleaved": (ScheduleInterleaved1F1B, v),
        "zb-h1": (ScheduleInterleavedZeroBubble, 1),  # torch has no one-chunk ZB-H1: its interleaved one
    }.items():
        torch.manual_seed(0)
        ours = stage_chunks(CausalLM(TransformerConfig(**cfg)), rank, p, ours_v)
        our_loss = Pipeline(ours, list(range(p)), lm_loss, act_shape).step(ids, ids, m, ours_name)
        torch.manual_seed(0)
        theirs = stage_chunks(CausalLM(TransformerConfig(**cfg)), rank, p, v)
        stages = [TorchStage(ch, c * p + rank, p * v, torch.device("cpu")) for c, ch in enumerate(theirs)]
        sched = theirs_cls(stages, m, loss_fn=lm_loss, scale_grads=True)
        losses = []
        if rank == 0:
            sched.step(ids, target=ids, losses=losses)
        else:
            sched.step(target=ids, losses=losses)
        out[ours_name] = {
            "ours": _grads(ours),
            "theirs": _grads(theirs),
            "ours loss": None if our_loss is None else our_loss.item(),  # on the last global stage
            "theirs loss": torch.stack(losses).mean().item() if losses else None,
        }
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return launch(_worker, 2, echo=False)


@pytest.fixture(scope="module")
def four_ranks():
    return launch(_worker, 4, echo=False)


def _check(results: list[dict], p: int) -> None:
    for r in results:
        assert "at least 2 ranks" in r["one rank, two chunks"]
    grads = [k for k in results[0] if k.endswith(" grad")]
    assert len(grads) == 2 * len(_runs(p))
    for rank, errors in enumerate(results):
        for what in grads:
            assert errors[what] < ATOL, f"p={p} rank {rank}: {what} differs by {errors[what]:.2e} from one process"
    losses = {k: v for k, v in results[-1].items() if k.endswith(" loss")}  # the last stage reports the loss
    assert len(losses) == len(grads)
    for what, err in losses.items():
        assert err < ATOL, f"p={p}: {what} differs by {err:.2e}"


@pytest.mark.slow
def test_two_ranks_give_the_gradients_of_one_process(two_ranks):
    _check(two_ranks, 2)


@pytest.mark.slow
def test_four_ranks_give_the_gradients_of_one_process(four_ranks):
    _check(four_ranks, 4)


@pytest.mark.slow
def test_zb_h1_holds_at_most_p_micro_batches_like_1f1b(four_ranks):
    for results in four_ranks:
        assert results["gpt2 tied zb-h1 m=8 v=1 peak"] == 4


@pytest.mark.slow
def test_matches_torch_interleaved_schedules():
    results = launch(_torch_worker, 2, echo=False)
    for name in ("interleaved", "zb-h1"):
        ours = {k: g for r in results for k, g in r[name]["ours"].items()}
        theirs = {k: g for r in results for k, g in r[name]["theirs"].items()}
        assert ours.keys() == theirs.keys() and len(ours) > 0
        worst = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
        assert worst < ATOL, f"{name}: gradients differ by {worst:.2e} from torch.distributed.pipelining"
        (our_loss,) = [r[name]["ours loss"] for r in results if r[name]["ours loss"] is not None]
        (their_loss,) = [r[name]["theirs loss"] for r in results if r[name]["theirs loss"] is not None]
        assert our_loss == pytest.approx(their_loss, abs=ATOL)
