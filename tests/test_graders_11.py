"""Lesson 11's graders fail a plausible wrong value and a right value computed the wrong way, and pass a right answer.

(The first graders' basic cases are in test_checks_data_parallel.py; here, the method.)
"""

from contextlib import nullcontext

import torch
from torch import nn

from llmedu.checks.data_parallel import (
    accumulation_step,
    bucket_comm_time,
    check_accumulation,
    check_bucket_comm_time,
    check_bucket_prediction,
    check_exposed_communication,
    check_launch_order,
    exposed_communication,
    launch_order,
)
from llmedu.parallel.data_parallel import assign_buckets
from llmedu.parallel.link import Link


def test_bucket_comm_time_refuses_the_reference():
    def borrowed(sizes, cap, n, alpha, bw):  # right on every case, by calling the grader's answer
        return bucket_comm_time(sizes, cap, n, alpha, bw)

    def per_parameter(sizes, cap, n, alpha, bw):  # a plausible wrong value: one all-reduce per parameter
        return sum(2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw for s in sizes)

    assert borrowed([4096] * 3, 8192, 2, 1e-5, 1e9) == bucket_comm_time([4096] * 3, 8192, 2, 1e-5, 1e9)
    result = check_bucket_comm_time(borrowed)
    assert not result and "grader's own answer" in result.failure
    assert not check_bucket_comm_time(per_parameter)

    def from_the_link(sizes, cap, n, alpha, bw):  # right on every case, by the link's own cost model
        link = Link(alpha, bw)
        return sum(link.op_time("all_reduce", sum(sizes[i] for i in b), n) for b in assign_buckets(sizes, cap))

    assert from_the_link([4096] * 3, 8192, 2, 1e-5, 1e9) == bucket_comm_time([4096] * 3, 8192, 2, 1e-5, 1e9)
    result = check_bucket_comm_time(from_the_link)
    assert not result and "op_time" in result.failure


def test_bucket_prediction():
    mib, n, alpha, bw = 2**20, 8, 1e-5, 25e9
    ring = lambda nbytes: 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw  # noqa: E731
    right = {  # 4 buckets of 25 parameters; at 0.1 MiB every 1 MiB parameter gets a bucket of its own
        "buckets at 25 MiB": 4,
        "seconds at 25 MiB": 4 * ring(25 * mib),
        "buckets at 0.1 MiB": 100,
        "seconds at 0.1 MiB": 100 * ring(mib),
    }
    assert check_bucket_prediction(right)
    assert check_bucket_prediction({**right, "seconds at 0.1 MiB": 1.01 * right["seconds at 0.1 MiB"]})  # rounded
    # the plausible wrong value: 100 MiB / 0.1 MiB = 1,000 buckets, as if parameters were split
    uncapped = {**right, "buckets at 0.1 MiB": 1000, "seconds at 0.1 MiB": 1000 * ring(0.1 * mib)}
    result = check_bucket_prediction(uncapped)
    assert not result and "never splits a parameter" in result.failure
    # the right count, the seconds computed the wrong way: one latency per step, not per bucket
    one_latency = {**right, "seconds at 0.1 MiB": ring(100 * mib)}
    result = check_bucket_prediction(one_latency)
    assert not result and "seconds at 0.1 MiB" in result.failure
    result = check_bucket_prediction({**right, "buckets at 25 MiB": None})
    assert not result and "fill in a number" in result.failure


def test_launch_order_refuses_the_reference():
    assert not check_launch_order(lambda ready, buckets: launch_order(ready, buckets))

    def count_each_bucket_alone(ready, buckets):  # right when backward runs in order, wrong otherwise
        position = {index: count for count, index in enumerate(ready, start=1)}
        return [max(position[i] for i in bucket) for bucket in buckets]

    assert count_each_bucket_alone([3, 2, 1, 0], [[3, 2], [1, 0]]) == launch_order([3, 2, 1, 0], [[3, 2], [1, 0]])
    assert not check_launch_order(count_each_bucket_alone)


def test_exposed_communication_needs_the_queue():
    def two_ends(compute, comm):
        # the lesson's closed form for equal buckets: all of backward then the last all-reduce, or the
        # first bucket's backward then every all-reduce; right whenever the buckets are alike
        end = max(sum(compute) + comm[-1], compute[0] + sum(comm))
        return end - sum(compute)

    assert two_ends([1.0, 1.0, 1.0], [2.0] * 3) == exposed_communication([1.0, 1.0, 1.0], [2.0] * 3)
    assert two_ends([2.0, 0.1, 0.1], [0.5] * 3) == exposed_communication([2.0, 0.1, 0.1], [0.5] * 3)
    assert not check_exposed_communication(two_ends)  # the queue that decides can start in the middle
    assert not check_exposed_communication(lambda compute, comm: exposed_communication(compute, comm))
    assert not check_exposed_communication(lambda compute, comm: comm[-1])  # a plausible wrong value
    assert check_exposed_communication(exposed_communication)


def test_accumulation():
    assert check_accumulation(accumulation_step)

    def every_micro_batch(model, optimizer, micro_batches):  # right parameters, an all-reduce per micro-batch
        optimizer.zero_grad()
        for x, y in micro_batches:
            (nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()
            model.finish_gradient_sync()
        optimizer.step()

    def summed_losses(model, optimizer, micro_batches):  # no_sync, but the losses are not divided
        optimizer.zero_grad()
        for i, (x, y) in enumerate(micro_batches):
            with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():
                nn.functional.mse_loss(model(x), y).backward()
        model.finish_gradient_sync()
        optimizer.step()

    def never_waits(model, optimizer, micro_batches):  # steps while the last all-reduces are in flight
        optimizer.zero_grad()
        for i, (x, y) in enumerate(micro_batches):
            with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():
                (nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()
        optimizer.step()

    result = check_accumulation(every_micro_batch)
    assert not result and "all-reduces sent" in result.failure
    result = check_accumulation(summed_losses)
    assert not result and "parameters after the step" in result.failure
    result = check_accumulation(never_waits)
    assert not result and "in flight" in result.failure

    def concatenated(model, optimizer, micro_batches):  # right parameters and all-reduces, but one big forward
        optimizer.zero_grad()
        x, y = (torch.cat(parts) for parts in zip(*micro_batches))
        nn.functional.mse_loss(model(x), y).backward()
        model.finish_gradient_sync()
        optimizer.step()

    def sync_first(model, optimizer, micro_batches):  # one all-reduce per bucket, but during the FIRST backward
        optimizer.zero_grad()
        for i, (x, y) in enumerate(micro_batches):
            with nullcontext() if i == 0 else model.no_sync():
                (nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()
            if i == 0:
                model.finish_gradient_sync()
        optimizer.step()

    result = check_accumulation(concatenated)
    assert not result and "forward passes" in result.failure
    result = check_accumulation(sync_first)  # on one rank its parameters are right: only the order tells
    assert not result and "before the last micro-batch's forward" in result.failure

    def one_backward(model, optimizer, micro_batches):  # a forward per micro-batch, all-reduces after the last,
        optimizer.zero_grad()  # right parameters, but one backward: every micro-batch's activations alive at once
        loss = sum(nn.functional.mse_loss(model(x), y) for x, y in micro_batches) / len(micro_batches)
        loss.backward()
        model.finish_gradient_sync()
        optimizer.step()

    def forwards_first(model, optimizer, micro_batches):  # a backward per micro-batch, after all the forwards
        optimizer.zero_grad()
        losses = [nn.functional.mse_loss(model(x), y) / len(micro_batches) for x, y in micro_batches]
        for i, loss in enumerate(losses):
            with model.no_sync() if i < len(losses) - 1 else nullcontext():
                loss.backward()
        model.finish_gradient_sync()
        optimizer.step()

    result = check_accumulation(one_backward)
    assert not result and "backward passes" in result.failure
    result = check_accumulation(forwards_first)
    assert not result and "before the next forward" in result.failure
    result = check_accumulation(
        lambda model, optimizer, micro_batches: accumulation_step(model, optimizer, micro_batches)
    )
    assert not result and "grader's own answer" in result.failure
