"""Weights to and from Hugging Face ``transformers``: BERT, GPT-2 and Llama (MHA and GQA).

    ours = from_hf(hf_model)      # BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM, or their bare models
    hf_model = to_hf(ours)        # back again, same weights

Converting is renaming: each family's table (``hf_names.py``) pairs our parameter names with theirs. Two
families store weights differently: GPT-2 keeps ``Conv1D`` matrices as (in, out), the transpose of
``nn.Linear``'s (out, in), and fuses q, k, v into one ``c_attn`` matrix; both are undone here.
Llama's q/k weights in ``transformers`` are already permuted for the "rotate half" RoPE that
``llmedu.nn.positions`` uses, so they copy as they are.

The test suite builds small random models of each family and checks that hidden states and logits
agree to 1e-5; that is the proof that every name, transpose and constant here is right.

Left out: RoPE scaling (Llama 3.1's "llama3" rope type), BERT's pooler and NSP head, relative
position embeddings of BERT variants, and checkpoints on disk (``save_pretrained`` does that).
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn.activations import GATED
from .bert import MaskedLM
from .config import TransformerConfig
from .gpt import CausalLM
from .hf_names import full_table, layer_prefix
from .transformer import Transformer

__all__ = ["from_hf", "to_hf"]

# class name -> (family, head); "bare" returns hidden states
_HF_CLASSES = {
    "BertModel": ("bert", "bare"),
    "BertForMaskedLM": ("bert", "lm"),
    "GPT2Model": ("gpt2", "bare"),
    "GPT2LMHeadModel": ("gpt2", "lm"),
    "LlamaModel": ("llama", "bare"),
    "LlamaForCausalLM": ("llama", "lm"),
}
_PRESETS = {"bert": TransformerConfig.bert, "gpt2": TransformerConfig.gpt2, "llama": TransformerConfig.llama}
# A config converts as a family's when these fields are its preset's (sizes, eps, dropout are free) ...
_LAYOUT = (
    "position",
    "norm",
    "norm_placement",
    "block",
    "bias",
    "causal",
    "type_vocab_size",
    "embedding_norm",
    "tie_embeddings",
)
_LAYOUT_VARIES = {"bert": {"type_vocab_size"}, "llama": {"tie_embeddings"}}  # ... but these, whose checkpoints vary
# our activation -> transformers' name; reading, the tanh GELU also goes by a second name
_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
_ACT_FROM_HF = {**{hf: ours for ours, hf in _ACT_TO_HF.items()}, "gelu_pytorch_tanh": "gelu_tanh"}
_GLU_TO_HF = {"swiglu": "silu", "geglu": "gelu"}  # Llama names the gate's function
_GLU_FROM_HF = {hf: ours for ours, hf in _GLU_TO_HF.items()}


# -- configs ---------------------------------------------------------------------------------------------
def _config_from_hf(family: str, hc) -> TransformerConfig:
    if family == "bert":
        if getattr(hc, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"only absolute BERT positions are supported, got {hc.position_embedding_type!r}")
        return TransformerConfig.bert(
            vocab_size=hc.vocab_size,
            d_model=hc.hidden_size,
            n_layers=hc.num_hidden_layers,
            n_heads=hc.num_attention_heads,
            d_ff=hc.intermediate_size,
            max_seq_len=hc.max_position_embeddings,
            type_vocab_size=hc.type_vocab_size,
            norm_eps=hc.layer_norm_eps,
            activation=_activation(_ACT_FROM_HF, hc.hidden_act),
            dropout=hc.hidden_dropout_prob,
        )
    if family == "gpt2":
        if not hc.scale_attn_weights or hc.scale_attn_by_inverse_layer_idx:
            raise ValueError("only GPT-2's standard 1/sqrt(D) attention scaling is supported")
        return TransformerConfig.gpt2(
            vocab_size=hc.vocab_size,
            d_model=hc.n_embd,
            n_layers=hc.n_layer,
            n_heads=hc.n_head,
            d_ff=hc.n_inner,  # None: 4 * d_model, in transformers as here
            max_seq_len=hc.n_positions,
            norm_eps=hc.layer_norm_epsilon,
            activation=_activation(_ACT_FROM_HF, hc.activation_function),
            dropout=hc.resid_pdrop,
            tie_embeddings=hc.tie_word_embeddings,
        )
    rope = hc.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {rope['rope_type']!r} is not supported, only the default rope")
    if hc.head_dim != hc.hidden_size // hc.num_attention_heads:
        raise ValueError(f"head_dim={hc.head_dim} differs from hidden_size / num_attention_heads")
    if hc.attention_bias or hc.mlp_bias:
        raise ValueError("Llama models with attention or MLP biases are not supported")
    return TransformerConfig.llama(  # Llama has no residual dropout (its attention_dropout is on probabilities)
        vocab_size=hc.vocab_size,
        d_model=hc.hidden_size,
        n_layers=hc.num_hidden_layers,
        n_heads=hc.num_attention_heads,
        n_kv_heads=hc.num_key_value_heads,
        d_ff=hc.intermediate_size,
        max_seq_len=hc.max_position_embeddings,
        norm_eps=hc.rms_norm_eps,
        rope_base=float(rope.get("rope_theta", TransformerConfig.rope_base)),
        activation=_activation(_GLU_FROM_HF, hc.hidden_act),
        tie_embeddings=hc.tie_word_embeddings,
    )


def _hf_config(family: str, c: TransformerConfig):
    import transformers

    common = dict(
        vocab_size=c.vocab_size,
        tie_word_embeddings=c.tie_embeddings,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    if family == "bert":
        return transformers.BertConfig(
            hidden_size=c.d_model,
            num_hidden_layers=c.n_layers,
            num_attention_heads=c.n_heads,
            intermediate_size=c.d_ff,
            hidden_act=_ACT_TO_HF[c.activation],
            max_position_embeddings=c.max_seq_len,
            type_vocab_size=c.type_vocab_size,
            layer_norm_eps=c.norm_eps,
            hidden_dropout_prob=c.dropout,
            attention_probs_dropout_prob=0.0,
            **common,
        )
    if family == "gpt2":
        return transformers.GPT2Config(
            n_embd=c.d_model,
            n_layer=c.n_layers,
            n_head=c.n_heads,
            n_inner=c.d_ff,
            n_positions=c.max_seq_len,
            activation_function=_ACT_TO_HF[c.activation],
            layer_norm_epsilon=c.norm_eps,
            resid_pdrop=c.dropout,
            embd_pdrop=c.dropout,
            attn_pdrop=0.0,
            **common,
        )
    return transformers.LlamaConfig(
        hidden_size=c.d_model,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        intermediate_size=c.d_ff,
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_base},
        hidden_act=_GLU_TO_HF[c.activation],
        attention_bias=c.bias,
        mlp_bias=c.bias,
        **common,
    )


def _activation(mapping: dict, name: str) -> str:
    if name not in mapping:
        raise ValueError(f"activation {name!r} has no equivalent here; supported: {sorted(mapping)}")
    return mapping[name]


def _family_of(config: TransformerConfig) -> str:
    """The family whose preset ``config`` follows in every field of ``_LAYOUT``, with an activation it names."""
    for family, preset in _PRESETS.items():
        reference = preset()
        layout = [k for k in _LAYOUT if k not in _LAYOUT_VARIES.get(family, ())]
        activations = _GLU_TO_HF if reference.activation in GATED else _ACT_TO_HF
        if all(getattr(config, k) == getattr(reference, k) for k in layout) and config.activation in activations:
            return family
    raise ValueError("this config matches none of BERT, GPT-2 or Llama; start from TransformerConfig.bert/gpt2/llama()")


# -- the two directions -----------------------------------------------------------------------------------
def _check_heads_agree(hf_model: nn.Module, config: TransformerConfig) -> None:
    """The head count is not in the weights' shapes: a config edited after the model was built would
    convert silently into a model that splits the same weights into other heads. Compare it with what
    the attention modules themselves were built with."""
    expected = {"num_heads": config.n_heads, "num_attention_heads": config.n_heads}
    expected |= {"head_dim": config.head_dim, "attention_head_size": config.head_dim}
    for name, module in hf_model.named_modules():
        for attribute, value in expected.items():
            built = getattr(module, attribute, None)
            if isinstance(built, int) and built != value:
                raise ValueError(
                    f"{name}.{attribute} is {built}, but the model's config implies {value}: the config was changed "
                    "after the model was built, so its weights would be split into other heads"
                )


def _check_layers_held(theirs: dict, prefix: str, n_layers: int) -> None:
    """The config's layer count must be the number of blocks the model holds: a model whose block list was
    cut (or grown) after it was built would otherwise fail on a missing name, or lose its extra blocks."""
    held = {name[len(prefix) :].split(".")[0] for name in theirs if name.startswith(prefix)}
    if held != {str(i) for i in range(n_layers)}:
        raise ValueError(
            f"the model's config says {n_layers} layers but its weights hold {len(held)} blocks ({prefix}*): "
            "set the config's layer count (num_hidden_layers, or n_layer for GPT-2) to the blocks the model holds"
        )


def from_hf(hf_model: nn.Module) -> nn.Module:
    """Our model with ``hf_model``'s weights: ``Transformer`` for a bare model, else ``CausalLM``/``MaskedLM``."""
    name = type(hf_model).__name__
    if name not in _HF_CLASSES:
        raise TypeError(f"from_hf takes one of {sorted(_HF_CLASSES)}, got {name}")
    family, head = _HF_CLASSES[name]
    config = _config_from_hf(family, hf_model.config)
    _check_heads_agree(hf_model, config)
    model = Transformer(config) if head == "bare" else (MaskedLM if family == "bert" else CausalLM)(config)
    theirs = hf_model.state_dict()
    _check_layers_held(theirs, layer_prefix(family, head), config.n_layers)
    ours = {}
    for our_name, their_name, how in full_table(family, head, config.n_layers):
        w = theirs[their_name]
        if how == "t":
            w = w.t()
        elif how.startswith("qkv"):  # c_attn: (d, 3d) or (3d,) holding q, k, v side by side
            w = w.chunk(3, dim=-1)[int(how[3])]
            w = w.t() if w.dim() == 2 else w
        ours[our_name] = w.detach().clone().contiguous()
    model.load_state_dict(ours, strict=True)
    return model.to(next(hf_model.parameters()).dtype).train(hf_model.training)


def to_hf(model: nn.Module) -> nn.Module:
    """The ``transformers`` model with our weights (same family, same head)."""
    import transformers

    family = _family_of(model.config)
    if isinstance(model, Transformer):
        head = "bare"
        cls = {"bert": transformers.BertModel, "gpt2": transformers.GPT2Model, "llama": transformers.LlamaModel}[family]
    elif isinstance(model, (CausalLM, MaskedLM)):
        head = "lm"
        cls = {
            "bert": transformers.BertForMaskedLM,
            "gpt2": transformers.GPT2LMHeadModel,
            "llama": transformers.LlamaForCausalLM,
        }[family]
    else:
        raise TypeError(f"to_hf takes a Transformer, CausalLM or MaskedLM, got {type(model).__name__}")
    kwargs = {"add_pooling_layer": False} if cls is transformers.BertModel else {}
    hf_model = cls(_hf_config(family, model.config), **kwargs)
    ours = model.state_dict()
    theirs: dict[str, torch.Tensor] = {}
    for our_name, their_name, how in full_table(family, head, model.config.n_layers):
        w = ours[our_name]
        if how.startswith("qkv"):  # gather q, k, v into c_attn
            theirs.setdefault(their_name, [None] * 3)[int(how[3])] = w.t() if w.dim() == 2 else w
            continue
        theirs[their_name] = w.t() if how == "t" else w
    theirs = {k: torch.cat(v, dim=-1) if isinstance(v, list) else v for k, v in theirs.items()}
    hf_model.load_state_dict({k: v.detach().clone().contiguous() for k, v in theirs.items()}, strict=True)
    return hf_model.to(next(model.parameters()).dtype).train(model.training)
