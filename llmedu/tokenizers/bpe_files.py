"""GPT-2's and Hugging Face's files for byte-level BPE: what ``bpe.py`` needs to read and write them.

The algorithm is in ``bpe.py``; this file is only about formats. Both formats spell each byte with a
printable stand-in character (``bytes_to_unicode``: a space is 'Ġ'), so that a token's bytes can be
written as a JSON string:

``encoder.json``  token (in stand-ins) -> id, OpenAI's published vocabulary of GPT-2
``vocab.bpe``     the merges, one "a b" per line in rank order, after a ``#version`` line
``tokenizer.json`` Hugging Face's ``tokenizers`` document: the same vocabulary and merges (``hf_pipeline``)

``load_gpt2`` checks the two files against each other (every byte present, every merge made of known
tokens, nothing stranded that no merge makes) and says which file and line is wrong.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .base import read_text

__all__ = ["bytes_to_unicode", "load_gpt2", "hf_pipeline"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (a space is 'Ġ'), used in its vocabulary files."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def load_gpt2(tok, encoder_json_path: str | Path, vocab_bpe_path: str | Path):
    """Fill the empty ``BPETokenizer`` ``tok`` from OpenAI's ``encoder.json`` and ``vocab.bpe``; return it."""
    try:
        encoder = json.loads(read_text(encoder_json_path, "a GPT-2 encoder.json"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{encoder_json_path} is not a GPT-2 encoder.json: {err}") from None
    if not isinstance(encoder, dict) or not all(isinstance(i, int) for i in encoder.values()):
        raise ValueError(f"{encoder_json_path} must map token strings to integer ids")
    if len(set(encoder.values())) != len(encoder):
        raise ValueError(f"{encoder_json_path} gives the same id to two tokens")
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    missing = [c for c in byte_of if c not in encoder]
    if missing:
        raise ValueError(f"{encoder_json_path} lacks the byte token {missing[0]!r}: every one of the 256 must be there")
    tok.byte_ids = [encoder[c] for c in bytes_to_unicode().values()]
    lines = read_text(vocab_bpe_path, "a GPT-2 vocab.bpe").splitlines()
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    for n, line in enumerate(lines, 1):
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"{vocab_bpe_path}, merge {n}: expected two tokens separated by a space, got {line!r}")
        a, b = parts
        for t in (a, b, a + b):
            if t not in encoder:
                raise ValueError(f"{vocab_bpe_path}, merge {n} ({line!r}): {t!r} is not in {encoder_json_path}")
        tok.merges[(encoder[a], encoder[b])] = encoder[a + b]
    reachable = set(tok.byte_ids) | set(tok.merges.values())
    # what no merge makes must be a special token, written <|...|> as GPT-2's <|endoftext|>; anything
    # else unreachable means a vocab.bpe cut short (its tokens would be matched as "special" text)
    stranded = [t for t, i in encoder.items() if i not in reachable and not re.fullmatch(r"<\|[^|]+\|>", t)]
    if stranded:
        raise ValueError(
            f"{len(stranded)} tokens of {encoder_json_path} are made by no merge of {vocab_bpe_path} "
            f"({len(tok.merges)} merges), the first {stranded[0]!r}: is {vocab_bpe_path} cut short?"
        )
    tok.special_tokens = {t: i for t, i in encoder.items() if i not in reachable}
    tok._build()
    return tok


def hf_pipeline(tok) -> dict:
    """Hugging Face's byte-level BPE for ``tok``: the same regex, bytes written with GPT-2's stand-ins."""
    char = bytes_to_unicode()
    name = {i: "".join(char[b] for b in tok.vocab[i]) for i in tok.vocab if i not in tok.special_tokens.values()}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "pre_tokenizer": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {name[i]: i for i in sorted(name)},
            "merges": [[name[a], name[b]] for a, b in tok.merges],
        },
    }
