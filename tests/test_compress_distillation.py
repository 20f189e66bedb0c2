"""The distillation losses equal a hand computation and torch's own losses; the student is the teacher's layers."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from llmedu.compress.distillation import (
    DistillationLoss,
    attention_transfer_loss,
    hidden_state_loss,
    make_student,
    soft_target_loss,
    uniform_layer_map,
)

IDS = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(0))
MASK = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 3 + [0] * 4])
BATCH = {"input_ids": IDS, "attention_mask": MASK, "labels": torch.tensor([0, 1, 1])}


def test_soft_target_loss_equals_a_hand_computation():
    student, teacher, T = [[1.0, 2.0], [0.5, -1.0]], [[3.0, 0.0], [0.0, 0.0]], 2.0
    expected = 0.0
    for s_row, t_row in zip(student, teacher):  # T^2 sum_c p_c log(p_c / q_c), averaged over rows
        p = [math.exp(z / T) / sum(math.exp(y / T) for y in t_row) for z in t_row]
        q = [math.exp(z / T) / sum(math.exp(y / T) for y in s_row) for z in s_row]
        expected += T**2 * sum(pc * math.log(pc / qc) for pc, qc in zip(p, q)) / len(student)
    got = soft_target_loss(torch.tensor(student), torch.tensor(teacher), T)
    assert got.item() == pytest.approx(expected, rel=1e-6)  # fp32 against float64 arithmetic


@pytest.mark.parametrize("T", [1.0, 2.0, 4.0])
def test_soft_target_loss_equals_torch_kl_div(T):
    g = torch.Generator().manual_seed(int(T))
    s, t = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    reference = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), reduction="batchmean", log_target=True)
    torch.testing.assert_close(soft_target_loss(s, t, T), T**2 * reference, atol=1e-6, rtol=1e-5)  # fp32 ulps
    assert soft_target_loss(t, t, T).abs().item() < 1e-6  # a student equal to its teacher: no loss


def test_soft_target_loss_sends_no_gradient_to_the_teacher():
    s, t = torch.randn(4, 2, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    soft_target_loss(s, t).backward()
    assert s.grad is not None and t.grad is None


def test_hidden_state_losses_equal_torch_losses_on_the_real_tokens():
    g = torch.Generator().manual_seed(2)
    hs, ht = torch.randn(3, 7, 5, generator=g), torch.randn(3, 7, 5, generator=g)
    real = MASK.bool()
    cosine = nn.CosineEmbeddingLoss()(hs[real], ht[real], torch.ones(int(real.sum())))  # DistilBERT's L_cos
    torch.testing.assert_close(hidden_state_loss(hs, ht, MASK), cosine, atol=1e-6, rtol=1e-5)
    mse = F.mse_loss(hs[real], ht[real])
    torch.testing.assert_close(hidden_state_loss(hs, ht, MASK, kind="mse"), mse, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        hidden_state_loss(hs, ht), nn.CosineEmbeddingLoss()(hs.flatten(0, 1), ht.flatten(0, 1), torch.ones(21))
    )


def test_attention_transfer_is_kl_per_row_over_real_queries():
    g = torch.Generator().manual_seed(3)
    sa = torch.randn(3, 2, 7, 7, generator=g).softmax(-1)  # (B, H, T, T)
    ta = torch.randn(3, 2, 7, 7, generator=g).softmax(-1)
    rows = F.kl_div(sa.log(), ta, reduction="none").sum(-1).mean(1)  # (B, T)
    expected = rows[MASK.bool()].mean()
    torch.testing.assert_close(attention_transfer_loss(sa, ta, MASK), expected, atol=1e-6, rtol=1e-5)


def test_layer_map_and_student_layers(tiny_bert):
    assert uniform_layer_map(3, 6) == {1: 2, 2: 4, 3: 6}
    whole = make_student(tiny_bert, [0, 1])
    with torch.no_grad():  # keeping every layer is the teacher itself
        assert torch.equal(whole(input_ids=IDS).logits, tiny_bert(input_ids=IDS).logits)
    student = make_student(tiny_bert)  # every other layer: layer 0 of 2
    assert len(student.bert.encoder.layer) == 1 and student.config.num_hidden_layers == 1
    for a, b in zip(student.bert.encoder.layer[0].parameters(), tiny_bert.bert.encoder.layer[0].parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()  # a copy, not a share
    assert len(tiny_bert.bert.encoder.layer) == 2  # the teacher is untouched


def test_distillation_loss_is_the_weighted_sum_of_its_parts(tiny_bert):
    teacher = tiny_bert
    student = make_student(teacher)
    loss_fn = DistillationLoss(teacher, T=3.0, alpha_soft=0.5, alpha_hidden=2.0, alpha_ce=0.25)
    total = loss_fn(student, BATCH)
    with torch.no_grad():
        t = teacher(input_ids=IDS, attention_mask=MASK, output_hidden_states=True)
        s = student(input_ids=IDS, attention_mask=MASK, output_hidden_states=True)
    by_hand = (
        0.5 * soft_target_loss(s.logits, t.logits, 3.0)
        + 2.0 * hidden_state_loss(s.hidden_states[1], t.hidden_states[2], MASK)  # student layer 1 <-> teacher 2
        + 0.25 * F.cross_entropy(s.logits, BATCH["labels"])
    )
    torch.testing.assert_close(total.detach(), by_hand, atol=1e-6, rtol=1e-5)
    assert set(loss_fn.last) == {"soft", "hidden", "ce"}


def test_attention_transfer_option_runs_with_eager_attention(tiny_bert):
    teacher = copy.deepcopy(tiny_bert)
    teacher.config._attn_implementation = "eager"  # fused attention returns no weights
    student = make_student(teacher)
    loss = DistillationLoss(teacher, alpha_attn=1.0)(student, BATCH)
    loss.backward()
    assert loss.item() > 0 and student.bert.encoder.layer[0].attention.self.query.weight.grad is not None


def test_errors(tiny_bert):
    with pytest.raises(ValueError, match="temperature"):
        soft_target_loss(torch.zeros(2, 2), torch.zeros(2, 2), T=0)
    with pytest.raises(ValueError, match="student logits"):
        soft_target_loss(torch.zeros(2, 2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="projection"):
        hidden_state_loss(torch.zeros(2, 3, 4), torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match="kind"):
        hidden_state_loss(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), kind="l1")
    with pytest.raises(ValueError, match="not a multiple"):
        uniform_layer_map(4, 6)
    with pytest.raises(ValueError, match="keep_layers"):
        make_student(tiny_bert, [1, 0])
    with pytest.raises(ValueError, match="keep_layers"):
        make_student(tiny_bert, [0, 2])
