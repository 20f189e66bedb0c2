"""Pipeline parallelism against one process, and against torch.distributed.pipelining.

Every rank builds the same full model (same seed), computes the full-batch gradient in its own
process (the oracle), then runs its stage of the pipeline. Tolerance 1e-5 in fp32: the pipeline
adds m micro-batch gradients (each of a loss divided by m) where the oracle takes one mean, a
different order of float sums, ~1e-7 relative on gradients of order 1; a micro-batch missing from
the sum, a gradient not sent back, or tied embeddings not exchanged are off by 1e-3 or more.
"""

import pytest
import torch
import torch.distributed as dist

from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.parallel import launch
from llmedu.parallel.pipeline_parallel import Pipeline, PipelineStage, partition, schedule

ATOL = 1e-5
BATCH, SEQ = 24, 8
MICRO = (1, 3, 4, 8)  # 3 is a multiple of neither 2 nor 4 stages; 1 and 3 are fewer than 4 stages
CONFIGS = {
    "gpt2 tied": dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, max_seq_len=SEQ, activation="gelu_tanh"),
    "llama untied": dict(
        vocab_size=64,
        d_model=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=SEQ,
        position="rope",
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
        tie_embeddings=False,
    ),
}


def _data():
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _oracle(cfg: dict) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig(**cfg))
    ids = _data()
    lm_loss(model(ids), ids).backward()
    return model


def _grad_error(stage: torch.nn.Module, full: dict) -> float:
    worst = 0.0
    for name, p in stage.named_parameters():
        worst = max(worst, (p.grad - full[PipelineStage.full_name(name)].grad).abs().max().item())
    return worst


def _pp_worker() -> dict:
    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    ids = _data()
    results = {}
    for name, cfg in CONFIGS.items():
        oracle = _oracle(cfg)
        full_grads = dict(oracle.named_parameters(remove_duplicate=False))  # lm_head.weight too when tied
        full_loss = lm_loss(oracle(ids), ids).item()
        balance = "layers" if "tied" in name else "parameters"
        for sched in ("naive", "gpipe", "1f1b"):
            for m in MICRO if sched != "naive" else (4,):
                torch.manual_seed(0)
                stage = PipelineStage(CausalLM(TransformerConfig(**cfg)), rank, p, balance)
                pipe = Pipeline(stage, list(range(p)), lm_loss, act_shape=lambda x: (*x.shape[:2], cfg["d_model"]))
                loss = pipe.step(ids, ids, m, sched)
                key = f"{name} {sched} m={m}"
                results[key + " grad"] = _grad_error(stage, full_grads)
                if loss is not None:
                    results[key + " loss"] = abs(loss.item() - full_loss)
                results[key + " peak"] = pipe.peak_in_flight
    return results


def _torch_pipelining_worker() -> float:
    """torch.distributed.pipelining's 1F1B on the same stages: the same gradients as ours."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B

    torch.set_num_threads(1)
    rank, p, m = dist.get_rank(), dist.get_world_size(), 4
    cfg = CONFIGS["llama untied"]
    ids = _data()
    torch.manual_seed(0)
    ours = PipelineStage(CausalLM(TransformerConfig(**cfg)), rank, p)
    act_shape = lambda x: (*x.shape[:2], cfg["d_model"])  # noqa: E731
    Pipeline(ours, list(range(p)), lm_loss, act_shape).step(ids, ids, m, "1f1b")
    torch.manual_seed(0)
    theirs = PipelineStage(CausalLM(TransformerConfig(**cfg)), rank, p)
    sched = Schedule1F1B(TorchStage(theirs, rank, p, torch.device("cpu")), m, loss_fn=lm_loss, scale_grads=True)
    if rank == 0:
        sched.step(ids)
    elif rank == p - 1:
        sched.step(target=ids)
    else:
        sched.step()
    return max((a.grad - b.grad).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))


def _all_checks() -> tuple[dict, float]:
    return _pp_worker(), _torch_pipelining_worker()


@pytest.fixture(scope="module")
def two_stages():
    return launch(_all_checks, 2, echo=False)


@pytest.fixture(scope="module")
def four_stages():
    return launch(_pp_worker, 4, echo=False)


def _check(results: list[dict], p: int) -> None:
    for rank, errors in enumerate(results):
        grads = {k: v for k, v in errors.items() if k.endswith(" grad")}
        assert len(grads) == 2 * (2 * len(MICRO) + 1)
        for what, err in grads.items():
            assert err < ATOL, f"p={p} rank {rank}: {what} differs by {err:.2e} from one process"
    losses = {k: v for k, v in results[-1].items() if k.endswith(" loss")}  # the last stage reports the loss
    assert len(losses) == len(grads)
    for what, err in losses.items():
        assert err < ATOL, f"p={p}: {what} differs by {err:.2e}"


def test_two_stages_give_the_gradients_of_one_process(two_stages):
    _check([r[0] for r in two_stages], 2)


def test_four_stages_give_the_gradients_of_one_process(four_stages):
    _check(four_stages, 4)


def test_peak_activations_1f1b_at_most_p_minus_s_gpipe_m(four_stages):
    for s, results in enumerate(four_stages):
        for m in MICRO:
            assert results[f"gpt2 tied gpipe m={m} peak"] == m
            assert results[f"gpt2 tied 1f1b m={m} peak"] == min(m, 4 - s)
        assert results["gpt2 tied naive m=4 peak"] == 1


def test_matches_torch_pipelining(two_stages):
    for rank, (_, err) in enumerate(two_stages):
        assert err < ATOL, f"rank {rank}: gradients differ by {err:.2e} from torch.distributed.pipelining"


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b"])
def test_every_stage_runs_each_micro_batch_forward_then_backward_once(name):
    for p in (1, 2, 4):
        for m in (1, 3, 8):
            for s in range(p):
                actions = [(a.kind, a.micro) for a in schedule(name, m, p, s)]  # one chunk: chunk 0 always
                assert sorted(actions) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
                assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(m))


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "scaled_sinusoidal", "alibi", "rope"])
def test_one_stage_is_the_whole_model(position):
    """The stage runs the model's own embedding, attention inputs and final norm: the same logits, exactly."""
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ, position=position)
    model = CausalLM(cfg).eval()
    ids = _data()
    torch.testing.assert_close(PipelineStage(model, 0, 1)(ids), model(ids), atol=0, rtol=0)


def test_partition_balances_costs_and_refuses_bad_cuts():
    assert partition([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    with pytest.raises(ValueError, match="cannot fill 4 pipeline stages"):
        partition([1, 1], 4)
    model = CausalLM(TransformerConfig(vocab_size=16, d_model=16, n_layers=3, n_heads=2))
    with pytest.raises(ValueError, match="3 layers cannot be divided into 2 equal stages"):
        PipelineStage(model, 0, 2)
    assert len(PipelineStage(model, 0, 2, balance="parameters").layers) == 1  # the embeddings weigh on stage 0
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule("zero-bubble", 4, 2, 0)
