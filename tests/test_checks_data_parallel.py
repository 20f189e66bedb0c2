"""The graders of lesson 11 (llmedu.checks.data_parallel) pass the right answers and fail plausible wrong ones."""

from llmedu.checks.data_parallel import (
    bucket_comm_time,
    check_bucket_comm_time,
    check_exposed_communication,
    check_launch_order,
    exposed_communication,
    launch_order,
)
from llmedu.parallel.data_parallel import assign_buckets


def test_bucket_comm_time():
    assert check_bucket_comm_time(bucket_comm_time)

    def one_latency(sizes, cap, n, alpha, bw):  # forgets that every bucket pays its own alpha
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * sum(sizes) / bw if n > 1 else 0.0

    def whole_tensor(sizes, cap, n, alpha, bw):  # sends the whole bucket, not 2(N-1)/N of it
        return sum(2 * (n - 1) * alpha + sum(sizes[i] for i in b) / bw for b in assign_buckets(sizes, cap))

    assert not check_bucket_comm_time(one_latency)
    assert not check_bucket_comm_time(whole_tensor)
    # worked number: 16 MB in 8 MB buckets on 2 ranks at 10 GB/s, alpha 10 us: 2 x (20 us + 0.839 ms)
    assert abs(bucket_comm_time([4 * 2**20] * 4, 8 * 2**20, 2, 1e-5, 10e9) - 2 * (2e-5 + 8 * 2**20 / 10e9)) < 1e-12


def test_launch_order():
    assert check_launch_order(launch_order)

    def when_full(ready, buckets):  # launches each bucket as soon as it is full, whatever its turn
        bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket}
        filled, at = [0] * len(buckets), [0] * len(buckets)
        for count, i in enumerate(ready, start=1):
            filled[bucket_of[i]] += 1
            if filled[bucket_of[i]] == len(buckets[bucket_of[i]]):
                at[bucket_of[i]] = count
        return at

    assert not check_launch_order(when_full)
    assert launch_order([1, 0, 3, 2], [[3, 2], [1, 0]]) == [4, 4]  # bucket 1 waits for bucket 0


def test_exposed_communication():
    assert check_exposed_communication(exposed_communication)
    assert not check_exposed_communication(lambda compute, comm: comm[-1])  # ignores the queue on the link
    assert not check_exposed_communication(lambda compute, comm: max(0.0, sum(comm) - sum(compute)))  # perfect overlap
    assert exposed_communication([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]) == 4.0  # link busy 1..7, backward ends at 3
