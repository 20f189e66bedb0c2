"""Lesson 09's graders: each passes a right answer, and fails a plausible wrong value and a right value
reached the wrong way (an answer that matches the lesson's own case but not the method the exercise asks for)."""

import math

import torch
import torch.utils.checkpoint as torch_checkpoint
from naive_checkpoint import NaiveCheckpoint
from torch import nn

from llmedu.checks.accumulation import check_frozen_input_checkpoint
from llmedu.checks.train import check_best_segment, check_recompute_flops, check_token_weights
from llmedu.models import CausalLM, TransformerConfig
from llmedu.train.recompute import Recompute, checkpoint
from llmedu.train.selective import recompute_core, saved_bytes, undo_recompute_core


# -- exercise 1: the weight of a token under the mean of means ----------------------------------------
def test_token_weights(capsys):
    assert check_token_weights(lambda n: [sum(n) / (len(n) * n_i) for n_i in n])
    assert not check_token_weights(lambda n: [len(n) * n_i / sum(n) for n_i in n])  # upside down
    # the page's counts right, by a table rather than the rule: fails the grader's other counts
    table = {(32, 60, 94, 119): [305 / (4 * n) for n in (32, 60, 94, 119)]}
    assert not check_token_weights(lambda n: table.get(tuple(n), [1.0] * len(n)))
    # the rule applied to the counts sorted (the page's are sorted): fails unsorted counts
    assert not check_token_weights(lambda n: [sum(n) / (len(n) * n_i) for n_i in sorted(n)])


# -- exercise 2: the segment length -------------------------------------------------------------------
def _best(L, c):
    return min(((k, L / k + c * k) for k in range(1, L + 1) if L % k == 0), key=lambda kp: kp[1])


def test_best_segment():
    assert check_best_segment(_best)
    # Chen et al.'s sqrt(L), whatever c: wrong for the lesson's c
    assert not check_best_segment(lambda L, c: _best_of(L, c, round(math.sqrt(L))))

    def step_down(L, c):  # the nearest integer to sqrt(L / c), moved down to a divisor: the page's case passes
        k = max(1, round(math.sqrt(L / c)))
        while L % k:
            k -= 1
        return k, L / k + c * k

    assert step_down(16, 34.56) == _best(16, 34.56)  # right on the lesson's model ...
    assert not check_best_segment(step_down)  # ... wrong where the divisors are far apart (26 blocks, c = 0.5)


def _best_of(L, c, k):
    k = max(1, min(L, k))
    while L % k:
        k -= 1
    return k, L / k + c * k


# -- exercise 3: the FLOPs of recomputation -----------------------------------------------------------
def _ratio(policy, d, s, d_ff, H, H_kv):
    kv = H_kv * d // H
    core = 4 * s * d
    attention = 4 * d * d + 4 * d * kv + core
    block = attention + 4 * d * d_ff
    return 1 + {"blocks": block, "attention": attention, "core": core}[policy] / (3 * block)


def test_recompute_flops():
    assert check_recompute_flops(_ratio)
    assert not check_recompute_flops(lambda p, d, s, dff, H, Hk: 4 / 3 if p == "blocks" else 1.0)  # a guess
    # the page's GPT formula (d_ff = 4d, no GQA): right for the lesson's model, wrong for the GQA ones
    assert not check_recompute_flops(
        lambda p, d, s, dff, H, Hk: (
            1
            + {"blocks": 24 * d * d + 4 * s * d, "attention": 8 * d * d + 4 * s * d, "core": 4 * s * d}[p]
            / (72 * d * d + 12 * s * d)
        )
    )


# -- exercise 4: the checkpoint whose input is frozen ---------------------------------------------------
_Checkpoint = NaiveCheckpoint  # the lesson's Checkpoint: no output graph when x needs no grad


def _fixed(f, x):  # what enable_input_require_grads does: an input that requires grad gives the output a graph
    return _Checkpoint.apply(f, x if x.requires_grad else x.detach().requires_grad_(True))


class _ParametersAsInputs(torch.autograd.Function):  # the other fix: f's parameters are inputs of the Function
    @staticmethod
    def forward(ctx, f, x, *params):
        return _Checkpoint.forward(ctx, f, x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        params = list(ctx.f.parameters())
        with torch.enable_grad():
            grads = torch.autograd.grad(ctx.f(x), [x, *params], grad_out)
        return None, *grads


def test_frozen_input_checkpoint(capsys):
    assert check_frozen_input_checkpoint(_fixed)
    assert check_frozen_input_checkpoint(lambda f, x: _ParametersAsInputs.apply(f, x, *f.parameters()))
    capsys.readouterr()
    assert not check_frozen_input_checkpoint(_Checkpoint.apply)  # the bug itself
    assert "got no gradient" in capsys.readouterr().out
    # right gradients, reached by calling a library's checkpoint instead of writing the fix
    assert not check_frozen_input_checkpoint(lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=False))
    assert "torch.utils.checkpoint" in capsys.readouterr().out
    assert not check_frozen_input_checkpoint(lambda f, x: Recompute.apply(f, x))  # the library's Recompute
    assert "llmedu.train.recompute" in capsys.readouterr().out
    assert not check_frozen_input_checkpoint(lambda f, x: checkpoint(f, x))  # the library's checkpoint refuses x
    assert "needs at least" in capsys.readouterr().out
    assert not check_frozen_input_checkpoint(lambda f, x: f(x))  # no checkpoint: saves every activation
    assert "keep only x" in capsys.readouterr().out
    # the fix applied to the frozen case only, its gradient of x dropped: fails the input that requires grad
    assert not check_frozen_input_checkpoint(lambda f, x: _Checkpoint.apply(f, x.detach().requires_grad_(True)))
    assert "gradient of x" in capsys.readouterr().out


# -- the library the lesson counts with ---------------------------------------------------------------
def test_saved_bytes_matches_the_count_and_core_recomputation_drops_the_probabilities():
    B, T, d, H = 2, 24, 16, 4
    config = TransformerConfig.gpt2(
        vocab_size=32, d_model=d, n_layers=1, n_heads=H, max_seq_len=T, dropout=0.1, attn_impl="math", fused=True
    )
    model = CausalLM(config)
    block = model.transformer.blocks[0]
    x = torch.randn(B, T, d, requires_grad=True)
    # 18 (B, T, d) tensors, the (B, H, T, T) probabilities, the norms' statistics, the causal mask
    count = 4 * (18 * B * T * d + H * T * T * B) + 16 * B * T + T * T
    assert saved_bytes(lambda: block(x, causal=True), exclude=model) == count
    assert recompute_core(model) == 1
    assert saved_bytes(lambda: block(x, causal=True), exclude=model) == count - 4 * H * T * T * B - T * T
    undo_recompute_core(model)
    assert block.attn.impl == "math"


def test_core_recomputation_keeps_the_gradients():
    config = TransformerConfig.gpt2(vocab_size=32, d_model=16, n_layers=2, n_heads=4, max_seq_len=12, dropout=0.1)
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))

    def grads(core):
        torch.manual_seed(0)
        model = CausalLM(config)
        if core:
            recompute_core(model)
        torch.manual_seed(1)
        nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    assert torch.equal(grads(True), grads(False))


def test_recompute_core_refuses_a_model_without_our_attention():
    import pytest

    with pytest.raises(TypeError, match="no llmedu Attention inside Linear"):
        recompute_core(nn.Linear(2, 2))
