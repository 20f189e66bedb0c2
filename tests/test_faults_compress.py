"""Faults in compression: a second head removal and GPTQ on non-finite numbers.

``remove_heads`` called twice used to skip a layer whose second mask kept as many heads as the first had
left (whichever they were) and to cut rows by the original head numbers out of already shrunk matrices;
GPTQ on inputs with a NaN failed inside ``torch.linalg.cholesky`` with no word of the inputs.
"""

import copy

import pytest
import torch

from llmedu.compress.gptq import PackedLinear, gptq_codes, gptq_quantize
from llmedu.compress.pruning import HeadGates, remove_heads

IDS = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(0))
MASK = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 3 + [0] * 4])


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=MASK).logits


FIRST = torch.tensor([[True, False, True, True], [True, True, True, False]])
SECOND = [  # same count left as after FIRST in layer 0 (the skipped case), fewer (rows cut by the wrong numbers)
    torch.tensor([[True, True, True, False], [True, True, True, False]]),
    torch.tensor([[False, True, True, True], [False, True, True, True]]),
]


@pytest.mark.parametrize("second", SECOND)
def test_a_second_removal_equals_removing_the_union_at_once(second, tiny_bert):
    twice = copy.deepcopy(tiny_bert)
    remove_heads(twice, FIRST)
    remove_heads(twice, second)
    once = copy.deepcopy(tiny_bert)
    remove_heads(once, FIRST & second)  # the union of the removed heads
    torch.testing.assert_close(logits(twice), logits(once), atol=0, rtol=0)  # the same matrices, cut alike
    for a, b in zip(twice.bert.encoder.layer, once.bert.encoder.layer):
        assert a.attention.self.kept_heads == b.attention.self.kept_heads
        assert a.attention.self.query.weight.shape == b.attention.self.query.weight.shape
    with HeadGates(tiny_bert) as gates:  # and both equal gating those heads to zero in the whole model
        gates.gates = (FIRST & second).float()
        torch.testing.assert_close(logits(twice), logits(tiny_bert), atol=1e-6, rtol=1e-5)


def test_a_second_removal_that_would_empty_a_layer_is_refused_before_any_cut(tiny_bert):
    model = copy.deepcopy(tiny_bert)
    remove_heads(model, torch.tensor([[True, False, False, False], [True, True, True, True]]))
    before = logits(model)
    with pytest.raises(ValueError, match=r"every layer must keep at least one head; layers \[0\] keep none"):
        remove_heads(model, torch.tensor([[False, True, True, True], [True, False, True, True]]))
    torch.testing.assert_close(logits(model), before, atol=0, rtol=0)  # layer 1 was not cut either


def test_heads_cut_by_other_code_are_refused(tiny_bert):
    """Without a record of which heads a shrunk layer still has, the original numbers cannot be mapped."""
    model = copy.deepcopy(tiny_bert)
    remove_heads(model, FIRST)
    del model.bert.encoder.layer[0].attention.self.kept_heads
    with pytest.raises(ValueError, match="layer 0 has 3 of 4 heads but no record of which"):
        remove_heads(model, SECOND[0])


# -- GPTQ on non-finite numbers ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gptq_names_non_finite_calibration_rows(bad):
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0))  # (batch, seq, d_in): 32 rows
    x[1, 3, 5] = bad  # row 19 of the flattened inputs
    x[1, 9, 0] = bad
    weight = torch.randn(4, 8)
    with pytest.raises(
        ValueError, match=r"calibration inputs x.* NaN or inf in 2 of its 32 rows \(the first is row 19\)"
    ):
        gptq_codes(weight, x)
    with pytest.raises(ValueError, match="calibration inputs x"):
        PackedLinear.gptq(torch.nn.Linear(8, 4), x)


def test_gptq_names_a_non_finite_weight():
    weight = torch.randn(4, 8)
    weight[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"the weight .* NaN or inf in 1 of its 4 rows \(the first is row 2\)"):
        gptq_quantize(weight, torch.randn(32, 8))
