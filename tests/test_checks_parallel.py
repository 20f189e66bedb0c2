"""The graders of lessons 12 to 14 pass the right answer and fail a plausible wrong one."""

from llmedu.checks import parallel as checks
from llmedu.parallel.mesh import rank_of
from llmedu.parallel.pipeline_parallel import partition, theoretical_bubble


def _one_f_one_b(m, p, s, warmup=None):  # the learner's repair: p - s - 1 warm-up forwards
    w = min(p - s - 1 if warmup is None else warmup, m)
    actions = [("F", i) for i in range(w)]
    for i in range(m - w):
        actions += [("F", w + i), ("B", i)]
    return actions + [("B", i) for i in range(m - w, m)]


def _peak(name, m, p, s):
    return {"gpipe": m, "1f1b": min(m, p - s), "zb-h1": min(m, p)}[name]


def _row_split(x, w, n):
    return [xi @ wi for xi, wi in zip(x.chunk(n, -1), w.chunk(n, 0))]


RIGHT_AND_WRONG = {
    checks.check_row_parallel_matmul: (_row_split, [lambda x, w, n: [x @ w / n] * n]),
    checks.check_tp_all_reduce_bytes: (
        lambda b, t, d, n, s: 4 * n * b * t * d * s,
        [lambda b, t, d, n, s: 2 * n * b * t * d * s],  # forward only
    ),
    checks.check_bubble: (theoretical_bubble, [lambda p, m: (p - 1) / m]),
    checks.check_interleaved_bubble: (
        lambda p, m, v: (p - 1) / (v * m + p - 1),
        [lambda p, m, v: (p - 1) / (v * m), lambda p, m, v: (p - 1) / (m + p - 1)],  # of the ideal; v ignored
    ),
    checks.check_fixed_schedule: (
        _one_f_one_b,
        [
            lambda m, p, s: _one_f_one_b(m, p, s, warmup=s),  # the lesson's bug: the ranks wait on each other
            lambda m, p, s: [("F", i) for i in range(m)] + [("B", i) for i in range(m)],  # GPipe: too much memory
            lambda m, p, s: [a for i in range(m) for a in (("F", i), ("B", i))],  # naive: too slow
        ],
    ),
    checks.check_peak_in_flight: (
        _peak,
        [lambda name, m, p, s: _peak("1f1b" if name == "zb-h1" else name, m, p, s)],  # ZB-H1 as 1F1B
    ),
    checks.check_partition: (
        partition,
        [lambda c, n: [range(i * len(c) // n, (i + 1) * len(c) // n) for i in range(n)]],  # equal layer counts
    ),
    checks.check_rank_of: (rank_of, [lambda d, t, p, s: (d * s[1] + t) * s[2] + p]),  # pipeline fastest
}


def test_every_grader_passes_the_right_answer_and_fails_wrong_ones():
    for check, (right, wrongs) in RIGHT_AND_WRONG.items():
        assert check(right), check.__name__
        for wrong in wrongs:
            assert not check(wrong), check.__name__
