"""A causal language model (GPT-2, LLaMA) and greedy/sampled generation with a KV cache.

    logits = hidden_states @ W_out^T          (B, T, vocab); W_out = W_embed when tied

Generation feeds the prompt once (prefill), then one token at a time (decode). With the cache each
decoding step runs the model on a single token and attends over the cached keys and values, so a
step costs O(T) instead of O(T^2) for re-running the whole prefix. Both paths give the same tokens;
``generate(..., use_cache=False)`` is the oracle of the test.

Left out: beam search, repetition penalties, stop tokens, and batches of different lengths.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TransformerConfig
from .transformer import Transformer

__all__ = ["CausalLM", "generate", "lm_loss"]


class CausalLM(nn.Module):
    """Transformer + output projection: input_ids (B, T) -> next-token logits (B, T, vocab)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if not config.causal:
            raise ValueError("a causal LM needs config.causal=True")
        self.config = config
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.tok_embed.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=config.init_std)

    def forward(self, input_ids=None, attention_mask=None, cache=None, inputs_embeds=None) -> torch.Tensor:
        h = self.transformer(input_ids, attention_mask, cache=cache, inputs_embeds=inputs_embeds)  # (B, T, d)
        return self.lm_head(h)  # (B, T, vocab)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.get_input_embeddings()

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        return generate(self, input_ids, max_new_tokens, **kwargs)


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from tokens <= t."""
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())


@torch.no_grad()
def generate(
    model: CausalLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Append ``max_new_tokens`` tokens to ``input_ids`` (B, T). ``temperature=0`` is greedy."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    vocab = model.config.vocab_size
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= vocab):
        raise ValueError(f"top_k must be an int from 1 to the vocabulary size {vocab}, got {top_k!r}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    total = T + max_new_tokens
    if model.config.position == "learned" and total > model.config.max_seq_len:
        raise ValueError(f"{total} tokens exceed the learned position table of {model.config.max_seq_len}")
    cache = model.transformer.new_cache(B, total) if use_cache else None
    ids, step_input = input_ids, input_ids  # with a cache only the new tokens go in
    for _ in range(max_new_tokens):
        logits = model(step_input if use_cache else ids, cache=cache)[:, -1]  # (B, vocab)
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(logits.softmax(-1), 1, generator=generator)  # (B, 1)
        ids = torch.cat([ids, next_id], dim=1)
        step_input = next_id
    return ids
