"""What every tokenizer shares: the export to ``transformers`` loads with its special tokens working.

Each of the three algorithms is trained on a little Shakespeare, written with ``save_hf(folder)`` and
loaded back with ``AutoTokenizer.from_pretrained(folder)``: the ids must be ours, padding a batch must
work, and each special token must play its role ([CLS]/[SEP] around a sentence, [MASK] by name).
"""

from __future__ import annotations

import json
import random
import tracemalloc

import pytest
from transformers import AutoTokenizer, BertTokenizerFast

from llmedu.checks.tokenizers import hard_strings, varied_text
from llmedu.data import load_corpus, reference_files
from llmedu.tokenizers import BPETokenizer, UnigramTokenizer, WordPieceTokenizer

SAMPLES = ["a", "a b", "To be, or not to be: that is the question.", "I can't, he's gone; we'll see!"]


@pytest.fixture(scope="module")
def text():
    return load_corpus("shakespeare")[:60_000]


@pytest.fixture(scope="module", params=["bpe", "wordpiece", "unigram"])
def exported(request, text, tmp_path_factory):
    make = {"bpe": BPETokenizer, "wordpiece": WordPieceTokenizer, "unigram": UnigramTokenizer}[request.param]
    ours = make().train(text, 600)
    folder = ours.save_hf(tmp_path_factory.mktemp(request.param) / "exported")
    return request.param, ours, AutoTokenizer.from_pretrained(folder)


def test_transformers_reads_our_ids_and_pads(exported):
    kind, ours, theirs = exported
    for s in SAMPLES:
        assert theirs(s)["input_ids"] == ours.encode(s), (kind, s)
    batch = theirs(SAMPLES[:2], padding=True)
    lengths = [len(ours.encode(s)) for s in SAMPLES[:2]]
    assert [sum(m) for m in batch["attention_mask"]] == lengths
    assert len({len(ids) for ids in batch["input_ids"]}) == 1, "padding did not make the rows equal"
    assert batch["input_ids"][0][lengths[0] :] == [theirs.pad_token_id] * (lengths[1] - lengths[0])


def test_special_tokens_play_their_roles(exported):
    kind, ours, theirs = exported
    roles = ours.hf_special_tokens()
    for role, token in roles.items():
        assert getattr(theirs, role) == token, (kind, role)
        assert getattr(theirs, role + "_id") == ours.special_tokens[token]
    if kind == "wordpiece":
        ids = theirs("a b")["input_ids"]
        assert (ids[0], ids[-1]) == (ours.special_tokens["[CLS]"], ours.special_tokens["[SEP]"])
        assert theirs.mask_token_id == ours.special_tokens["[MASK]"]
        assert theirs("the [MASK] is")["input_ids"] == ours.encode("the [MASK] is")
    if kind == "bpe":  # GPT-2 style: one end-of-text token, which also pads
        assert theirs.pad_token == theirs.eos_token == "<|endoftext|>"


def test_save_hf_takes_a_folder_or_its_tokenizer_json_and_refuses_a_file(text, tmp_path):
    tok = UnigramTokenizer().train(text[:5_000], 200)
    assert tok.save_hf(tmp_path / "a" / "tokenizer.json") == tmp_path / "a"
    assert {p.name for p in (tmp_path / "a").iterdir()} == {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="is a file"):
        tok.save_hf(tmp_path / "file")


def test_wordpiece_decodes_as_transformers_does():
    """Contractions included: BERT cut "can't" into can ' t, and transformers gives "can ' t" back."""
    ours = WordPieceTokenizer.from_vocab(reference_files("bert-base-uncased")["vocab.txt"])
    theirs = BertTokenizerFast.from_pretrained(reference_files("bert-base-uncased")["vocab.txt"].parent)
    lines = [s for s in varied_text().split("\n")[::5] + hard_strings() + SAMPLES if s.strip()]
    assert ours.decode(ours.encode("I can't go.")) == "[CLS] i can ' t go. [SEP]"
    different = [s for s in lines if ours.decode(ours.encode(s)) != theirs.decode(theirs(s)["input_ids"])]
    assert not different, f"{len(different)} of {len(lines)} lines decode differently, the first: {different[0]!r}"


def test_bad_text_ids_and_files_are_clear_errors(text, tmp_path):
    tok = UnigramTokenizer().train(text[:5_000], 200)
    with pytest.raises(ValueError, match=r"lone surrogate '\\udc80' at index 2"):
        tok.encode("ab\udc80c")
    with pytest.raises(ValueError, match=r"id 1000000 is not in the vocabulary \(ids 0 \.\. 199\)"):
        tok.id_to_token(10**6)
    tok.save(tmp_path / "uni.json")
    saved = json.loads((tmp_path / "uni.json").read_text())
    saved["pieces"], saved["scores"] = saved["pieces"][:50], saved["scores"][:50]  # cut, consistently
    (tmp_path / "cut.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="does not match the sha256 it was saved with"):
        UnigramTokenizer.load(tmp_path / "cut.json")
    del saved["sha256"]  # without the record (and allowed so), the structure is still checked
    saved["scores"] = saved["scores"][:40]
    (tmp_path / "uneven.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="not a complete 'unigram' tokenizer.*50 pieces but 40 scores"):
        with pytest.warns(UserWarning, match="no sha256"):
            UnigramTokenizer.load(tmp_path / "uneven.json", allow_missing_sha256=True)
    bpe = BPETokenizer().train(text[:5_000], 300)
    bpe.save(tmp_path / "bpe.json")
    state = json.loads((tmp_path / "bpe.json").read_text())
    del state["merges"], state["sha256"]
    (tmp_path / "no_merges.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="not a complete 'bpe' tokenizer: KeyError: 'merges'"):
        with pytest.warns(UserWarning, match="no sha256"):
            BPETokenizer.load(tmp_path / "no_merges.json", allow_missing_sha256=True)
    assert BPETokenizer.load(tmp_path / "bpe.json").encode(text[:500]) == bpe.encode(text[:500])


def _without_sha256(tok, path, edit):
    """Save ``tok`` to ``path`` as an older llmedu did (no sha256), after ``edit(state)`` changed it by hand."""
    tok.save(path)
    state = json.loads(path.read_text(encoding="utf-8"))
    del state["sha256"]
    edit(state)
    path.write_text(json.dumps(state), encoding="utf-8")


def test_a_file_without_its_sha256_is_refused_unless_allowed(text, tmp_path):
    """Without the checksum an edit cannot be seen: a Unigram model cut to 3 pieces would encode everything as
    <unk>, a WordPiece vocabulary reversed would give other ids. Refused, or loaded with a warning when asked."""
    unigram = UnigramTokenizer().train(text[:5_000], 200)
    _without_sha256(unigram, tmp_path / "uni.json", lambda s: s.update(pieces=s["pieces"][:3], scores=s["scores"][:3]))
    with pytest.raises(ValueError, match=r"uni\.json has no sha256 .* allow_missing_sha256=True"):
        UnigramTokenizer.load(tmp_path / "uni.json")
    with pytest.warns(UserWarning, match=r"uni\.json has no sha256"):
        cut = UnigramTokenizer.load(tmp_path / "uni.json", allow_missing_sha256=True)
    assert cut.vocab_size < unigram.vocab_size  # what the opt-out lets through: the edited file, as it is
    wordpiece = WordPieceTokenizer().train(text[:5_000], 200)
    _without_sha256(wordpiece, tmp_path / "wp.json", lambda s: s.update(vocab=s["vocab"][::-1]))
    with pytest.raises(ValueError, match=r"wp\.json has no sha256"):
        WordPieceTokenizer.load(tmp_path / "wp.json")
    bpe = BPETokenizer().train(text[:5_000], 300)
    _without_sha256(bpe, tmp_path / "bpe.json", lambda s: None)
    with pytest.raises(ValueError, match=r"bpe\.json has no sha256"):
        BPETokenizer.load(tmp_path / "bpe.json")
    with pytest.warns(UserWarning, match="no sha256"):
        assert BPETokenizer.load(tmp_path / "bpe.json", allow_missing_sha256=True).merges == bpe.merges


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram"])
def test_a_file_not_utf8_or_cut_short_is_named(kind, text, tmp_path):
    make = {"bpe": BPETokenizer, "wordpiece": WordPieceTokenizer, "unigram": UnigramTokenizer}[kind]
    path = tmp_path / f"{kind}.json"
    make().train(text[:5_000], 300).save(path)
    data = path.read_bytes()
    (tmp_path / "latin1.json").write_bytes(data[:40] + b"\xe9" + data[40:])  # a Latin-1 byte in a UTF-8 file
    with pytest.raises(ValueError, match=r"latin1\.json is not a saved tokenizer: byte 40 is not UTF-8"):
        make.load(tmp_path / "latin1.json")
    (tmp_path / "cut.json").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.json is not a saved tokenizer: invalid JSON, cut short"):
        make.load(tmp_path / "cut.json")


def test_gpt2_files_not_utf8_are_named(tmp_path):
    files = reference_files("gpt2")
    (tmp_path / "vocab.bpe").write_bytes(b"#version: 0.2\n\xc4\xa0 t\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"vocab\.bpe is not a GPT-2 vocab\.bpe: byte \d+ is not UTF-8"):
        BPETokenizer.from_gpt2(files["encoder.json"], tmp_path / "vocab.bpe")
    (tmp_path / "encoder.json").write_bytes(b'{"\xff": 0}')
    with pytest.raises(ValueError, match=r"encoder\.json is not a GPT-2 encoder\.json: byte 2 is not UTF-8"):
        BPETokenizer.from_gpt2(tmp_path / "encoder.json", files["vocab.bpe"])


# -- streaming: encode_iterable ---------------------------------------------------------------------
TRICKY = (  # what breaks naive line-by-line encoding: runs of newlines, indentation, tabs, specials
    "def f(x):\n    return x\n\n\n\n  indented <|endoftext|> [MASK] line\n\t\ttabs  two  spaces \u00a0nbsp\u3000ideo\n"
)


def _chunks(text: str, seed: int = 0) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 40)
        out.append(text[i : i + n])
        i += n
    return out


def test_encode_iterable_equals_encode_of_the_whole_text(exported, text):
    """Lines with their newlines (as a file yields them), random chunks, single characters: the same ids."""
    kind, ours, _ = exported
    for sample in (text[:50_000], TRICKY + "".join(hard_strings()) + varied_text()[:5_000]):
        whole = ours.encode(sample)
        assert list(ours.encode_iterable(sample.splitlines(keepends=True))) == whole, kind
        assert list(ours.encode_iterable(_chunks(sample), chunk_chars=64)) == whole, kind  # cut often
        assert list(ours.encode_iterable(iter(sample[:3_000]), chunk_chars=1)) == ours.encode(sample[:3_000])
    assert list(ours.encode_iterable([])) == ours.encode("")  # nothing, or [CLS] [SEP] for WordPiece


@pytest.fixture(scope="module")
def gpt2():
    files = reference_files("gpt2")
    return BPETokenizer.from_gpt2(files["encoder.json"], files["vocab.bpe"])


def test_encoding_line_by_line_would_not_be_the_same(exported, gpt2, text):
    """Why encode_iterable buffers: GPT-2's regex glues newlines and indentation (and GPT-2's vocabulary,
    unlike our small one, has merges of whitespace, so the ids differ too), Metaspace words run across
    newlines, WordPiece frames every call with [CLS] ... [SEP]."""
    kind, ours, _ = exported
    tok, sample = (gpt2, TRICKY + text[:5_000]) if kind == "bpe" else (ours, text[:5_000])
    lines = sample.splitlines(keepends=True)
    assert [i for line in lines for i in tok.encode(line)] != tok.encode(sample)
    assert list(tok.encode_iterable(lines)) == tok.encode(sample)


def test_encode_iterable_refuses_bytes_and_spaced_special_tokens(text):
    tok = BPETokenizer().train(text[:5_000], 300)
    with pytest.raises(TypeError, match="takes str .open files in text mode., got bytes"):
        list(tok.encode_iterable([b"bytes from a file opened in binary mode"]))
    with pytest.raises(ValueError, match="chunk_chars must be a positive int"):
        list(tok.encode_iterable(["a"], chunk_chars=0))
    spaced = BPETokenizer().train(text[:5_000], 300, special_tokens=["<|end of text|>"])
    with pytest.raises(ValueError, match=r"special token '<\|end of text\|>' holds a space"):
        list(spaced.encode_iterable(["a b"]))


def test_encode_iterable_streams_a_large_file_in_flat_memory(text, tmp_path):
    """~8 MB of text through encode_iterable(open(path)): Python's peak allocation stays ~100 KB.

    (A 20 MB file would take ~15-30 s on 2 busy CPU cores under tracemalloc, which slows every
    allocation down ~3x; 8 MB keeps the test at ~6-10 s and the point the same.)
    """
    corpus = load_corpus("shakespeare")[:200_000]
    corpus = corpus[: corpus.rindex("\n") + 1]  # whole lines: one "\n" ends each copy, a letter starts the next
    tok = BPETokenizer().train(corpus, 2_000)  # a small, fast vocabulary
    tok.encode(corpus)  # warm the cache of pieces, so that the cache's growth is not counted below
    path = tmp_path / "big.txt"
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(40):
            f.write(corpus)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        with open(path, encoding="utf-8") as f:
            n_ids = sum(1 for _ in tok.encode_iterable(f))  # counted, never stored
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n_ids == 40 * len(tok.encode(corpus))  # no token spans the joins of the copies
    assert size > 7_000_000
    assert peak < min(size / 16, 1_000_000), f"peak {peak:,} bytes for a file of {size:,} bytes"
