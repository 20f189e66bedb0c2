"""A whole pre-LN block under sequence parallelism against one process and against torch's own SP.

Every rank builds the same ``SerialBlock`` (same seed) and runs it on the whole sequence (the
oracle), then ``SequenceParallelBlock`` on its 1/N of the tokens, and then torch's peer:
``torch.distributed.tensor.parallel`` with ``SequenceParallel`` on both LayerNorms, a
``PrepareModuleInput`` (Shard(1) -> Replicate: the all-gather) before each half, ``ColwiseParallel``
on Q, K, V and the first MLP layer, ``RowwiseParallel(output_layouts=Shard(1))`` (the
reduce-scatter) on the output projections, on a gloo ``DeviceMesh`` on the CPU, with the same weights.

Tolerance 1e-5 in fp32: the split changes only the order of sums (heads' partial sums added by the
reduce-scatter, a norm's weight gradient summed over N pieces of the sequence), ~1e-7 relative on
values of order 1 (we saw at most ~1.2e-6); a missing all-reduce, a wrong head slice or a swapped
shard is off by O(0.1).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from raised import raised

from llmedu.nn.blocks import SerialBlock
from llmedu.parallel import launch
from llmedu.parallel.sequence_parallel import all_reduce_sequence_parallel_grads, sequence_shard
from llmedu.parallel.sequence_parallel_attention import SequenceParallelBlock, block_activation_bytes
from llmedu.parallel.tensor_parallel import shard

ATOL = 1e-5
B, T, D, H = 2, 8, 16, 4
MEMORY_SHAPE = (1, 32, 16, 4)  # B, T, d, H for the activation count
CASES = [(causal, store_shard) for causal in (True, False) for store_shard in (True, False)]


def _torch_peer(block: SerialBlock, n: int) -> SerialBlock:
    """The same block parallelised by torch: DTensor's sequence parallelism plus Megatron's TP plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    peer = copy.deepcopy(block)
    peer.zero_grad(set_to_none=True)
    peer.attn.n_heads //= n  # the local output of ColwiseParallel holds H / N heads
    peer.attn.n_kv_heads //= n
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "attn_norm": SequenceParallel(),
        "attn": gather,
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": gather,
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    return parallelize_module(peer, init_device_mesh("cpu", (n,)), plan)


def _errors(causal: bool, store_shard: bool) -> dict:
    n = dist.get_world_size()
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))  # the same on every rank
    w = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2))  # a loss that weighs every output
    torch.manual_seed(0)
    block = SerialBlock(D, H, 4 * D)
    xf = x.clone().requires_grad_()
    full = block(xf, causal=causal)  # (B, T, d): the oracle
    (full * w).sum().backward()
    expected = {name: p.grad for name, p in block.named_parameters()}

    sp = SequenceParallelBlock(block, store_shard=store_shard)
    xs = sequence_shard(x).requires_grad_()  # (B, T/N, d)
    out = sp(xs, causal=causal)
    (out * sequence_shard(w)).sum().backward()
    all_reduce_sequence_parallel_grads(sp)
    errors = {
        "out": (out - sequence_shard(full.detach())).abs().max().item(),
        "input grad": (xs.grad - sequence_shard(xf.grad)).abs().max().item(),
    }
    ours = {}
    for name, p in sp.named_parameters():  # "attn.norm.weight" is the block's "attn_norm.weight"
        key = name.replace("attn.norm.", "attn_norm.").replace("mlp.norm.", "mlp_norm.")
        ours[key] = p
        target = expected[key] if p.tp_dim is None else shard(expected[key], p.tp_dim)
        errors[f"{key} grad"] = (p.grad - target).abs().max().item()
    assert len(ours) == len(expected), sorted(set(expected) - set(ours))

    peer = _torch_peer(block, n)
    xp = sequence_shard(x).requires_grad_()
    theirs = peer(xp, causal=causal)  # (B, T/N, d), a plain tensor (use_local_output)
    (theirs * sequence_shard(w)).sum().backward()
    errors["peer out"] = (theirs - out).abs().max().item()
    errors["peer input grad"] = (xp.grad - xs.grad).abs().max().item()
    for name, p in peer.named_parameters():  # a replicated weight's gradient may be Partial: sum it first
        grad = p.grad.redistribute(p.device_mesh, p.placements).to_local()  # this rank's shard, as ours
        errors[f"peer {name} grad"] = (grad - ours[name].grad).abs().max().item()
    return errors


def _bad_input_messages() -> list[str]:
    return raised(
        lambda: SequenceParallelBlock(SerialBlock(18, 3, 72)),  # 3 heads over 2 or 4 ranks
        lambda: sequence_shard(torch.zeros(B, 7, D)),  # 7 tokens
        lambda: SequenceParallelBlock(SerialBlock(D, 4, 4 * D, placement="post")),
    )


def _worker() -> dict:
    torch.set_num_threads(1)
    return dict(
        errors={case: _errors(*case) for case in CASES},
        bad=_bad_input_messages(),
        memory={impl: block_activation_bytes(*MEMORY_SHAPE, attn_impl=impl) for impl in ("math", "sdpa")},
    )


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def ranks(request):
    return request.param, launch(_worker, request.param, echo=False)


def test_sp_block_equals_one_process_and_torch_peer(ranks):
    world, results = ranks
    for rank, result in enumerate(results):
        for (causal, store_shard), errors in result["errors"].items():
            # out, input grad, 16 parameters; the peer: out, input grad, 16 parameters
            assert len(errors) == 2 * (2 + 16), sorted(errors)
            for what, err in errors.items():
                assert err < ATOL, f"N={world} rank {rank} causal={causal} store_shard={store_shard}: {what} {err:.2e}"


def test_bad_input_fails_clearly(ranks):
    world, results = ranks
    heads, length, placement = results[0]["bad"]
    assert f"tensor parallelism over {world} ranks needs {world} to divide n_heads=3" in heads
    assert f"7 tokens cannot be split evenly over {world}" in length
    assert "pre-LN" in placement


def test_sp_saves_activations_over_tp(ranks):
    """Counted by the saved-tensor hooks: every tensor a rank saves under SP is 1/N of one process's, but one.

    The exception: ``math`` attention's causal mask, a (T, T) boolean shared by the heads, is built whole on
    every rank. TP keeps the norms' inputs, the dropout masks and the first layers' inputs whole.
    """
    world, results = ranks
    for impl in ("math", "sdpa"):
        memory = results[0]["memory"][impl]
        assert all(result["memory"][impl] == memory for result in results)  # every rank holds the same
        assert memory["sp"] < memory["tp"] < memory["one"], (impl, memory)
    mask = MEMORY_SHAPE[1] ** 2  # (T, T) bool
    math, sdpa = results[0]["memory"]["math"], results[0]["memory"]["sdpa"]
    assert sdpa["sp"] * world == sdpa["one"], sdpa
    assert math["sp"] == (math["one"] - mask) // world + mask, math
