"""Knowledge distillation: a smaller student trained on a teacher's soft targets and hidden states.

* **Soft targets** (Hinton et al. 2015, "Distilling the Knowledge in a Neural Network", sec. 2): with
  p = softmax(z_teacher / T) and q = softmax(z_student / T),

      L_soft = T^2 * KL(p || q) = T^2 * sum_c p_c (log p_c - log q_c),   averaged over the batch.

  The T^2 keeps the gradient's size independent of T (the gradient of the KL scales as 1/T^2).
* **Hidden-state matching** (Sanh et al. 2019, DistilBERT, sec. 3): 1 - cos(h_student, h_teacher) per
  token (their cosine embedding loss), averaged over the real (unpadded) tokens and the matched layers;
  ``kind="mse"`` gives the mean squared error instead (TinyBERT's choice). The student has as many
  layers as the map says; student layer k is matched with teacher layer ``layer_map[k]``.
* **Attention transfer** (Wang et al. 2020, MiniLM, eq. 5), an option: KL between the teacher's and the
  student's attention distributions of the last layer, per head and real query position. It needs
  the same number of heads and ``attn_implementation="eager"`` (the fused kernels return no weights).
* **The student** (DistilBERT's initialisation): a copy of the teacher that keeps some of its layers,
  by default one of every two.

The total loss is ``alpha_soft * L_soft + alpha_hidden * L_hidden + alpha_attn * L_attn + alpha_ce * CE``.
Left out: DistilBERT's masked-language-modelling loss (a classifier student has no MLM head) and
MiniLM's value-relation transfer (its eq. 6-7); a narrower student would need a projection of the
hidden states (TinyBERT's W_h) before matching them.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "soft_target_loss",
    "hidden_state_loss",
    "attention_transfer_loss",
    "uniform_layer_map",
    "make_student",
    "DistillationLoss",
]


def soft_target_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, T: float = 2.0) -> torch.Tensor:
    """T^2 KL(softmax(teacher / T) || softmax(student / T)), averaged over the batch; logits (B, C)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} vs teacher {tuple(teacher_logits.shape)}")
    if not T > 0:
        raise ValueError(f"temperature T must be positive, got {T!r}")
    log_q = F.log_softmax(student_logits / T, dim=-1)  # (B, C)
    log_p = F.log_softmax(teacher_logits.detach() / T, dim=-1)  # (B, C); the teacher gets no gradient
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (B,)
    return T**2 * kl.mean()


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values`` (B, T) over the positions where ``mask`` (B, T) is 1."""
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum()


def hidden_state_loss(
    student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, mask: torch.Tensor | None = None, kind: str = "cosine"
) -> torch.Tensor:
    """1 - cos (or the MSE) between matched hidden states (B, T, d), averaged over real tokens."""
    if student_hidden.shape != teacher_hidden.shape:
        raise ValueError(
            f"hidden states differ in shape: student {tuple(student_hidden.shape)}, teacher "
            f"{tuple(teacher_hidden.shape)} (a narrower student needs a projection first)"
        )
    teacher_hidden = teacher_hidden.detach()
    if kind == "cosine":
        per_token = 1 - F.cosine_similarity(student_hidden, teacher_hidden, dim=-1)  # (B, T)
    elif kind == "mse":
        per_token = (student_hidden - teacher_hidden).pow(2).mean(-1)  # (B, T)
    else:
        raise ValueError(f"kind must be 'cosine' or 'mse', got {kind!r}")
    return _masked_mean(per_token, mask)


def attention_transfer_loss(
    student_attn: torch.Tensor, teacher_attn: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """KL(teacher || student) of attention rows (B, H, T, T), averaged over heads and real query positions."""
    if student_attn.shape != teacher_attn.shape:
        raise ValueError(
            f"attention maps differ: student {tuple(student_attn.shape)}, teacher {tuple(teacher_attn.shape)}"
        )
    p = teacher_attn.detach()
    # 0 log 0 = 0: padded keys have probability 0 under both; clamp keeps log finite there
    kl = (p * (p.clamp_min(1e-12).log() - student_attn.clamp_min(1e-12).log())).sum(-1)  # (B, H, T)
    return _masked_mean(kl.mean(1), mask)


def uniform_layer_map(n_student: int, n_teacher: int) -> dict[int, int]:
    """Student hidden state k (1..n_student; 0 is the embeddings) -> teacher hidden state k * n_t / n_s."""
    if n_teacher % n_student:
        raise ValueError(f"n_teacher={n_teacher} is not a multiple of n_student={n_student}")
    return {k: k * n_teacher // n_student for k in range(1, n_student + 1)}


def make_student(teacher: nn.Module, keep_layers: list[int] | None = None) -> nn.Module:
    """A copy of a BERT classifier ``teacher`` with only the blocks ``keep_layers`` (default: every other
    one from the first, DistilBERT's initialisation); embeddings, pooler and head are copied whole."""
    n = len(teacher.bert.encoder.layer)
    keep = list(range(0, n, 2)) if keep_layers is None else list(keep_layers)
    if not keep or sorted(set(keep)) != keep or keep[0] < 0 or keep[-1] >= n:
        raise ValueError(f"keep_layers must be increasing indices in [0, {n}), got {keep_layers!r}")
    student = copy.deepcopy(teacher)
    student.bert.encoder.layer = nn.ModuleList([student.bert.encoder.layer[i] for i in keep])
    student.config.num_hidden_layers = len(keep)
    return student


class DistillationLoss:
    """``loss_fn(student, batch)`` for ``llmedu.train.loop.train``: the teacher runs under no_grad beside."""

    def __init__(
        self,
        teacher: nn.Module,
        T: float = 2.0,
        alpha_soft: float = 1.0,
        alpha_hidden: float = 1.0,
        alpha_ce: float = 0.0,
        alpha_attn: float = 0.0,
        layer_map: dict[int, int] | None = None,
        hidden_kind: str = "cosine",
    ):
        self.teacher = teacher.eval()
        self.T, self.layer_map, self.hidden_kind = T, layer_map, hidden_kind
        self.alpha = {"soft": alpha_soft, "hidden": alpha_hidden, "ce": alpha_ce, "attn": alpha_attn}
        self.last: dict[str, float] = {}  # the parts of the latest loss, for plotting

    def __call__(self, student: nn.Module, batch: dict) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        want_attn = self.alpha["attn"] > 0
        with torch.no_grad():
            t = self.teacher(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=want_attn)
        s = student(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=want_attn)
        layer_map = self.layer_map or uniform_layer_map(len(s.hidden_states) - 1, len(t.hidden_states) - 1)
        parts = {"soft": soft_target_loss(s.logits, t.logits, self.T)}
        if self.alpha["hidden"]:
            parts["hidden"] = sum(
                hidden_state_loss(s.hidden_states[k], t.hidden_states[j], mask, self.hidden_kind)
                for k, j in layer_map.items()
            ) / len(layer_map)
        if self.alpha["ce"]:
            parts["ce"] = F.cross_entropy(s.logits, batch["labels"])
        if want_attn:
            parts["attn"] = attention_transfer_loss(s.attentions[-1], t.attentions[-1], mask)
        self.last = {k: v.item() for k, v in parts.items()}
        return sum(self.alpha[k] * v for k, v in parts.items())
