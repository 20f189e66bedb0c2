"""A linear probe that reads what all-MiniLM-L6-v2 was trained to give: the mean of its token states.

Alain & Bengio (2016) probe a frozen network with a linear classifier on its features. Which features
matters: sentence-transformers trained all-MiniLM-L6-v2 with mean pooling (its archive's
``1_Pooling/config.json``: ``pooling_mode_mean_tokens``), so its ``[CLS]`` state and the pooler above it
carry little on their own. ``MeanPooledProbe`` averages the last hidden states over the real tokens
(the attention mask) and applies the model's own (new) classifier head; the encoder is frozen and stays
in eval mode, so its features are the same at every step (no dropout).

Left out: other poolings (max, [CLS]), and probes of intermediate layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MeanPooledProbe"]


@dataclass
class _Logits:
    logits: torch.Tensor


class MeanPooledProbe(nn.Module):
    """A linear head on the mean of the frozen encoder's last hidden states over the real tokens."""

    peft_method = "probe"

    def __init__(self, model: nn.Module):  # a BertForSequenceClassification
        super().__init__()
        self.encoder, self.classifier = model.bert.requires_grad_(False), model.classifier

    def train(self, mode: bool = True):
        super().train(mode)
        self.encoder.eval()  # frozen features: no dropout in them
        return self

    def forward(self, input_ids, attention_mask, **kwargs):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, d)
        m = attention_mask[..., None].to(h.dtype)  # (B, T, 1)
        return _Logits(self.classifier((h * m).sum(1) / m.sum(1)))  # (B, 2)
