"""Small random ``transformers`` models of each family ``from_hf`` converts, for checking it weight for weight.

    for hf_model in tiny_hf_models():     # BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM
        ours = from_hf(hf_model)

The sizes are deliberately odd, so that a swapped dimension cannot go unnoticed: width 96 with 3 heads of
32, an FFN of 136 (not 4 x 96), a vocabulary of 101, and a Llama whose 6 query heads share 2 key/value
heads (grouped-query attention, Ainslie et al., 2023). The weights are ``transformers``' own random
initialisation (seeded), not a checkpoint: nothing is downloaded.

Left out: the bare models (``BertModel``, ...), which ``from_hf`` converts too, and every other family.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["tiny_hf_models"]


def tiny_hf_models(seed: int = 0) -> Iterator[torch.nn.Module]:
    """A BERT, a GPT-2 and a Llama with LM heads, 2 layers each, random weights from ``seed``."""
    import transformers as tf  # optional dependency: imported where it is needed

    torch.manual_seed(seed)
    quiet = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no special tokens to warn about
    shape = dict(vocab_size=101, hidden_size=96, num_hidden_layers=2, intermediate_size=136)
    yield tf.BertForMaskedLM(tf.BertConfig(**shape, num_attention_heads=3, max_position_embeddings=64, **quiet))
    yield tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=101, n_embd=96, n_head=3, n_layer=2, n_inner=136, n_positions=64, **quiet)
    )
    yield tf.LlamaForCausalLM(tf.LlamaConfig(**shape, num_attention_heads=6, num_key_value_heads=2, **quiet))
