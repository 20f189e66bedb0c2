"""BERT's basic tokenizer: the normalisation and word splitting that come before WordPiece.

``normalize`` drops control characters, turns every whitespace into a space, puts spaces around CJK
ideographs (so Chinese is cut per character), strips accents (NFD, then drops the combining marks)
and lower-cases. ``basic_tokenize`` then splits on whitespace and cuts every punctuation character
out as a word of its own. Together they are Hugging Face's ``BertNormalizer`` + ``BertPreTokenizer``
(and BERT's original ``BasicTokenizer``, Devlin et al. 2019), down to which characters count as
whitespace, control or punctuation.

Left out: the ``never_split`` list of the original Python tokenizer; offsets.
"""

from __future__ import annotations

import unicodedata

__all__ = ["normalize", "basic_tokenize", "is_cjk"]

_EXTRA_WHITESPACE = set("\t\n\r\x0b\x0c\x85\u2028\u2029")  # Unicode White_Space outside category Zs
_CJK = [
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
]


def _is_whitespace(c: str) -> bool:
    return c in _EXTRA_WHITESPACE or unicodedata.category(c) == "Zs"


def _is_control(c: str) -> bool:  # every "other" category (Cc, Cf, Cn, Co, Cs) except \t \n \r
    return c not in "\t\n\r" and unicodedata.category(c).startswith("C")


def _is_punctuation(c: str) -> bool:  # ASCII symbols such as $ + < = > ^ ` | ~ count too
    return (c.isascii() and not c.isalnum() and c.isprintable() and c != " ") or unicodedata.category(c).startswith("P")


def is_cjk(c: str) -> bool:
    """Is ``c`` a CJK ideograph (the blocks BERT splits one character at a time)?"""
    return any(lo <= ord(c) <= hi for lo, hi in _CJK)


def normalize(text: str, lowercase: bool = True, strip_accents: bool | None = None, split_cjk: bool = True) -> str:
    """BERT's normaliser: clean, space out CJK, strip accents (by default when lower-casing), lower-case."""
    out = []
    for c in text:
        if c in "\x00\ufffd" or _is_control(c):
            continue
        out.append(" " if _is_whitespace(c) else f" {c} " if split_cjk and is_cjk(c) else c)
    text = "".join(out)
    if lowercase if strip_accents is None else strip_accents:
        text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
    return text.lower() if lowercase else text


def basic_tokenize(text: str) -> list[str]:
    """Split normalised text on whitespace, and cut out every punctuation character as a word."""
    words, current = [], []
    for c in text:
        if _is_whitespace(c) or _is_punctuation(c):
            if current:
                words.append("".join(current))
                current = []
            if not _is_whitespace(c):
                words.append(c)
        else:
            current.append(c)
    if current:
        words.append("".join(current))
    return words
