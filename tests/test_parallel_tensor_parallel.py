"""Tensor parallelism against the unsplit layers, and against torch.distributed.tensor.parallel.

Every rank builds the same full layer (same seed), runs it on the whole input in its own process
(the oracle), and runs its tensor-parallel shard; outputs must match and every shard's gradient
must equal the matching slice of the full gradient. Tolerance 1e-5 in fp32: the split only changes
the order of the sums (a row-split matmul adds N partial sums), a relative rounding of ~1e-7 on
values of order 1; a missing all-reduce or a bias added N times is off by O(0.1).

All checks for one TP size run in one ``launch`` (starting processes costs seconds).
"""

import pytest
import torch
import torch.distributed as dist
from raised import raised

from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.nn.activations import FeedForward
from llmedu.nn.attention import Attention
from llmedu.parallel import launch
from llmedu.parallel.tensor_parallel import (
    ParallelAttention,
    ParallelMLP,
    shard,
    tensor_parallel,
    vocab_parallel_lm_loss,
)

ATOL = 1e-5

CONFIGS = {  # GPT-2-like (MHA, GELU, learned positions, tied) and LLaMA-like (GQA, SwiGLU, RoPE, untied)
    "gpt2": dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, activation="gelu_tanh"),
    "llama": dict(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        max_seq_len=16,
        position="rope",
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
        tie_embeddings=False,
    ),
}


def _grad_errors(tp_module, full_module) -> float:
    full = dict(full_module.named_parameters())
    worst = 0.0
    for name, p in tp_module.named_parameters():
        expected = full[name].grad if p.tp_dim is None else shard(full[name].grad, p.tp_dim)
        assert p.grad.shape == expected.shape, name
        worst = max(worst, (p.grad - expected).abs().max().item())
    return worst


def _tp_worker() -> dict:
    torch.set_num_threads(1)
    errors = {}
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    for activation in ("gelu", "swiglu"):  # the MLP: one f, one g
        torch.manual_seed(0)
        full = FeedForward(32, 64, activation)
        par = ParallelMLP(full, group=None)
        xf, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        (full(xf) * x).sum().backward()
        out = par(xp)
        (out * x).sum().backward()
        errors[f"mlp {activation} out"] = (out - full(x)).abs().max().item()
        errors[f"mlp {activation} input grad"] = (xp.grad - xf.grad).abs().max().item()
        for name in ("up_proj", "down_proj"):  # the parameter names are those of the full layer
            for pname, p in getattr(par, name).named_parameters():
                full_p = getattr(getattr(full, name), pname)
                expected = full_p.grad if p.tp_dim is None else shard(full_p.grad, p.tp_dim)
                errors[f"mlp {activation} {name}.{pname} grad"] = (p.grad - expected).abs().max().item()
    for n_kv in (8, 4):  # attention: MHA, and GQA with the key/value heads split too
        torch.manual_seed(0)
        full = Attention(32, 8, n_kv)
        par = ParallelAttention(full)
        xf, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        (full(xf, causal=True) * x).sum().backward()
        out = par(xp, causal=True)
        (out * x).sum().backward()
        errors[f"attention kv={n_kv} out"] = (out - full(x, causal=True)).abs().max().item()
        errors[f"attention kv={n_kv} input grad"] = (xp.grad - xf.grad).abs().max().item()
        errors[f"attention kv={n_kv} param grads"] = _grad_errors(par, full)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(2))
    for name, cfg in CONFIGS.items():  # the whole model, vocabulary-parallel embedding and loss included
        torch.manual_seed(0)
        full = CausalLM(TransformerConfig(**cfg))
        tp = tensor_parallel(full)
        full_loss = lm_loss(full(ids), ids)
        full_loss.backward()
        logits = tp(ids)  # (B, T, V / N)
        pieces = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, logits.detach())
        loss = vocab_parallel_lm_loss(logits, ids)
        loss.backward()
        errors[f"{name} logits"] = (torch.cat(pieces, -1) - full(ids)).abs().max().item()
        errors[f"{name} loss"] = abs(loss.item() - full_loss.item())
        errors[f"{name} param grads"] = _grad_errors(tp, full)
    return errors


def _torch_tp_worker() -> dict:
    """Our ParallelMLP and torch's ColwiseParallel/RowwiseParallel on a DeviceMesh: same shards, same output."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ours = ParallelMLP(FeedForward(32, 64, "gelu"))
    torch.manual_seed(0)
    theirs = FeedForward(32, 64, "gelu")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(theirs, mesh, {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
    out_ours, out_theirs = ours(x), theirs(x)
    (out_ours * x).sum().backward()
    (out_theirs * x).sum().backward()
    errors = {"out": (out_ours - out_theirs).abs().max().item()}
    for name in ("up_proj", "down_proj"):
        a, b = getattr(ours, name), getattr(theirs, name)
        errors[f"{name} weight shard"] = (a.weight - b.weight.to_local()).abs().max().item()
        errors[f"{name} weight grad"] = (a.weight.grad - b.weight.grad.to_local()).abs().max().item()
    return errors


def _bad_sizes_worker() -> list[str]:
    base = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=4)
    configs = (dict(n_heads=3, d_model=24), dict(n_heads=4, n_kv_heads=1), dict(vocab_size=63), dict(d_ff=33))
    return raised(*(lambda cfg=cfg: tensor_parallel(CausalLM(TransformerConfig(**{**base, **cfg}))) for cfg in configs))


def _checks_on_two_ranks() -> tuple[dict, dict, list[str]]:
    return _tp_worker(), _torch_tp_worker(), _bad_sizes_worker()


@pytest.fixture(scope="module")
def two_ranks():
    return launch(_checks_on_two_ranks, 2, echo=False)  # one start-up for every check on two ranks


def _assert_small(errors: dict, who: str) -> None:
    for what, err in errors.items():
        assert err < ATOL, f"{who}: {what} differs by {err:.2e}"


def test_tp2_equals_the_unsplit_model(two_ranks):
    for rank, (errors, _, _) in enumerate(two_ranks):
        assert len(errors) == 24
        _assert_small(errors, f"TP=2 rank {rank}")


def test_tp4_equals_the_unsplit_model():
    for rank, errors in enumerate(launch(_tp_worker, 4, echo=False)):
        assert len(errors) == 24
        _assert_small(errors, f"TP=4 rank {rank}")


def test_matches_torch_tensor_parallel(two_ranks):
    for rank, (_, errors, _) in enumerate(two_ranks):
        assert len(errors) == 5
        _assert_small(errors, f"rank {rank} against torch's ColwiseParallel/RowwiseParallel")


def test_sizes_that_do_not_divide_fail_at_set_up(two_ranks):
    messages = two_ranks[0][2]
    assert len(messages) == 4, messages
    for message, size in zip(messages, ("n_heads=3", "n_kv_heads=1", "vocab_size=63", "d_ff=33")):
        assert "over 2 ranks" in message and size in message, message
