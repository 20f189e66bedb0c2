"""The course's transformer, built from ``llmedu.nn`` and selected by one config.

config        TransformerConfig: every variant is a field; presets gpt2(), bert(), llama()
transformer   Transformer: embeddings, blocks, final norm -> hidden states
gpt           CausalLM (logits), generate() with a KV cache
bert          MaskedLM and SequenceClassifier
counting      parameters, FLOPs per token, MFU
hf            from_hf / to_hf: weights to and from ``transformers`` (BERT, GPT-2, Llama)
hf_names      the name tables: which of our parameters is which of theirs
"""

from .bert import MaskedLM, SequenceClassifier
from .config import MoEConfig, TransformerConfig
from .gpt import CausalLM, generate
from .hf import from_hf, to_hf
from .transformer import Transformer

__all__ = [
    "CausalLM",
    "MaskedLM",
    "SequenceClassifier",
    "Transformer",
    "TransformerConfig",
    "MoEConfig",
    "generate",
    "from_hf",
    "to_hf",
]
