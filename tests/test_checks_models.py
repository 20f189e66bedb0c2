"""The graders of lesson 05 pass the right answers and fail typical mistakes."""

from llmedu.checks.models import check_gpt2_parameters


def gpt2_parameters(V, T, d, L, f, tied):
    block = 4 * d * d + 4 * d + 2 * d * f + f + d + 2 * 2 * d  # attention, FFN, two LayerNorms
    return V * d + T * d + L * block + 2 * d + (0 if tied else V * d)


def test_gpt2_parameters_grader_passes_the_right_answer():
    assert check_gpt2_parameters(gpt2_parameters)


def test_gpt2_parameters_grader_fails_typical_mistakes(capsys):
    assert not check_gpt2_parameters(lambda V, T, d, L, f, tied: 12 * L * d * d)  # the blocks' matrices only
    assert not check_gpt2_parameters(lambda V, T, d, L, f, tied: gpt2_parameters(V, T, d, L, f, True))  # always tied
    assert not check_gpt2_parameters(
        lambda V, T, d, L, f, tied: gpt2_parameters(V, T, d, L, f, tied) - 2 * d
    )  # no final norm
    assert "FAIL check_gpt2_parameters" in capsys.readouterr().out
