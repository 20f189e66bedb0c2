"""Sequence parallelism against explicit collectives, against one process running the plain block, and its memory.

Every rank builds the same plain pre-LN block (same seed) and runs its MLP half on the whole
sequence in its own process (the oracle), then runs the sequence-parallel block on its 1/N of the
tokens. Outputs (gathered along the sequence), input gradients (this rank's tokens) and parameter
gradients (the matching shard; LayerNorm and the second bias after their all-reduce) must agree.
Tolerance 1e-5 in fp32: the split only changes the order of the sums (N partial sums added by the
reduce-scatter, LayerNorm's weight gradient summed over N pieces of the sequence), a relative
rounding of ~1e-7 on values of order 1; a missing all-reduce or a wrong shard is off by O(0.1).

All checks for one size run in one ``launch`` (starting processes costs seconds).
"""

import pytest
import torch
import torch.distributed as dist
from raised import raised

from llmedu.nn.blocks import SerialBlock
from llmedu.parallel import launch
from llmedu.parallel.replicas import check_replicas_agree
from llmedu.parallel.sequence_parallel import (
    SequenceParallelMLPBlock,
    all_reduce_sequence_parallel_grads,
    gather_sequence,
    mlp_activation_bytes,
    paper_mlp_activation_bytes,
    reduce_scatter_sequence,
    sequence_shard,
)
from llmedu.parallel.sequence_parallel_attention import SequenceParallelBlock
from llmedu.parallel.tensor_parallel import shard

ATOL = 1e-5
B, T, D = 2, 8, 16


def _gather_list(t: torch.Tensor) -> list[torch.Tensor]:
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, t.contiguous())
    return pieces


def _conjugate_errors() -> dict:
    """g and g-bar, forward and backward, against all_gather / all_reduce written out."""
    n, r = dist.get_world_size(), dist.get_rank()
    seeded = torch.Generator().manual_seed(10 + r)  # different data on every rank
    errors = {}
    x = torch.randn(B, T // n, D, generator=seeded, requires_grad=True)  # (B, T/N, d)
    grad = torch.randn(B, T, D, generator=seeded)  # (B, T, d), a different upstream gradient per rank
    y = gather_sequence(x)
    y.backward(grad)
    errors["g forward"] = (y - torch.cat(_gather_list(x.detach()), dim=1)).abs().max().item()
    summed = torch.stack(_gather_list(grad)).sum(0)  # (B, T, d): every rank's gradient added up
    errors["g backward"] = (x.grad - summed.chunk(n, dim=1)[r]).abs().max().item()

    x = torch.randn(B, T, D, generator=seeded, requires_grad=True)  # (B, T, d) partial sums
    grad = torch.randn(B, T // n, D, generator=seeded)  # (B, T/N, d)
    y = reduce_scatter_sequence(x)
    y.backward(grad)
    summed = x.detach().clone()
    dist.all_reduce(summed)
    errors["g-bar forward"] = (y - summed.chunk(n, dim=1)[r]).abs().max().item()
    errors["g-bar backward"] = (x.grad - torch.cat(_gather_list(grad), dim=1)).abs().max().item()
    return errors


def _block_errors() -> tuple[dict, dict]:
    """The sequence-parallel MLP half against the plain block's, for GELU and SwiGLU, both ways of saving."""
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))  # the same on every rank
    w = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2))  # a loss that weighs every output
    errors, without_all_reduce = {}, {}
    for activation in ("gelu", "swiglu"):
        for store_shard in (True, False):
            case = f"{activation} store_shard={store_shard}"
            torch.manual_seed(0)
            block = SerialBlock(D, 2, 4 * D, activation=activation)
            xf = x.clone().requires_grad_()
            full = xf + block.mlp(block.mlp_norm(xf))  # the MLP half of a pre-LN block, dropout 0
            (full * w).sum().backward()

            sp = SequenceParallelMLPBlock(block.mlp_norm, block.mlp, store_shard=store_shard)
            xs = sequence_shard(x).requires_grad_()  # (B, T/N, d)
            out = sp(xs)
            (out * sequence_shard(w)).sum().backward()
            expected = {f"norm.{k}": v.grad for k, v in block.mlp_norm.named_parameters()}
            expected.update({f"mlp.{k}": v.grad for k, v in block.mlp.named_parameters()})
            grad_error = lambda name, p: (p.grad - expected[name]).abs().max().item()  # noqa: E731
            without_all_reduce[case] = grad_error("norm.weight", sp.norm.weight)  # only this rank's tokens
            all_reduce_sequence_parallel_grads(sp)

            errors[f"{case} out"] = (torch.cat(_gather_list(out.detach()), dim=1) - full).abs().max().item()
            errors[f"{case} input grad"] = (xs.grad - sequence_shard(xf.grad)).abs().max().item()
            for name, p in sp.named_parameters():
                key = name if name.startswith("norm.") else f"mlp.{name}"
                if p.tp_dim is not None:
                    expected[key] = shard(expected[key], p.tp_dim)
                errors[f"{case} {name} grad"] = grad_error(key, p)
    return errors, without_all_reduce


def _bad_length_messages() -> list[str]:
    return raised(lambda: sequence_shard(torch.zeros(B, 7, D)), lambda: reduce_scatter_sequence(torch.zeros(B, 7, D)))


def _replica_messages() -> list[str]:
    """Blocks built from weights that differ across the ranks: each rank raises, naming the first tensor."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    norm_off = SerialBlock(D, 4, 4 * D)  # 4 heads: SP=4 runs it too
    with torch.no_grad():
        norm_off.mlp_norm.weight[3] += rank * 1e-3  # only a replicated norm differs, and barely
    torch.manual_seed(rank)  # another seed on every rank: the old code ran and was off by 0.6-0.8
    seeded = SerialBlock(D, 4, 4 * D)
    return raised(
        lambda: SequenceParallelBlock(seeded),
        lambda: SequenceParallelMLPBlock(norm_off.mlp_norm, norm_off.mlp),
        lambda: check_replicas_agree({"": torch.nn.Linear(D, D + rank)}, what="a Linear"),  # other shapes
        kind=RuntimeError,
    )


def _worker() -> dict:
    torch.set_num_threads(1)
    block, without = _block_errors()
    return dict(
        conjugates=_conjugate_errors(),
        block=block,
        without_all_reduce=without,
        messages=_bad_length_messages(),
        replicas=_replica_messages(),
        memory=mlp_activation_bytes(B, T, D, dtype=torch.bfloat16),
    )


@pytest.fixture(scope="module")
def two_ranks():
    return launch(_worker, 2, echo=False)


def _assert_small(errors: dict, who: str) -> None:
    for what, err in errors.items():
        assert err < ATOL, f"{who}: {what} differs by {err:.2e}"


def test_g_and_g_bar_match_explicit_collectives(two_ranks):
    for rank, result in enumerate(two_ranks):
        assert len(result["conjugates"]) == 4
        _assert_small(result["conjugates"], f"rank {rank}")


def test_sp2_equals_the_plain_block(two_ranks):
    for rank, result in enumerate(two_ranks):
        # per case: out, input grad, norm weight and bias, up (and gate) weight and bias, down weight and bias
        assert len(result["block"]) == 2 * (2 + 6) + 2 * (2 + 8)
        _assert_small(result["block"], f"SP=2 rank {rank}")


def test_layernorm_grads_need_the_all_reduce(two_ranks):
    for result in two_ranks:  # each rank saw half the tokens: its own gradient is far from the full one
        assert all(err > 1e-3 for err in result["without_all_reduce"].values()), result["without_all_reduce"]


def test_sp4_equals_the_plain_block():
    for rank, result in enumerate(launch(_worker, 4, echo=False)):
        _assert_small(result["conjugates"], f"SP=4 rank {rank}")
        _assert_small(result["block"], f"SP=4 rank {rank}")
        assert len(result["replicas"]) == 3, result["replicas"]  # refused at 4 ranks too


def test_sequence_not_divisible_fails_clearly(two_ranks):
    messages = two_ranks[0]["messages"]
    assert len(messages) == 2, messages
    for message in messages:
        assert "7 tokens" in message and "2 sequence-parallel ranks" in message, message


def test_weights_that_differ_across_ranks_are_refused_naming_the_tensor(two_ranks):
    for rank, result in enumerate(two_ranks):
        messages = result["replicas"]
        assert len(messages) == 3, f"rank {rank}: {messages}"
        assert messages[0].startswith("SequenceParallelAttentionBlock: attn.q_proj.weight (16, 16) differs")
        assert "seed every rank alike" in messages[0]
        assert messages[1].startswith("SequenceParallelMLPBlock: norm.weight (16,) differs across the ranks (1 of")
        assert messages[2].startswith("a Linear: the ranks hold different models: weight has 256 to 272 elements")


def test_sequence_parallel_saves_activation_memory(two_ranks):
    """N=2, bf16: measured = the paper's count with a 2-byte CPU dropout mask + LayerNorm's mean and 1/std."""
    memory = two_ranks[0]["memory"]
    assert all(result["memory"] == memory for result in two_ranks)
    ln_stats = 2 * B * T * 2  # mean and 1/std per token, bf16
    assert memory["tp"] == paper_mlp_activation_bytes(T, B, D, 2, False, mask_bytes=2) + ln_stats
    assert memory["sp"] == paper_mlp_activation_bytes(T, B, D, 2, True, mask_bytes=2) + ln_stats / 2
    assert memory["sp"] < memory["sp_gathered"] < memory["tp"]
    # saved: the replicated LN input, linear-1 input and mask (2 + 2 + 2 bytes per element) and the stats, halved
    assert memory["tp"] - memory["sp"] == (6 * T * B * D + ln_stats) / 2
