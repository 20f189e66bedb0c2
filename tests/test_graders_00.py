"""Lesson 00's exercise graders: each fails a plausible wrong value and a right value computed the wrong way.

The exercises: the roofline's bound on decoding tokens/s (both roofs), the smallest compute-bound batch
(activations' bytes counted, any element size), and a read-bandwidth probe with its bugs fixed (graded on
the ops it runs, not on the clock, so these tests do not depend on the machine's load).
"""

import math
import time

import torch

from llmedu import hardware as hw
from llmedu.checks import hardware as checks

SMALL = 8 * 2**20  # a probe buffer for these tests; the lesson's grader uses 4x the last-level cache


# -- exercise 1: decoding tokens/s ---------------------------------------------------------------
def decode_right(n_params, bytes_per_param, batch, peak, bandwidth):
    seconds = max(2 * n_params * batch / peak, n_params * bytes_per_param / bandwidth)
    return batch / seconds


def test_decode_right_answer_passes():
    assert checks.check_decode_throughput(decode_right)


def test_decode_memory_roof_alone_is_right_at_batch_1_and_fails_at_a_large_batch():
    res = checks.check_decode_throughput(lambda n, s, b, peak, bw: b * bw / (n * s))
    assert not res and res.cases >= 2  # passed the batch-1 case, then
    assert "batch 1024" in res.failure and "the memory roof alone" in res.failure


def test_decode_compute_roof_alone_fails_at_batch_1():
    res = checks.check_decode_throughput(lambda n, s, b, peak, bw: peak / (2 * n))
    assert not res and "batch 1:" in res.failure and "the compute roof alone" in res.failure


def test_decode_steps_per_second_instead_of_tokens_fails():
    res = checks.check_decode_throughput(lambda n, s, b, peak, bw: decode_right(n, s, b, peak, bw) / b)
    assert not res and "the steps per second" in res.failure


def test_decode_forgetting_the_bytes_per_parameter_fails():
    res = checks.check_decode_throughput(lambda n, s, b, peak, bw: decode_right(n, 1, b, peak, bw))
    assert not res and "7B in bf16 on an H100, batch 1" in res.failure


# -- exercise 2: the smallest compute-bound batch --------------------------------------------------
def batch_by_search(k, n, peak, bw, s):
    b = 1
    while 2 * b * k * n / ((b * k + k * n + b * n) * s) < peak / bw:
        b += 1
    return b


def test_batch_right_answer_passes():
    assert checks.check_compute_bound_batch(batch_by_search)


def test_batch_the_ridge_point_itself_fails():
    res = checks.check_compute_bound_batch(lambda k, n, peak, bw, s: math.ceil(peak / bw))
    assert not res and "the ridge point itself" in res.failure


def test_batch_with_two_bytes_hard_wired_is_right_in_bf16_and_fails_in_fp32():
    res = checks.check_compute_bound_batch(lambda k, n, peak, bw, s: batch_by_search(k, n, peak, bw, 2))
    assert not res and res.cases == 4 and "a CPU at 150 GFLOP/s" in res.failure and "4-byte" in res.failure


def test_batch_weights_only_fails():  # ignores the activations' bytes: b = ridge * s / 2
    res = checks.check_compute_bound_batch(lambda k, n, peak, bw, s: math.ceil(peak / bw * s / 2))
    assert not res and "H100" in res.failure


# -- exercise 3: the read-bandwidth probe ------------------------------------------------------------
def timed(kernel, repeats=5, warmup=1):
    for _ in range(warmup):
        kernel()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernel()
        seconds.append(time.perf_counter() - start)
    return seconds


def probe_right(nbytes):
    x = torch.ones(nbytes // 4)
    return nbytes, timed(x.sum)


def test_probe_right_answer_passes():
    res = checks.check_read_probe(probe_right, SMALL)
    assert res, res.failure


def test_probe_right_with_another_initialisation_passes():
    def probe(nbytes):
        x = torch.empty(nbytes // 4)
        x.uniform_()  # written in place: the pages are touched
        return nbytes, timed(lambda: torch.sum(x))

    assert checks.check_read_probe(probe, SMALL)


def test_probe_as_given_in_the_lesson_fails_on_the_untouched_buffer():
    def buggy(nbytes):
        x = torch.empty(nbytes // 4)
        return 2 * nbytes, timed(x.sum, warmup=0)

    res = checks.check_read_probe(buggy, SMALL)
    assert not res and "nothing has written (torch.empty)" in res.failure


def test_probe_reading_an_untouched_buffer_at_a_freed_buffers_address_still_fails():
    def buggy(nbytes):
        written = torch.ones(nbytes // 4)
        del written  # the next allocation may reuse its address, but its pages are new
        x = torch.empty(nbytes // 4)
        return nbytes, timed(x.sum)

    res = checks.check_read_probe(buggy, SMALL)
    assert not res and "nothing has written" in res.failure


def test_probe_counting_twice_the_bytes_fails():
    res = checks.check_read_probe(lambda nbytes: (2 * nbytes, probe_right(nbytes)[1]), SMALL)
    assert not res and "2x the buffer" in res.failure


def test_probe_that_copies_fails():
    def copies(nbytes):
        x = torch.ones(nbytes // 4)
        return nbytes, timed(x.clone)

    res = checks.check_read_probe(copies, SMALL)
    assert not res and "measures a copy" in res.failure


def test_probe_without_warm_up_fails():
    def cold(nbytes):
        x = torch.ones(nbytes // 4)
        return nbytes, timed(x.sum, warmup=0)

    res = checks.check_read_probe(cold, SMALL)
    assert not res and "no warm-up" in res.failure


def test_probe_on_a_buffer_that_fits_in_cache_fails():
    def small(nbytes):
        x = torch.ones(2**16)  # 256 KiB, whatever was asked
        return nbytes, timed(x.sum)

    res = checks.check_read_probe(small, SMALL)
    assert not res and "no op read a buffer" in res.failure


def test_probe_with_made_up_seconds_fails():
    def invented(nbytes):
        torch.ones(nbytes // 4).sum()
        x = torch.ones(nbytes // 4)
        timed(x.sum)
        return nbytes, [10.0] * 5

    res = checks.check_read_probe(invented, SMALL)
    assert not res and "more than the call's" in res.failure


def test_probe_that_calls_the_library_gives_the_right_numbers_and_fails():
    def borrowed(nbytes):  # a right value computed the wrong way: llmedu's probe, not the learner's
        m = hw.measure_read_bandwidth(nbytes, device="cpu", repeats=5)
        return int(m.work), list(m.seconds)

    res = checks.check_read_probe(borrowed, SMALL)
    assert not res and "llmedu's own probe was called" in res.failure


def test_probe_that_times_with_the_librarys_rounds_fails():
    def rounds(nbytes):  # the library's batch timer, reached through measure_in_rounds rather than measure_*()
        x = torch.ones(nbytes // 4)
        b = hw.benchmark("sum", x.sum, nbytes, "B/s", device="cpu")
        return nbytes, list(hw.measure_in_rounds({"sum": b}, rounds=5)["sum"].seconds)

    res = checks.check_read_probe(rounds, SMALL)
    assert not res and "llmedu's own probe was called" in res.failure


def test_probe_grader_default_size_outgrows_the_last_level_cache():
    llc = hw.last_level_cache_bytes()
    recorded = []
    checks.check_read_probe(lambda nbytes: recorded.append(nbytes) or probe_right(nbytes))
    assert recorded and recorded[0] >= max(4 * (llc or 0), 64 * 2**20) - 4


def test_probe_on_a_buffer_of_nbytes_elements_reports_a_quarter_of_what_it_reads_and_fails():
    def elements_for_bytes(nbytes):  # torch.ones(nbytes) is nbytes fp32 elements: 4 * nbytes bytes
        x = torch.ones(nbytes)
        return nbytes, timed(x.sum)

    res = checks.check_read_probe(elements_for_bytes, SMALL)
    assert not res and f"reads a buffer of {4 * SMALL:,} bytes" in res.failure and "4x" in res.failure


def test_probe_in_fp64_reporting_the_fp32_bytes_fails_and_counting_its_own_bytes_passes():
    def fp64(nbytes):  # nbytes // 4 elements of 8 bytes: 2 * nbytes read per call
        x = torch.ones(nbytes // 4, dtype=torch.float64)
        return nbytes, timed(x.sum)

    res = checks.check_read_probe(fp64, SMALL)
    assert not res and f"reads a buffer of {2 * SMALL:,} bytes" in res.failure

    def fp64_counted(nbytes):
        x = torch.ones(nbytes // 8, dtype=torch.float64)
        return x.numel() * x.element_size(), timed(x.sum)

    assert checks.check_read_probe(fp64_counted, SMALL)


# -- the five wrong methods the recorder's own timings and byte ranges catch ----------------------------
def test_probe_timing_two_reads_per_call_and_counting_one_fails():
    def twice(nbytes):
        x = torch.ones(nbytes // 4)
        return nbytes, timed(lambda: x.sum() + x.sum(), warmup=0)  # 2 reads per timing, 10 reads for 5 timings

    res = checks.check_read_probe(twice, SMALL)
    assert not res and "more than one read" in res.failure, res.failure


def test_probe_reading_untimed_then_timing_a_tiny_op_fails():
    def elsewhere(nbytes):
        x = torch.ones(nbytes // 4)
        for _ in range(6):
            x.sum()  # the big reads, untimed
        return nbytes, timed(torch.ones(16).sum)

    res = checks.check_read_probe(elsewhere, SMALL)
    assert not res and "do not time the sum" in res.failure, res.failure


def test_probe_allocating_and_filling_inside_the_timed_region_fails():
    def fills(nbytes):
        seconds = []
        for _ in range(6):
            start = time.perf_counter()
            x = torch.ones(nbytes // 4)  # allocated and written inside the timing
            x.sum()
            seconds.append(time.perf_counter() - start)
        return nbytes, seconds[1:]

    res = checks.check_read_probe(fills, SMALL)
    assert not res and "written again (allocated or filled) before each sum" in res.failure, res.failure


def test_probe_filling_a_preallocated_buffer_inside_the_timed_region_fails():
    def refills(nbytes):
        x = torch.empty(nbytes // 4)
        return nbytes, timed(lambda: (x.fill_(1.0), x.sum()))

    res = checks.check_read_probe(refills, SMALL)
    assert not res and "written again" in res.failure, res.failure


def test_probe_on_a_buffer_with_only_its_first_bytes_written_fails():
    def first_bytes(nbytes):
        x = torch.empty(nbytes // 4)
        x[:1024].fill_(1.0)  # one page written: the rest still maps the shared zero page
        return nbytes, timed(x.sum)

    res = checks.check_read_probe(first_bytes, SMALL)
    assert not res and "nothing has written" in res.failure and f"{SMALL - 4096:,} of its {SMALL:,}" in res.failure


def test_probe_on_a_strided_view_counting_its_elements_fails():
    def strided(nbytes):
        b = torch.ones(nbytes // 2)
        view = b[::2]  # nbytes // 4 elements, spread over 2 * nbytes: every cache line of b is read
        return view.numel() * 4, timed(view.sum)

    res = checks.check_read_probe(strided, SMALL)
    assert not res and "strided view" in res.failure, res.failure


def test_probe_timing_batches_of_calls_per_repeat_passes():
    def batched(nbytes):  # seconds per call from batches of 4 calls, as llmedu's _time_calls does
        x = torch.ones(nbytes // 4)
        x.sum()
        return nbytes, [t / 4 for t in timed(lambda: [x.sum() for _ in range(4)], warmup=0)]

    res = checks.check_read_probe(batched, SMALL)
    assert res, res.failure


# -- exercise 3's prediction: the factor of the gap each fault explains ---------------------------------
# lines of the lesson's buggy_read_probe: 2 torch.empty, 3-7 the timing loop (no warm-up), 8 return 2 * nbytes
def test_gap_prediction_right_passes():
    assert checks.check_gap_prediction({2: 4.2, 5: 1.05, 8: 2.0}, zero_page=4.0)


def test_gap_prediction_with_the_count_explaining_nothing_fails():
    res = checks.check_gap_prediction({2: 8.0, 4: 1.0, 8: 1.0}, zero_page=4.0)
    assert not res and "the bytes counted twice" in res.failure


def test_gap_prediction_of_a_zero_page_factor_far_from_the_measured_one_fails():
    res = checks.check_gap_prediction({2: 20.0, 4: 1.0, 8: 2.0}, zero_page=4.0)
    assert not res and "the grader measures 4 " in res.failure


def test_gap_prediction_that_the_warm_up_explains_a_factor_fails():
    res = checks.check_gap_prediction({2: 4.0, 4: 3.0, 8: 2.0}, zero_page=4.0)
    assert not res and "does not move a median" in res.failure


def test_gap_prediction_missing_a_fault_or_naming_a_clean_line_fails():
    res = checks.check_gap_prediction({2: 4.0, 8: 2.0}, zero_page=4.0)
    assert not res and "the probe has 3 faults; you named 2" in res.failure
    res = checks.check_gap_prediction({1: 4.0, 2: 4.0, 5: 1.0, 8: 2.0}, zero_page=4.0)
    assert not res and "line 1: it holds none of the faults" in res.failure
    res = checks.check_gap_prediction({2: 4.0, 4: 1.0, 5: 1.0, 8: 2.0}, zero_page=4.0)
    assert not res and "two lines name one fault" in res.failure


def test_gap_prediction_measures_the_zero_page_factor_itself():
    res = checks.check_gap_prediction({2: 1e6, 5: 1.0, 8: 2.0}, SMALL)  # no buffer reads a million times faster
    assert not res and f"on {SMALL / 2**20:g} MiB" in res.failure
