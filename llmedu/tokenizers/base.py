"""What every tokenizer of the course can do, and the small pieces they share.

A tokenizer maps text to a list of integer ids and back. The three algorithms of this package
(byte-level BPE, WordPiece, Unigram) differ in how they *learn* a vocabulary and how they *cut*
a word into pieces of it, but they answer to the same interface:

    tok = BPETokenizer().train(texts, vocab_size=8000)   # learn a vocabulary from real text
    ids = tok.encode("Hello world")                      # text -> ids
    ids = tok.encode_iterable(open("big.txt"))           # a whole file's ids, streamed in flat memory
    tok.decode(ids)                                      # ids -> text
    tok.save("bpe.json"); BPETokenizer.load("bpe.json")  # our own readable JSON format
    tok.save_hf("my-tokenizer")                          # a folder AutoTokenizer.from_pretrained loads

Special tokens (``<|endoftext|>``, ``[CLS]``...) are matched in the raw text before anything else
happens, as Hugging Face's "added tokens" are, and always map to their own id.

What this leaves out: batching, padding, truncation, offsets, and every speed trick of the Rust
``tokenizers`` library; the code is written to be read, not to be fast.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["Tokenizer", "as_texts", "check_text", "check_vocab_size", "read_text", "split_on_special", "warn_if_short"]

FORMAT_VERSION = 1

# transformers' name for each role -> the special tokens that play it, by the conventions of BERT,
# SentencePiece and GPT-2 (whose one special token ends every text and starts none).
HF_ROLES = {
    "unk_token": ("[UNK]", "<unk>"),
    "pad_token": ("[PAD]", "<pad>"),
    "cls_token": ("[CLS]",),
    "sep_token": ("[SEP]",),
    "mask_token": ("[MASK]", "<mask>"),
    "bos_token": ("<s>",),
    "eos_token": ("</s>", "<|endoftext|>"),
}


class Tokenizer:
    """The shared interface. Subclasses define ``kind`` and the methods that raise below."""

    kind: str = "abstract"

    def __init__(self) -> None:
        self.special_tokens: dict[str, int] = {}

    # -- what each algorithm defines ---------------------------------------------------------
    def train(self, texts: str | Iterable[str], vocab_size: int) -> Tokenizer:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def id_to_token(self, i: int) -> str:
        """A readable form of token ``i``."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def _state(self) -> dict:  # everything ``load`` needs, as JSON-ready values
        raise NotImplementedError

    @classmethod
    def _from_state(cls, state: dict) -> Tokenizer:
        raise NotImplementedError

    def _hf_pipeline(self) -> dict:
        """The parts of a ``tokenizer.json`` that differ by algorithm: normalizer, pre_tokenizer,
        post_processor, decoder (each a dict, or None for none) and model."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------
    def encode_iterable(self, texts: Iterable[str], chunk_chars: int = 4096) -> Iterator[int]:
        r"""The ids of ``"".join(texts)`` one by one, in flat memory: ``encode_iterable(open(path))``.

        Contract: the ids equal ``encode("".join(texts))`` (for WordPiece: one [CLS] first, one [SEP]
        last) however the text is cut: lines with their newlines, as a file yields them, or any chunks.

        Encoding each line on its own would break it. GPT-2's ``\s+(?!\S)`` glues whitespace across lines
        ("\n\n\n" is "\n\n" + "\n"; "\n" and the next line's indentation are one piece); Unigram's Metaspace
        starts words only at spaces, so in "Citizen:\nBefore" the newline is inside a word; WordPiece
        would frame every line with [CLS] ... [SEP]. So pieces are gathered into ~``chunk_chars``
        characters and encoded up to their last *safe boundary*, just before a space that follows a
        non-whitespace character; the rest waits for the next pieces. There all three tokenizers give the
        same ids for the two sides as for the whole: no GPT-2 regex match holds a non-space followed by a
        space (and the lookahead only ends whitespace runs), the space starts a Metaspace word, and BERT
        splits words at every whitespace. Special tokens must then hold no space (none of ours does).

        Memory: ~``chunk_chars`` characters and their ids. A text with no safe boundary at all (a single
        "word" of 1 GB) would be held whole.
        """
        if not isinstance(chunk_chars, int) or chunk_chars < 1:
            raise ValueError(f"chunk_chars must be a positive int, got {chunk_chars!r}")
        for token in self.special_tokens:
            if " " in token:
                raise ValueError(f"special token {token!r} holds a space, where encode_iterable cuts the text")
        head, tail = self._frame()  # what encode puts around every text: [CLS] and [SEP] for BERT, else nothing
        yield from head
        buffer = ""
        for text in [texts] if isinstance(texts, str) else texts:
            if not isinstance(text, str):
                raise TypeError(f"encode_iterable takes str (open files in text mode), got {type(text).__name__}")
            buffer += text
            cut = _last_safe_boundary(buffer) if len(buffer) >= chunk_chars else 0  # (one call per line is slow)
            if cut > 0:
                ids = self.encode(buffer[:cut])
                yield from ids[len(head) : len(ids) - len(tail)]
                buffer = buffer[cut:]
        ids = self.encode(buffer)
        yield from ids[len(head) : len(ids) - len(tail)]
        yield from tail

    def _frame(self) -> tuple[list[int], list[int]]:
        """The ids ``encode`` puts before and after every text (its ids for ""): none, or BERT's [CLS] ... [SEP]."""
        around = self.encode("")
        if not around:
            return [], []
        roles = self.hf_special_tokens()
        cls_sep = [self.special_tokens.get(roles.get(r)) for r in ("cls_token", "sep_token")]
        if around != cls_sep:
            raise NotImplementedError(f"{type(self).__name__}.encode('') gives {around}: say in _frame what goes where")
        return around[:1], around[1:]

    def tokens(self, text: str) -> list[str]:
        """The pieces ``encode`` cuts ``text`` into, readable: handy for teaching."""
        return [self.id_to_token(i) for i in self.encode(text)]

    def save(self, path: str | Path) -> None:
        """Write the tokenizer to a JSON file that ``load`` reads back, with the sha256 of its content
        so that a file cut short or edited by hand is refused, not half-loaded."""
        state = json.loads(json.dumps({"kind": self.kind, "format": FORMAT_VERSION, **self._state()}))
        document = {"sha256": _content_hash(state), **state}
        Path(path).write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path, *, allow_missing_sha256: bool = False) -> Tokenizer:
        """Read a tokenizer written by ``save``; its content must match the sha256 recorded in it.

        Files saved before the sha256 was recorded have none, and an edit to them cannot be seen: they
        are refused unless ``allow_missing_sha256=True``, which loads them with a warning (save them
        again to add the checksum).
        """
        try:
            state = json.loads(read_text(path, "a saved tokenizer"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not a saved tokenizer: invalid JSON, cut short or not JSON ({err})") from None
        if not isinstance(state, dict) or state.get("kind") != cls.kind:
            found = state.get("kind") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{path} holds a {found!r} tokenizer, not a {cls.kind!r} one")
        if state.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path} has format {state.get('format')!r}; this llmedu reads {FORMAT_VERSION}")
        recorded = state.pop("sha256", None)
        if recorded is None and not allow_missing_sha256:
            raise ValueError(
                f"{path} has no sha256 (saved by an older llmedu), so an edit or a cut cannot be detected; "
                "if you trust it, load it with allow_missing_sha256=True and save it again"
            )
        if recorded is None:
            warnings.warn(f"{path} has no sha256: loaded without checking its content", stacklevel=2)
        elif recorded != _content_hash(state):
            raise ValueError(f"{path} does not match the sha256 it was saved with: it was altered or cut short")
        try:
            return cls._from_state(state)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path} is not a complete {cls.kind!r} tokenizer: {type(err).__name__}: {err}") from None

    def _check_id(self, i: int) -> None:
        """A clear error for an id that is not in the vocabulary (instead of an IndexError, or a wrap)."""
        if not isinstance(i, int) or not 0 <= i < self.vocab_size:
            raise ValueError(f"id {i!r} is not in the vocabulary (ids 0 .. {self.vocab_size - 1})")

    def hf_json(self) -> dict:
        """The ``tokenizer.json`` document of Hugging Face ``tokenizers``: its envelope, our special
        tokens as added tokens, and the algorithm's own pipeline (``_hf_pipeline``)."""
        parts = {"normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None}
        parts.update(self._hf_pipeline())
        return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": self._hf_added_tokens(), **parts}

    def hf_special_tokens(self) -> dict[str, str]:
        """transformers' role -> our special token (``HF_ROLES``), for the roles this tokenizer has.

        A tokenizer without a padding token (GPT-2's has only ``<|endoftext|>``) pads with its end
        token, else its unknown token, as is usual for GPT-2 in ``transformers``: the attention mask
        hides padded positions, so which id fills them does not matter, but ``transformers`` refuses to
        pad without naming one.
        """
        roles = {}
        for role, candidates in HF_ROLES.items():
            token = next((t for t in candidates if t in self.special_tokens), None)
            if token is not None:
                roles[role] = token
        if "pad_token" not in roles and ("eos_token" in roles or "unk_token" in roles):
            roles["pad_token"] = roles.get("eos_token", roles.get("unk_token"))
        return roles

    def save_hf(self, folder: str | Path) -> Path:
        """Write the folder that ``transformers.AutoTokenizer.from_pretrained(folder)`` loads.

        ``tokenizer.json`` (the tokenizer itself), ``tokenizer_config.json`` and
        ``special_tokens_map.json`` (which special token plays which role: padding, [CLS], [MASK]...).
        A path ending in ``tokenizer.json`` means the folder that holds it. Returns the folder.
        """
        folder = Path(folder)
        if folder.name == "tokenizer.json":
            folder = folder.parent
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"save_hf writes a folder of three files; {folder} is a file")
        folder.mkdir(parents=True, exist_ok=True)
        roles = self.hf_special_tokens()
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **roles}
        for name, document in (
            ("tokenizer.json", self.hf_json()),
            ("tokenizer_config.json", config),
            ("special_tokens_map.json", roles),
        ):
            (folder / name).write_text(json.dumps(document, ensure_ascii=False, indent=1), encoding="utf-8")
        return folder

    def _hf_added_tokens(self, normalized: bool = False) -> list[dict]:
        return [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": normalized,
                "special": True,
            }
            for t, i in sorted(self.special_tokens.items(), key=lambda kv: kv[1])
        ]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, special_tokens={list(self.special_tokens)})"


def read_text(path: str | Path, what: str) -> str:
    """The text of the file ``path`` (``what`` it should be), or an error that names it if it is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not {what}: byte {err.start} is not UTF-8 ({err.reason})") from None


def _content_hash(state: dict) -> str:
    return hashlib.sha256(json.dumps(state, ensure_ascii=False, sort_keys=True).encode("utf-8")).hexdigest()


def _last_safe_boundary(text: str) -> int:
    """The largest i > 0 with text[i] a space and text[i - 1] not whitespace; 0 if there is none."""
    i = text.rfind(" ")
    while i > 0 and text[i - 1].isspace():
        i = text.rfind(" ", 0, i)  # a run of spaces: look before it
    return max(i, 0)


def check_text(text: str) -> None:
    """Text to encode must be a str of valid Unicode: a lone surrogate (U+D800..U+DFFF, say from a file
    read with errors="surrogateescape") has no UTF-8 bytes, so no tokenizer can encode it."""
    if not isinstance(text, str):
        raise TypeError(f"text to encode must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"the text holds a lone surrogate {text[err.start]!r} at index {err.start}: it is not valid Unicode; "
            "clean it first, e.g. text.encode('utf-8', 'replace').decode('utf-8')"
        ) from None


def as_texts(texts: str | Iterable[str]) -> list[str]:
    """A training corpus as a list of strings; an empty corpus is an error."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    bad = [type(t).__name__ for t in texts if not isinstance(t, str)]
    if bad:
        raise TypeError(f"texts must be strings, got {bad[0]}")
    if not any(t.strip() for t in texts):
        raise ValueError("the training corpus is empty (no text other than whitespace)")
    return texts


def check_vocab_size(vocab_size: int, minimum: int, what: str) -> None:
    """A clear error when the requested vocabulary cannot even hold the base alphabet."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} is smaller than {what} ({minimum}); ask for at least {minimum}")


def warn_if_short(tokenizer: Tokenizer, asked: int) -> None:
    """Say so when a corpus was too small to fill the vocabulary (the tokenizer is still usable)."""
    if tokenizer.vocab_size < asked:
        warnings.warn(
            f"the corpus ran out of material: {type(tokenizer).__name__} has {tokenizer.vocab_size} "
            f"entries, not the {asked} asked for",
            stacklevel=3,
        )


def split_on_special(text: str, special_tokens: dict[str, int]) -> list[tuple[str, bool]]:
    """Cut ``text`` around special tokens: [(piece, is_special), ...], longest token first."""
    check_text(text)
    if not special_tokens:
        return [(text, False)] if text else []
    pattern = "|".join(re.escape(t) for t in sorted(special_tokens, key=len, reverse=True))
    pieces = re.split(f"({pattern})", text)
    return [(p, i % 2 == 1) for i, p in enumerate(pieces) if p]
