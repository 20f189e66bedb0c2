"""The new graders of lesson 12 pass the right answers and fail a plausible wrong value and a right value
reached the wrong way (asking llmedu, or collectives waited on at once)."""

import pytest
import torch

from llmedu.checks.tensor_parallel import (
    bytes_per_rank,
    check_bytes_per_rank,
    check_exposed_per_block,
    check_sp_column_backward,
    exposed_per_block,
    sp_column_backward,
)
from llmedu.memory.estimate import activation_bytes_per_layer
from llmedu.parallel.tp_study import backward_model


def hand_exposed(tokens, d, ff, n, flops, a, b, v, compute_factor=1.0):
    """Written out here, as a learner would: the graders fail any answer that calls into llmedu."""
    if n == 1:
        return 0.0, 0.0
    c = 2 * (n - 1) * a + 2 * (n - 1) / n * tokens * d * v / b
    hide = [compute_factor * 2 * tokens * d * out / n / flops for out in (3 * d, ff)]
    return 2 * c, sum(max(0.0, c - w) for w in hide)


def test_exposed_per_block():
    assert check_exposed_per_block(hand_exposed)
    assert hand_exposed(8192, 4096, 16384, 2, 6e14, 5e-6, 1e11, 2) == exposed_per_block(
        8192, 4096, 16384, 2, 6e14, 5e-6, 1e11, 2
    )

    def nothing_hidden(*args):
        forward, _ = hand_exposed(*args)
        return forward, forward

    def behind_whole_backward(*args):  # as if the input gradients hid it too: twice the compute
        return hand_exposed(*args, compute_factor=2.0)

    def asks_the_library(tokens, d, ff, n, flops, a, b, v):  # the right numbers, from tp_study's model
        if n == 1:
            return 0.0, 0.0
        c = 2 * (n - 1) * a + 2 * (n - 1) / n * tokens * d * v / b
        weight = [2 * tokens * d * out / n / flops for out in (3 * d, ff)]
        return 2 * c, sum(backward_model(0.0, w, c, overlap=True) - w for w in weight)

    assert not check_exposed_per_block(nothing_hidden)
    assert not check_exposed_per_block(behind_whole_backward)
    assert not check_exposed_per_block(lambda *args: (0.0, 0.0))  # everything hidden
    assert not check_exposed_per_block(asks_the_library)
    assert asks_the_library(8192, 4096, 16384, 2, 6e14, 5e-6, 1e11, 2) == pytest.approx(
        hand_exposed(8192, 4096, 16384, 2, 6e14, 5e-6, 1e11, 2)
    )


def test_sp_column_backward():
    assert check_sp_column_backward(sp_column_backward)

    def waits_at_once(x_shard, weight, grad_y, comm):  # right values, no overlap
        full_x = torch.empty(grad_y.shape[0], x_shard.shape[1], dtype=x_shard.dtype)
        comm.all_gather_single(full_x, x_shard, async_op=True).wait()
        grad_x = grad_y @ weight
        out = torch.empty_like(x_shard)
        comm.reduce_scatter_single(out, grad_x, async_op=True).wait()
        return out, grad_y.t() @ full_x

    def scatter_after_weight(x_shard, weight, grad_y, comm):  # the all-gather hidden, the reduce-scatter not
        full_x = torch.empty(grad_y.shape[0], x_shard.shape[1], dtype=x_shard.dtype)
        gather = comm.all_gather_single(full_x, x_shard, async_op=True)
        grad_x = grad_y @ weight
        gather.wait()
        grad_w = grad_y.t() @ full_x
        out = torch.empty_like(x_shard)
        comm.reduce_scatter_single(out, grad_x, async_op=True).wait()
        return out, grad_w

    def never_waits(x_shard, weight, grad_y, comm):  # the right order, but the buffers are read unfinished
        full_x = torch.empty(grad_y.shape[0], x_shard.shape[1], dtype=x_shard.dtype)
        comm.all_gather_single(full_x, x_shard, async_op=True)
        grad_x = grad_y @ weight
        out = torch.empty_like(x_shard)
        comm.reduce_scatter_single(out, grad_x, async_op=True)
        return out, grad_y.t() @ full_x

    def own_share_only(x_shard, weight, grad_y, comm):  # a wrong value: this rank's partial, never reduced
        _, grad_w = sp_column_backward(x_shard, weight, grad_y, comm)
        n = grad_y.shape[0] // x_shard.shape[0]
        return (grad_y @ weight).chunk(n)[0], grad_w

    for wrong in (waits_at_once, scatter_after_weight, never_waits, own_share_only):
        assert not check_sp_column_backward(wrong), wrong.__name__


def hand_bytes(d, layers, heads, vocab, s, b, t, whole_activations=10, whole_params=6):
    params = layers * ((12 * d * d + 7 * d) / t + whole_params * d) + vocab * d / t
    return 16 * params + layers * s * b * d * (whole_activations + 24 / t + 5 * heads * s / (d * t))


def test_bytes_per_rank():
    assert check_bytes_per_rank(hand_bytes)
    assert hand_bytes(4096, 32, 32, 51200, 2048, 4, 8) == bytes_per_rank(4096, 32, 32, 51200, 2048, 4, 8)

    def all_split(d, layers, heads, vocab, s, b, t):  # every byte divided by t
        return hand_bytes(d, layers, heads, vocab, s, b, 1) / t

    def activations_all_split(d, layers, heads, vocab, s, b, t):
        return hand_bytes(d, layers, heads, vocab, s, b, t, whole_activations=10 / t)

    def biases_and_norms_split(d, layers, heads, vocab, s, b, t):
        return hand_bytes(d, layers, heads, vocab, s, b, t, whole_params=6 / t)

    def asks_the_library(d, layers, heads, vocab, s, b, t):  # the right number, activations from llmedu
        params = layers * ((12 * d * d + 7 * d) / t + 6 * d) + vocab * d / t
        return 16 * params + layers * activation_bytes_per_layer(s, b, d, heads, tensor_parallel=t)

    for wrong in (all_split, activations_all_split, biases_and_norms_split, asks_the_library):
        assert not check_bytes_per_rank(wrong), wrong.__name__
    assert asks_the_library(4096, 32, 32, 51200, 2048, 4, 8) == hand_bytes(4096, 32, 32, 51200, 2048, 4, 8)
