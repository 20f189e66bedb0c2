"""Which norm, activation, position encoding and block some well-known LLMs use, each with its source.

``LLMS`` is a list of rows, one model each. The fields ``norm``, ``norm_placement``, ``activation``,
``position`` and ``block`` are written as ``TransformerConfig`` spells them, so a row is one line of
config (``as_config_fields``); ``attention`` and ``note`` are read, not configured: where a model does
something our config cannot say (GPT-3's sparse layers, Falcon's second LayerNorm), ``note`` says so.
``print_table`` prints the rows and their sources, and checks that every row is a valid config.

Left out: widths, depths, vocabularies and training recipes (Zhao et al. 2023, "A Survey of Large
Language Models", tabulates many more models).
"""

from __future__ import annotations

from .config import TransformerConfig

__all__ = ["LLMS", "CONFIG_FIELDS", "as_config_fields", "print_table"]

CONFIG_FIELDS = ("norm", "norm_placement", "activation", "position", "block")

LLMS = [
    dict(
        model="GPT-3",
        norm="layernorm",
        norm_placement="pre",
        activation="gelu_tanh",
        position="learned",
        attention="MHA, dense + banded",
        block="serial",
        note="layers alternate dense and locally banded sparse attention (not in our config)",
        source="Brown et al. 2020, sec. 2.1 (GPT-2's architecture: Radford et al. 2019, sec. 2.3; "
        "GELU's tanh approximation in GPT-2's released model.py)",
    ),
    dict(
        model="BLOOM",
        norm="layernorm",
        norm_placement="pre",
        activation="gelu_tanh",
        position="alibi",
        attention="MHA",
        block="serial",
        note="also a LayerNorm after the embeddings (embedding_norm=True)",
        source="BigScience 2022 (arXiv:2211.05100), sec. 3.2.2; "
        "GELU's tanh approximation in transformers' modeling_bloom.py",
    ),
    dict(
        model="LLaMA",
        norm="rmsnorm",
        norm_placement="pre",
        activation="swiglu",
        position="rope",
        attention="MHA (GQA in Llama 2 70B)",
        block="serial",
        note="",
        source="Touvron et al. 2023, sec. 2.2; Llama 2: Touvron et al. 2023b, sec. 2.2",
    ),
    dict(
        model="Falcon",
        norm="layernorm",
        norm_placement="pre",
        activation="gelu",
        position="rope",
        attention="MQA (7B), GQA (40B, 180B)",
        block="parallel",
        note="40B and 180B give each parallel branch its own LayerNorm; ours, like 7B's, has one",
        source="Almazrouei et al. 2023 (arXiv:2311.16867); transformers' modeling_falcon.py "
        "(new_decoder_architecture: ln_attn and ln_mlp)",
    ),
    dict(
        model="GLM-130B",
        norm="layernorm",
        norm_placement="deepnorm",
        activation="geglu",
        position="rope",
        attention="MHA",
        block="serial",
        note="its DeepNorm weighs the residual by (2N)^(1/2), ours by DeepNet's (2N)^(1/4)",
        source="Zeng et al. 2023 (ICLR), sec. 2.1",
    ),
    dict(
        model="ChatGLM2/3-6B",
        norm="rmsnorm",
        norm_placement="pre",
        activation="swiglu",
        position="rope",
        attention="GQA (2 KV groups)",
        block="serial",
        note="",
        source="THUDM/ChatGLM2-6B config.json and modeling_chatglm.py",
    ),
]


def as_config_fields(row: dict) -> dict:
    """The row's ``TransformerConfig`` fields (a ``KeyError`` names a missing one)."""
    return {k: row[k] for k in CONFIG_FIELDS}


def print_table(rows: list[dict] = LLMS) -> None:
    """Print the rows, then each model's notes and sources; raise if a row is not a valid config."""
    widths = {"model": 15, "norm": 11, "norm_placement": 16, "activation": 11, "position": 10, "attention": 27}
    print("".join(f"{c:<{w}}" for c, w in widths.items()) + "block")
    for row in rows:
        TransformerConfig(**as_config_fields(row))  # every row is a valid config of ours
        print("".join(f"{row[c]:<{w}}" for c, w in widths.items()) + row["block"])
    print()
    for row in rows:
        print(f"{row['model']}: {row['source']}" + (f". Note: {row['note']}" if row["note"] else ""))
