"""Graders of lesson 13 (pipeline parallelism): each passes a right answer, and fails a plausible wrong value
and a right value reached the wrong way (asking the simulator, or a rule that holds only in some cases)."""

from llmedu.checks.pipeline import check_micro_batches, check_slow_stage_bubble
from llmedu.parallel.pipeline_schedules import bubble_fraction, schedule, simulate


def by_hand(p, m, k, s):
    """GPipe: the slow stage sets the pace; a step is (m-1) of its micro-batches plus one pass through all."""
    step = 3 * ((m - 1) * s + (p - 1) + s)  # in units of t_f (t_b = 2 t_f)
    busy = 3 * m * (p - 1 + s)  # every stage's work, added up
    return 1 - busy / (p * step)


def test_slow_stage_bubble_grader():
    assert check_slow_stage_bubble(by_hand)
    # plausible wrong value: the equal-stage formula, as if one slow stage changed nothing
    assert not check_slow_stage_bubble(lambda p, m, k, s: (p - 1) / (m + p - 1))
    # plausible wrong value: every stage as slow as the slowest (the bubble share would not move)
    assert not check_slow_stage_bubble(lambda p, m, k, s: (p - 1) * s / ((m + p - 1) * s))

    def simulated(p, m, k, s):  # the right value, asked of the library's simulator
        times = [{"F": s, "B": 2 * s} if r == k else {} for r in range(p)]
        return bubble_fraction(simulate([schedule("gpipe", m, p, r) for r in range(p)], times))

    result = check_slow_stage_bubble(simulated)
    assert not result and "called" in result.failure


def fits(batch, p, memory):
    return [m for m in range(1, batch + 1) if batch % m == 0 and min(m, p) * batch // m <= memory]


def chosen(batch, p, fixed, per_sample, memory):
    """The step (m + p - 1) x 3 (fixed + per_sample x batch/m) over the m whose stage 0 fits."""
    options = fits(batch, p, memory)
    return min(options, key=lambda m: (m + p - 1) * (fixed + per_sample * batch / m)) if options else 0


def test_micro_batches_grader():
    assert check_micro_batches(chosen)
    # plausible wrong value: as many micro-batches as stages
    assert not check_micro_batches(lambda batch, p, fixed, per_sample, memory: p)
    # the bubble alone: the most micro-batches that fit (right where there is no fixed cost)
    assert not check_micro_batches(lambda batch, p, fixed, per_sample, memory: max(fits(batch, p, memory) or [0]))
    # the step alone, the memory forgotten (right wherever the memory does not bind)
    assert not check_micro_batches(
        lambda batch, p, fixed, per_sample, memory: chosen(batch, p, fixed, per_sample, 10**9)
    )
    # GPipe's memory (all m micro-batches held: the whole batch) instead of 1F1B's
    assert not check_micro_batches(
        lambda batch, p, fixed, per_sample, memory: chosen(
            batch, p, fixed, per_sample, memory if batch <= memory else 0
        )
    )


def zb_h1_by_hand(m, p, s, a, w):
    """1F1B's full micro-batches on rank s, min(p - s, m), plus the s whose W it keeps back, as far as the
    micro-batches left over reach: at that moment the next I has not yet turned a full one into a waiting one."""
    full = min(p - s, m)
    return full * a + min(s, m - full) * w


def test_zb_h1_peak_grader():
    from llmedu.checks.pipeline import check_zb_h1_peak, zb_h1_peak

    assert check_zb_h1_peak(zb_h1_by_hand)
    # plausible wrong value: the text's count, every rank p micro-batches, all of them whole
    assert not check_zb_h1_peak(lambda m, p, s, a, w: min(p, m) * a)
    # plausible wrong value: 1F1B's memory, the kept-back W forgotten
    assert not check_zb_h1_peak(lambda m, p, s, a, w: min(p - s, m) * a)
    # plausible wrong value: GPipe's, every micro-batch held
    assert not check_zb_h1_peak(lambda m, p, s, a, w: m * a)
    # right wherever m >= p, wrong where fewer micro-batches than stages leave less to keep back
    assert not check_zb_h1_peak(lambda m, p, s, a, w: min(p - s, m) * a + s * w)
    # the wrong cap: s waiting ones as long as m >= s, as if the full ones were not among the m
    assert not check_zb_h1_peak(lambda m, p, s, a, w: min(p - s, m) * a + min(s, m) * w)
    # the right value, counted from the library's schedule
    result = check_zb_h1_peak(lambda m, p, s, a, w: zb_h1_peak(m, p, s, a, w))
    assert not result and "called" in result.failure


def late_by_hand(p, m, t_f, c):
    """GPipe's overlapped step, plus c for each of the m-1 gradients that reach rank p-2 after its receive
    was posted with its own send (no such rank-pair tie at p=2)."""
    return 3 * (m + p - 1) * t_f + 2 * (p - 1) * c + ((m - 1) * c if p > 2 else 0)


def test_late_receive_step_grader():
    from llmedu.checks.pipeline import check_late_receive_step
    from llmedu.parallel.pipeline_study import predicted_step

    assert check_late_receive_step(late_by_hand)
    # plausible wrong value: the model, as if posting late cost nothing
    assert not check_late_receive_step(lambda p, m, t_f, c: 3 * (m + p - 1) * t_f + 2 * (p - 1) * c)
    # plausible wrong value: late at p=2 too (there no rank sends a gradient while its successor sends one)
    assert not check_late_receive_step(lambda p, m, t_f, c: 3 * (m + p - 1) * t_f + 2 * (p - 1) * c + (m - 1) * c)
    # plausible wrong value: every one of the m gradients late
    assert not check_late_receive_step(
        lambda p, m, t_f, c: 3 * (m + p - 1) * t_f + 2 * (p - 1) * c + (m * c if p > 2 else 0)
    )
    # the right value, the model asked of the library's simulator and the late receives added
    result = check_late_receive_step(
        lambda p, m, t_f, c: predicted_step("gpipe", p, m, t_f, latency=c) + ((m - 1) * c if p > 2 else 0)
    )
    assert not result and "called" in result.failure
