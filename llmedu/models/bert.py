"""BERT's heads (Devlin et al. 2019): masked language modelling and sequence classification.

* Masked LM: hidden states -> dense -> activation -> norm -> logits over the vocabulary, with the
  output matrix tied to the token embeddings and a bias of its own (BERT's ``cls.predictions``).
  The loss is taken on the masked positions only (labels of -100 elsewhere).
* Sequence classification: the hidden state of the first token ([CLS]) -> dense -> tanh (the
  "pooler") -> dropout -> a linear classifier.

Both read the same bidirectional ``Transformer`` (``config.causal=False``). Left out: the
next-sentence-prediction head, which RoBERTa showed is not needed.
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn.activations import ACTIVATIONS, FUSED, GATED
from ..nn.norms import make_norm
from .config import TransformerConfig
from .transformer import Transformer

__all__ = ["MLMHead", "MaskedLM", "SequenceClassifier", "mlm_loss"]


class MLMHead(nn.Module):
    """(B, T, d) -> (B, T, vocab): dense, activation, norm, then the (tied) decoder."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        c = config
        self.dense = nn.Linear(c.d_model, c.d_model, bias=c.bias)
        self.act = (FUSED if c.fused else ACTIVATIONS)["gelu" if c.activation in GATED else c.activation]
        self.norm = make_norm(c.norm, c.d_model, c.norm_eps, c.bias, c.fused)
        self.decoder = nn.Linear(c.d_model, c.vocab_size, bias=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(h))))


class MaskedLM(nn.Module):
    """input_ids (B, T) -> logits (B, T, vocab) for every position (the loss picks the masked ones)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if config.causal:
            raise ValueError("a masked LM reads both directions: set config.causal=False")
        self.config = config
        self.transformer = Transformer(config)
        self.mlm_head = MLMHead(config)
        nn.init.normal_(self.mlm_head.dense.weight, std=config.init_std)
        if self.mlm_head.dense.bias is not None:
            nn.init.zeros_(self.mlm_head.dense.bias)
        nn.init.zeros_(self.mlm_head.decoder.bias)
        if config.tie_embeddings:
            self.mlm_head.decoder.weight = self.transformer.tok_embed.weight

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, cache=None, inputs_embeds=None):
        h = self.transformer(input_ids, attention_mask, token_type_ids, cache, inputs_embeds)  # (B, T, d)
        return self.mlm_head(h)  # (B, T, vocab)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.get_input_embeddings()


def mlm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the positions whose label is not -100."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


class SequenceClassifier(nn.Module):
    """input_ids (B, T) -> class logits (B, n_classes), read from the first token's hidden state."""

    def __init__(self, config: TransformerConfig, n_classes: int):
        super().__init__()
        if n_classes < 2:
            raise ValueError(f"n_classes must be at least 2, got {n_classes}")
        self.config = config
        self.transformer = Transformer(config)
        self.pooler = nn.Linear(config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.d_model, n_classes)
        for linear in (self.pooler, self.classifier):
            nn.init.normal_(linear.weight, std=config.init_std)
            nn.init.zeros_(linear.bias)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, cache=None, inputs_embeds=None):
        h = self.transformer(input_ids, attention_mask, token_type_ids, cache, inputs_embeds)  # (B, T, d)
        pooled = torch.tanh(self.pooler(h[:, 0]))  # (B, d): the [CLS] token
        return self.classifier(self.dropout(pooled))  # (B, n_classes)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.get_input_embeddings()
