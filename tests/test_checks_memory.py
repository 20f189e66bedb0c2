"""The graders of lesson 06 pass the right answers and fail typical mistakes."""

from llmedu.checks.memory import check_attention_crossover, check_zero_bytes
from llmedu.memory.estimate import zero_bytes_per_rank


def crossover(h, a, v, dropout):
    d = int(dropout)
    return (16 * v + 2 * d) * h / ((v + d * (1 + v)) * a)


def zero_bytes(n, w, stage):
    """The paper's formulas, by hand: 2Ψ weights, 2Ψ gradients, 12Ψ optimizer state, the last `stage` of them /N."""
    return 2 * n / (w if stage >= 3 else 1) + 2 * n / (w if stage >= 2 else 1) + 12 * n / (w if stage >= 1 else 1)


def test_zero_bytes_grader():
    assert check_zero_bytes(zero_bytes)
    assert not check_zero_bytes(lambda n, w, stage: 16 * n / w)  # every stage sharded like stage 3
    # integer division of the sharded parts: wrong by a few bytes where N does not divide the parameters
    assert not check_zero_bytes(
        lambda n, w, s: 2 * (n // w if s >= 3 else n) + 2 * (n // w if s >= 2 else n) + 12 * n // (w if s >= 1 else 1)
    )


def test_zero_bytes_grader_refuses_asking_the_library(capsys):
    """The right numbers, read off llmedu.memory.estimate while the answer runs, fail: whatever name it has."""
    assert not check_zero_bytes(lambda n, w, stage: sum(zero_bytes_per_rank(n, w, stage).values()))
    assert "called llmedu.memory.estimate.zero_bytes_per_rank" in capsys.readouterr().out
    from llmedu.memory import estimate

    assert not check_zero_bytes(lambda n, w, stage: sum(estimate.zero_bytes_per_rank(n, w, stage).values()))


def test_crossover_grader_passes_the_right_answer():
    assert check_attention_crossover(crossover)


def test_crossover_grader_fails_typical_mistakes(capsys):
    assert not check_attention_crossover(lambda h, a, v, d: 34 * h / (5 * a))  # the 16-bit answer everywhere
    assert not check_attention_crossover(lambda h, a, v, d: (34 * h / (5 * a)) ** 0.5)  # treats it as s^2 vs 1
    assert not check_attention_crossover(lambda h, a, v, d: crossover(h, a, v, not d))  # dropout terms swapped
    assert "FAIL check_attention_crossover" in capsys.readouterr().out


def test_zero_bytes_grader_accepts_shards_padded_to_equal_size():
    """DeepSpeed and FSDP1 pad a flat buffer to N shards of ceil(Ψ/N) elements: that count passes, as the formula's does."""

    def padded(n, w, stage):
        s = -(-n // w)  # ceil(Ψ/N)
        return 2 * (s if stage >= 3 else n) + 2 * (s if stage >= 2 else n) + 12 * (s if stage >= 1 else n)

    assert padded(124_439_808, 7, 3) != sum(zero_bytes_per_rank(124_439_808, 7, 3).values())  # a case that differs
    assert check_zero_bytes(padded)

    # the floor instead of the ceiling drops the tail elements: still a failure
    def floor(n, w, stage):
        s = n // w
        return 2 * (s if stage >= 3 else n) + 2 * (s if stage >= 2 else n) + 12 * (s if stage >= 1 else n)

    assert not check_zero_bytes(floor)
