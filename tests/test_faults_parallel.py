"""Faults of the parallel wrappers: ranks that build a split model from different weights.

Sequence and expert parallelism split a full model that every rank builds for itself. Built from
differently seeded weights, they ran without a word and their outputs were off by 0.6-0.8; now the
construction compares the ranks' weights (``llmedu.parallel.replicas``) and every rank raises, naming
the first tensor that differs. One launch of two ranks holds every case.
"""

import pytest
import torch
import torch.distributed as dist
from raised import raised

from llmedu.nn.blocks import SerialBlock
from llmedu.nn.moe import MoE
from llmedu.parallel import launch
from llmedu.parallel.experts import ExpertParallelMoE
from llmedu.parallel.replicas import check_replicas_agree, checksum
from llmedu.parallel.sequence_parallel import SequenceParallelMLPBlock
from llmedu.parallel.sequence_parallel_attention import SequenceParallelBlock

D = 16


def _seeded(build, seed):
    torch.manual_seed(seed)
    return build()


def _worker() -> list[str]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    block = lambda: SerialBlock(D, 2, 4 * D)  # noqa: E731
    moe = lambda: MoE(D, 2 * D, n_experts=4, top_k=2)  # noqa: E731
    norm_off = _seeded(block, 0)
    with torch.no_grad():
        norm_off.mlp_norm.weight[3] += rank * 1e-3  # only a replicated norm differs, and barely
    router_off = _seeded(moe, 0)
    with torch.no_grad():
        router_off.router.linear.weight[0, 0] += rank * 1e-3
    calls = [
        lambda: SequenceParallelBlock(_seeded(block, rank)),  # another seed on every rank
        lambda: SequenceParallelMLPBlock(norm_off.mlp_norm, norm_off.mlp),
        lambda: ExpertParallelMoE(_seeded(moe, rank)),
        lambda: ExpertParallelMoE(router_off),
        lambda: check_replicas_agree({"": torch.nn.Linear(D, D + rank)}, what="a Linear"),  # other shapes
    ]
    messages = raised(*calls, kind=RuntimeError)
    same = [SequenceParallelBlock(_seeded(block, 0)), ExpertParallelMoE(_seeded(moe, 0))]  # agree: built
    return messages + [type(m).__name__ for m in same]


@pytest.fixture(scope="module")
def two_ranks():
    return launch(_worker, 2, echo=False)


def test_differently_seeded_ranks_are_refused_naming_the_tensor(two_ranks):
    for rank, messages in enumerate(two_ranks):
        assert len(messages) == 7, f"rank {rank}: {messages}"
        assert messages[0].startswith("SequenceParallelAttentionBlock: attn.q_proj.weight (16, 16) differs")
        assert messages[1].startswith("SequenceParallelMLPBlock: norm.weight (16,) differs across the ranks (1 of")
        assert messages[2].startswith("ExpertParallelMoE: router.linear.weight (4, 16) differs across the ranks")
        assert messages[3].startswith("ExpertParallelMoE: router.linear.weight (4, 16) differs across the ranks (1 of")
        assert "seed every rank alike" in messages[0]
        assert messages[4].startswith("a Linear: the ranks hold different models: weight has 256 to 272 elements")
        assert messages[5:] == ["SequenceParallelBlock", "ExpertParallelMoE"]


def test_the_checksum_sees_every_byte_and_its_place():
    x = torch.randn(64)
    assert checksum(x) == checksum(x.clone())
    y = x.clone()
    y[7] = torch.nextafter(y[7], torch.tensor(float("inf")))  # one ulp
    assert checksum(y) != checksum(x)
    assert checksum(x.flip(0)) != checksum(x)  # the same values in another order
    assert checksum(x.to(torch.bfloat16)) == checksum(x.to(torch.bfloat16).clone())
