"""Lesson 05's new grader: the next-token loss, the lesson's "find the bug". A right answer passes; the bug itself,
other plausible wrong values, and right values computed the wrong way fail."""

import torch
import torch.nn.functional as F

from llmedu.checks.anatomy import check_next_token_loss
from llmedu.models.gpt import lm_loss


def shifted(logits, ids):
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def test_right_answers_pass():
    assert check_next_token_loss(shifted)

    def by_hand(logits, ids):  # log_softmax and a gather: the same loss, written out
        logp = logits[:, :-1].log_softmax(-1)  # (B, T-1, V)
        return -logp.gather(-1, ids[:, 1:, None]).mean()

    assert check_next_token_loss(by_hand)


def test_plausible_wrong_values_fail():
    V = lambda x: x.shape[-1]  # noqa: E731
    # the bug of the exercise: no shift
    assert not check_next_token_loss(lambda lg, ids: F.cross_entropy(lg.reshape(-1, V(lg)), ids.reshape(-1)))
    # shifted the wrong way
    assert not check_next_token_loss(
        lambda lg, ids: F.cross_entropy(lg[:, 1:].reshape(-1, V(lg)), ids[:, :-1].reshape(-1))
    )
    # a sum instead of a mean
    assert not check_next_token_loss(
        lambda lg, ids: F.cross_entropy(lg[:, :-1].reshape(-1, V(lg)), ids[:, 1:].reshape(-1), reduction="sum")
    )


def test_right_values_computed_the_wrong_way_fail():
    # the library's loss: right values, but the exercise asks for the shift written out
    assert not check_next_token_loss(lm_loss)

    def softmax_then_log(logits, ids):  # right on small logits; -inf on logits of a few hundred
        p = logits[:, :-1].softmax(-1)
        return -p.gather(-1, ids[:, 1:, None]).log().mean()

    assert not check_next_token_loss(softmax_then_log)
    # and the grader's case really is the one that breaks it: a right answer on the same inputs is finite
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(5)) * 200
    ids = torch.randint(0, 7, (2, 5))
    assert torch.isfinite(shifted(logits, ids))
