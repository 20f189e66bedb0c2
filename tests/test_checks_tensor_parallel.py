"""The graders of lesson 12 (llmedu.checks.tensor_parallel) pass the right answers and fail plausible wrong
ones; the references for all-reduce calls and per-rank parameters are checked against the real model."""

import torch
import torch.distributed as dist

from llmedu.checks.tensor_parallel import (
    check_tp_params_per_rank,
    check_tp_step_all_reduces,
    check_tp_step_time,
    tp_params_per_rank,
    tp_step_all_reduces,
    tp_step_time,
)
from llmedu.models import CausalLM, TransformerConfig
from llmedu.parallel import launch
from llmedu.parallel.tensor_parallel import tensor_parallel, vocab_parallel_lm_loss


def test_step_all_reduces():
    assert check_tp_step_all_reduces(tp_step_all_reduces)
    assert not check_tp_step_all_reduces(lambda n_layers: (2 * n_layers, 2 * n_layers))  # the blocks only
    assert not check_tp_step_all_reduces(lambda n_layers: (2 * n_layers + 4, 2 * n_layers))  # forgets the head's f


def test_params_per_rank():
    assert check_tp_params_per_rank(tp_params_per_rank)
    assert not check_tp_params_per_rank(lambda d, ff, h, hkv, n: tp_params_per_rank(d, ff, h, hkv, 1) // n)  # all split
    assert not check_tp_params_per_rank(lambda d, ff, h, hkv, n: tp_params_per_rank(d, ff, h, h, n))  # ignores GQA


def test_step_time():
    assert check_tp_step_time(tp_step_time)

    def overlapped(c, n, layers, t, d, b, a, bw):  # as if the all-reduces hid behind compute, like DDP's
        return max(c / n, tp_step_time(c, n, layers, t, d, b, a, bw) - c / n)

    assert not check_tp_step_time(overlapped)
    assert not check_tp_step_time(lambda c, n, layers, t, d, b, a, bw: c / n + 4 * layers * (t * d * b / bw) * (n > 1))


def _count_and_size():
    counted = {"calls": 0}
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        counted["calls"] += 1
        return original(tensor, *args, **kwargs)

    torch.manual_seed(0)
    cfg = TransformerConfig.gpt2(vocab_size=64, d_model=32, n_layers=3, n_heads=4, d_ff=96)
    tp = tensor_parallel(CausalLM(cfg))
    ids = torch.randint(0, 64, (2, 8))
    dist.all_reduce = counting
    try:
        loss = vocab_parallel_lm_loss(tp(ids), ids)
        forward = counted["calls"]
        loss.backward()
        backward = counted["calls"] - forward
    finally:
        dist.all_reduce = original
    block = tp.transformer.blocks[0]
    held = sum(p.numel() for p in [*block.attn.parameters(), *block.mlp.parameters()])
    return forward, backward, held


def test_references_equal_what_the_model_does():
    for forward, backward, held in launch(_count_and_size, 2, echo=False):
        assert (forward, backward) == tp_step_all_reduces(3)
        assert held == tp_params_per_rank(32, 96, 4, 4, 2)
