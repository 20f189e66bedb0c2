"""Which of our parameters is which of ``transformers``': the name tables of BERT, GPT-2 and Llama.

``full_table(family, head, n_layers)`` lists ``(our name, their name, how)`` for every weight, where
``how`` says how to copy it: "copy", "t" (GPT-2's ``Conv1D`` stores (in, out), the transpose of
``nn.Linear``), or "qkv0"/"qkv1"/"qkv2" (slice j of GPT-2's fused ``c_attn``). ``hf.py`` uses the
table in both directions.
"""

from __future__ import annotations

__all__ = ["full_table", "layer_prefix"]

_HF_PREFIX = {"bert": "bert.", "gpt2": "transformer.", "llama": "model."}  # base model inside the LM
_LAYERS = {"bert": "encoder.layer", "gpt2": "h", "llama": "layers"}  # the list of blocks, in the bare model


def layer_prefix(family: str, head: str) -> str:
    """Their name of the list of blocks, as a state-dict prefix: ``bert.encoder.layer.`` holds ``0.``, ``1.``, ..."""
    return (_HF_PREFIX[family] if head != "bare" else "") + _LAYERS[family] + "."


def _name_table(family: str, n_layers: int) -> list[tuple[str, str, str]]:
    """(our name under Transformer, their name under the bare model, how); how: copy, t (transpose), qkv0/1/2."""
    table = {
        "bert": [
            ("tok_embed.weight", "embeddings.word_embeddings.weight"),
            ("pos_embed.weight", "embeddings.position_embeddings.weight"),
            ("type_embed.weight", "embeddings.token_type_embeddings.weight"),
            ("embed_norm.weight", "embeddings.LayerNorm.weight"),
            ("embed_norm.bias", "embeddings.LayerNorm.bias"),
        ],
        "gpt2": [
            ("tok_embed.weight", "wte.weight"),
            ("pos_embed.weight", "wpe.weight"),
            ("final_norm.weight", "ln_f.weight"),
            ("final_norm.bias", "ln_f.bias"),
        ],
        "llama": [("tok_embed.weight", "embed_tokens.weight"), ("final_norm.weight", "norm.weight")],
    }[family]
    table = [(ours, theirs, "copy") for ours, theirs in table]
    per_layer = {
        "bert": [
            ("attn.q_proj", "attention.self.query"),
            ("attn.k_proj", "attention.self.key"),
            ("attn.v_proj", "attention.self.value"),
            ("attn.o_proj", "attention.output.dense"),
            ("attn_norm", "attention.output.LayerNorm"),
            ("mlp.up_proj", "intermediate.dense"),
            ("mlp.down_proj", "output.dense"),
            ("mlp_norm", "output.LayerNorm"),
        ],
        "gpt2": [
            ("attn_norm", "ln_1"),
            ("attn.o_proj", "attn.c_proj"),
            ("mlp_norm", "ln_2"),
            ("mlp.up_proj", "mlp.c_fc"),
            ("mlp.down_proj", "mlp.c_proj"),
        ],  # q, k, v: below
        "llama": [
            ("attn.q_proj", "self_attn.q_proj"),
            ("attn.k_proj", "self_attn.k_proj"),
            ("attn.v_proj", "self_attn.v_proj"),
            ("attn.o_proj", "self_attn.o_proj"),
            ("mlp.gate_proj", "mlp.gate_proj"),
            ("mlp.up_proj", "mlp.up_proj"),
            ("mlp.down_proj", "mlp.down_proj"),
            ("attn_norm", "input_layernorm"),
            ("mlp_norm", "post_attention_layernorm"),
        ],
    }[family]
    layer_prefix = _LAYERS[family]
    params = ["weight"] if family == "llama" else ["weight", "bias"]
    for i in range(n_layers):
        for ours, theirs in per_layer:
            is_conv1d = family == "gpt2" and "_proj" in ours  # GPT-2's Conv1D stores (in, out)
            for p in params:
                how = "t" if is_conv1d and p == "weight" else "copy"
                table.append((f"blocks.{i}.{ours}.{p}", f"{layer_prefix}.{i}.{theirs}.{p}", how))
        if family == "gpt2":
            for p in ("weight", "bias"):
                for j, n in enumerate("qkv"):  # slice j of the fused c_attn
                    table.append((f"blocks.{i}.attn.{n}_proj.{p}", f"h.{i}.attn.c_attn.{p}", f"qkv{j}"))
    return table


def _head_table(family: str) -> list[tuple[str, str, str]]:
    """Names of the LM head, relative to the top-level modules."""
    if family == "bert":
        pairs = [
            ("mlm_head.dense.weight", "cls.predictions.transform.dense.weight"),
            ("mlm_head.dense.bias", "cls.predictions.transform.dense.bias"),
            ("mlm_head.norm.weight", "cls.predictions.transform.LayerNorm.weight"),
            ("mlm_head.norm.bias", "cls.predictions.transform.LayerNorm.bias"),
            ("mlm_head.decoder.weight", "cls.predictions.decoder.weight"),
            ("mlm_head.decoder.bias", "cls.predictions.decoder.bias"),
            ("mlm_head.decoder.bias", "cls.predictions.bias"),
        ]  # the same tensor, under two names
    else:
        pairs = [("lm_head.weight", "lm_head.weight")]
    return [(ours, theirs, "copy") for ours, theirs in pairs]


def full_table(family: str, head: str, n_layers: int) -> list[tuple[str, str, str]]:
    if head == "bare":
        return _name_table(family, n_layers)
    body = [("transformer." + o, _HF_PREFIX[family] + t, how) for o, t, how in _name_table(family, n_layers)]
    return body + _head_table(family)
