"""Graders for the memory lesson (06): the bytes of model states per rank under ZeRO.

check_zero_bytes(fn)   fn(n_params, world_size, stage) -> bytes of model states on one rank,
                       mixed precision with Adam (K = 12), ZeRO stage 0 (plain data parallel) to 3;
                       a sharded part may be Ψ/N (the paper's formula) or ceil(Ψ/N) elements (a flat buffer
                       padded to N equal shards, as DeepSpeed and FSDP1 do): both are accepted; an answer
                       that calls ``llmedu.memory.estimate.zero_bytes_per_rank`` while it runs fails
check_attention_crossover(fn)
                       fn(hidden, n_heads, bytes_per_value, dropout) -> the sequence length s at which the
                       attention term of Korthikanti et al.'s activation count (the one in a·s²·b) equals
                       the term linear in s·b·h
"""

from __future__ import annotations

import sys

from llmedu.checks.core import CheckResult, Grader
from llmedu.memory.estimate import activation_bytes_per_layer, zero_bytes_per_rank

__all__ = ["check_zero_bytes", "check_attention_crossover"]

# (Ψ, N): a round number, ZeRO's Figure 1 (7.5B on 64 GPUs), and a Ψ that N does not divide.
_CASES = [(1_000_000, 8), (7_500_000_000, 64), (124_439_808, 7)]  # 124,439,808 = 7 x 17,777,115 + 3


def check_zero_bytes(fn) -> CheckResult:
    """Grade ``fn(n_params, world_size, stage)`` against (2+2+K)Ψ, 2Ψ+2Ψ+KΨ/N, 2Ψ+(2+K)Ψ/N, (2+2+K)Ψ/N.

    Where N does not divide Ψ, each sharded part may hold Ψ/N elements (the formula) or ceil(Ψ/N) (the
    buffer padded to N equal shards); anything else, a floor or a rounding of the bytes, fails.
    """
    g = Grader("check_zero_bytes")
    for n_params, world_size in _CASES:
        padded = -(-n_params // world_size) * world_size  # the padded buffer: N shards of ceil(Ψ/N)
        for stage in (0, 1, 2, 3):
            formula = sum(zero_bytes_per_rank(n_params, world_size, stage).values())
            shards = zero_bytes_per_rank(padded, world_size, stage)  # sharded parts: ceil(Ψ/N) each
            whole = zero_bytes_per_rank(n_params, 1, 0)  # replicated parts: Ψ each
            sharded = {"optimizer": stage >= 1, "gradients": stage >= 2, "parameters": stage >= 3}
            with_padding = sum(shards[k] if sharded[k] else whole[k] for k in whole)
            where = f"Ψ={n_params:,} parameters on N={world_size} ranks, stage {stage}"
            got = _without(zero_bytes_per_rank, g, fn, n_params, world_size, stage)
            g.expect(
                where,
                got is not _ASKED,
                "your function called llmedu.memory.estimate.zero_bytes_per_rank, the grader's own answer: "
                "count the bytes from the formulas yourself",
            )
            if isinstance(got, (int, float)) and abs(got - with_padding) <= 1e-9 * with_padding:
                g.expect(where, True)  # the padded count, as DeepSpeed keeps it
            else:
                g.compare(where, got, formula, rtol=1e-9)
    return g.result()


_ASKED = object()  # what _without returns when the answer called the reference


def _without(reference, g: Grader, fn, *args):
    """``g.call(fn, *args)``, or ``_ASKED`` if ``fn`` called ``reference`` while it ran (however it was imported)."""
    called = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code is reference.__code__:
            called.append(True)

    previous = sys.getprofile()
    sys.setprofile(watch)
    try:
        got = g.call(fn, *args)
    finally:
        sys.setprofile(previous)
    return _ASKED if called else got


# (h, a, bytes per value, dropout): GPT-3 175B and Llama-7B shapes in the paper's 16-bit setting, and two
# settings the lesson's formula line does not show (fp32 without dropout, fp32 with dropout).
_CROSSOVER_CASES = [
    (12288, 96, 2, True),
    (4096, 32, 2, True),
    (4096, 32, 4, False),
    (768, 12, 4, True),
    (64, 4, 2, False),
]


def check_attention_crossover(fn) -> CheckResult:
    """Grade ``fn(hidden, n_heads, bytes_per_value, dropout)``: at the returned s the two terms are equal.

    The reference is not a second copy of the answer: it reads both terms off
    ``activation_bytes_per_layer`` itself (the bytes at s = 1 minus the quadratic part, and the
    growth of the quadratic part), so a wrong coefficient anywhere fails.
    """
    g = Grader("check_attention_crossover")
    for h, a, v, dropout in _CROSSOVER_CASES:
        # bytes(s) = L*s + Q*s^2 for b = 1: two evaluations give L and Q exactly
        one, two = (activation_bytes_per_layer(s, 1, h, a, bytes_per_value=v, dropout=dropout) for s in (1, 2))
        quadratic = (two - 2 * one) / 2  # Q
        linear = one - quadratic  # L
        expected = linear / quadratic  # L*s = Q*s^2  <=>  s = L/Q
        got = g.call(fn, h, a, v, dropout)
        g.compare(f"h={h}, a={a}, {v}-byte values, dropout={dropout}", got, expected, rtol=1e-6)
    return g.result()
