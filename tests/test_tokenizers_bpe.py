"""Byte-level BPE against GPT-2 (transformers and tiktoken) and against Hugging Face's BPE trainer."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast

from llmedu.checks.tokenizers import hard_strings, varied_text
from llmedu.data import load_corpus, reference_files
from llmedu.tokenizers import BPETokenizer
from llmedu.tokenizers.bpe import GPT2_PATTERN, bytes_to_unicode
from llmedu.tokenizers.pairs import merge_pair


@pytest.fixture(scope="module")
def gpt2():
    files = reference_files("gpt2")
    return BPETokenizer.from_gpt2(files["encoder.json"], files["vocab.bpe"])


@pytest.fixture(scope="module")
def hf_gpt2():
    tok = GPT2TokenizerFast.from_pretrained(reference_files("gpt2")["vocab.json"].parent)
    assert tok("Hello world")["input_ids"] == [15496, 995], "the reference tokenizer itself is not GPT-2's"
    return tok


def test_gpt2_known_encoding(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.vocab_size == 50257 and gpt2.special_tokens == {"<|endoftext|>": 50256}
    assert gpt2.encode("a<|endoftext|>b") == [64, 50256, 65]


def test_gpt2_parity_with_transformers_on_varied_text(gpt2, hf_gpt2):
    text = varied_text()
    assert len(text.encode("utf-8")) >= 100_000
    ours, theirs = gpt2.encode(text), hf_gpt2(text)["input_ids"]
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert ours == theirs, f"first difference at token {first} of {len(theirs)}"
    for s in hard_strings():  # one at a time too: the start and end of a text are edge cases
        assert gpt2.encode(s) == hf_gpt2(s)["input_ids"], s


def test_gpt2_parity_with_tiktoken(gpt2):
    # tiktoken's own GPT-2 would be downloaded; build the same Encoding from the published files.
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    encoder = json.loads(reference_files("gpt2")["encoder.json"].read_text(encoding="utf-8"))
    ranks = {bytes(byte_of[c] for c in token): i for token, i in encoder.items() if token != "<|endoftext|>"}
    enc = tiktoken.Encoding(
        "gpt2-local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256}
    )
    text = varied_text()
    assert gpt2.encode(text) == enc.encode(text, allowed_special="all")


@settings(max_examples=150, deadline=None, database=None)  # no .hypothesis/ folder in the repository
@given(st.text(max_size=60))
def test_round_trip_on_arbitrary_text(gpt2, text):
    # st.text draws from every Unicode code point (surrogates aside), so its UTF-8 covers every byte value
    assert gpt2.decode(gpt2.encode(text)) == text


def naive_bpe_merges(chunks: Counter, vocab_size: int) -> list[tuple[int, int]]:
    """The textbook trainer: recount every pair of every word before each merge."""
    words = {tuple(c.encode("utf-8")): n for c, n in chunks.items()}
    tokens = [bytes([b]) for b in range(256)]
    merges = []
    while len(tokens) < vocab_size:
        counts = Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                counts[pair] += n
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))  # most frequent; ties to the smaller pair
        merged = tokens[pair[0]] + tokens[pair[1]]
        if merged not in tokens:
            tokens.append(merged)
        merges.append(pair)
        words = {tuple(merge_pair(list(w), pair, tokens.index(merged))): n for w, n in words.items()}
    return merges


def test_incremental_training_equals_naive_recount():
    text = load_corpus("kjv")[:30_000]
    ours = BPETokenizer().train(text, 256 + 300 + 1)
    chunks = Counter(ours.pattern.findall(text))
    assert list(ours.merges) == naive_bpe_merges(chunks, 256 + 300)


def test_library_naive_trainer_is_the_reference_the_fast_one_equals():
    """``train_naive`` (recount every pair before each merge) and ``train`` (incremental counts, a heap) learn the
    same merges, with the same ids, in the same order, on real text; and the naive one is the textbook loop above."""
    text = load_corpus("shakespeare")[:15_000]
    fast = BPETokenizer().train(text, 560)
    naive = BPETokenizer().train_naive(text, 560)
    assert len(fast.merges) >= 250  # enough merges that the order of ties and of rarer pairs is exercised
    assert list(naive.merges.items()) == list(fast.merges.items())
    assert naive.special_tokens == fast.special_tokens and naive.vocab == fast.vocab
    assert list(naive.merges) == naive_bpe_merges(Counter(naive.pattern.findall(text)), 560 - 1)
    sample = load_corpus("shakespeare", "validation")[:3_000]
    assert naive.encode(sample) == fast.encode(sample)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("shakespeare")[:200_000], load_corpus("shakespeare", "validation")[:60_000]


@pytest.fixture(scope="module")
def trained(corpus):
    return BPETokenizer().train(corpus[0], 1000)


def test_trained_vocabulary_and_compression_match_hf_trainer(corpus, trained):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(
        [corpus[0]],
        trainers.BpeTrainer(
            vocab_size=1000,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    assert trained.vocab_size == hf.get_vocab_size() == 1000
    ours, theirs = len(trained.encode(corpus[1])), len(hf.encode(corpus[1]).ids)
    # Same algorithm; only the order of ties may differ, so compression must agree within 2%.
    assert abs(ours / theirs - 1) < 0.02, (ours, theirs)


def test_trained_round_trip_save_load_and_hf_export(corpus, trained, tmp_path):
    text = corpus[1][:20_000] + "\n".join(hard_strings())
    assert trained.decode(trained.encode(text)) == text
    trained.save(tmp_path / "bpe.json")
    assert BPETokenizer.load(tmp_path / "bpe.json").encode(text) == trained.encode(text)
    trained.save_hf(tmp_path / "tokenizer.json")
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert len(fast) == trained.vocab_size
    assert fast(text)["input_ids"] == trained.encode(text)
    assert fast.decode(trained.encode(text)) == text


def test_bad_input_is_a_clear_error(tmp_path, gpt2):
    with pytest.raises(ValueError, match="empty"):
        BPETokenizer().train(["", "  \n"], 300)
    with pytest.raises(ValueError, match="smaller than 256 bytes"):
        BPETokenizer().train("some text", 200)
    with pytest.warns(UserWarning, match="264 entries, not the 400 asked for"):
        BPETokenizer().train("low lower lowest", 400)  # a tiny corpus runs out of pairs to merge
    with pytest.raises(ValueError, match="not in the vocabulary"):
        gpt2.decode([50257])
    files = reference_files("gpt2")
    (tmp_path / "broken.json").write_text('{"a": 1,')
    with pytest.raises(ValueError, match="not a GPT-2 encoder.json"):
        BPETokenizer.from_gpt2(tmp_path / "broken.json", files["vocab.bpe"])
    encoder = json.loads(files["encoder.json"].read_text(encoding="utf-8"))
    del encoder["Ġ"]
    (tmp_path / "no_space.json").write_text(json.dumps(encoder))
    with pytest.raises(ValueError, match="lacks the byte token 'Ġ'"):
        BPETokenizer.from_gpt2(tmp_path / "no_space.json", files["vocab.bpe"])
    (tmp_path / "bad.bpe").write_text("#version: 0.2\nĠ t\nĠt he extra\n")
    with pytest.raises(ValueError, match="merge 2: expected two tokens"):
        BPETokenizer.from_gpt2(files["encoder.json"], tmp_path / "bad.bpe")
    (tmp_path / "unknown.bpe").write_text("#version: 0.2\nĠ t\nq z\n")
    with pytest.raises(ValueError, match="merge 2 .* 'qz' is not in"):
        BPETokenizer.from_gpt2(files["encoder.json"], tmp_path / "unknown.bpe")
    (tmp_path / "other.json").write_text('{"kind": "wordpiece", "format": 1}')
    with pytest.raises(ValueError, match="not a 'bpe' one"):
        BPETokenizer.load(tmp_path / "other.json")
    cut = "\n".join(files["vocab.bpe"].read_text(encoding="utf-8").splitlines()[:1000])  # at a line boundary
    (tmp_path / "cut.bpe").write_text(cut, encoding="utf-8")
    with pytest.raises(ValueError, match=r"49\d{3} tokens .* made by no merge .* \(999 merges\).*cut short"):
        BPETokenizer.from_gpt2(files["encoder.json"], tmp_path / "cut.bpe")


def test_gpt2_exported_by_us_loads_in_transformers(gpt2, tmp_path):
    gpt2.save_hf(tmp_path / "tokenizer.json")
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = varied_text()
    assert len(fast) == 50257 and fast(text)["input_ids"] == gpt2.encode(text)


# -- ties: the rule that makes training deterministic ---------------------------------------------------------
TIED = ["ab", "yz", "ab", "yz", "yz", "ab"]  # (a, b) and (y, z) occur three times each: a tie from the first merge


@pytest.mark.parametrize("train", ["train", "train_naive"])
def test_a_tie_goes_to_the_smaller_ids_or_to_the_greater_bytes(train):
    by_ids = getattr(BPETokenizer(), train)(TIED, 256 + 2 + 1)
    by_bytes = getattr(BPETokenizer(), train)(TIED, 256 + 2 + 1, tie_break="bytes")
    assert list(by_ids.merges) == [(ord("a"), ord("b")), (ord("y"), ord("z"))]
    assert list(by_bytes.merges) == [(ord("y"), ord("z")), (ord("a"), ord("b"))]


def test_the_bytes_rule_compares_whole_tokens_not_ids():
    # After 'zz' (id 256) is learned, (256, 'a') and ('b', 'c') tie. By ids (98, 99) < (256, 97) wins;
    # by bytes b'zz' > b'b' makes (zz, a) win: the two rules must disagree here.
    texts = ["zz"] * 9 + ["zza", "zza", "bc", "bc"]
    by_ids = BPETokenizer().train(texts, 256 + 3 + 1)
    by_bytes = BPETokenizer().train(texts, 256 + 3 + 1, tie_break="bytes")
    assert [by_ids.vocab[i] for i in by_ids.merges.values()] == [b"zz", b"bc", b"zza"]
    assert [by_bytes.vocab[i] for i in by_bytes.merges.values()] == [b"zz", b"zza", b"bc"]


def test_both_trainers_agree_under_the_bytes_rule_on_real_text():
    text = load_corpus("shakespeare")[:15_000]
    fast = BPETokenizer().train(text, 560, tie_break="bytes")
    naive = BPETokenizer().train_naive(text, 560, tie_break="bytes")
    assert list(naive.merges.items()) == list(fast.merges.items())
    # and the textbook loop with the greater-bytes rule learns the same token strings in the same order
    words = Counter(tuple(bytes([b]) for b in c.encode("utf-8")) for c in naive.pattern.findall(text))
    expected = []
    for _ in range(len(naive.merges)):
        counts = Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                counts[pair] += n
        best = max(counts, key=lambda p: (counts[p], p))  # most frequent; ties to the greater pair of bytes
        expected.append(best[0] + best[1])
        merged = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    assert [naive.vocab[i] for i in naive.merges.values()] == expected
    assert list(fast.merges) != list(BPETokenizer().train(text, 560).merges)  # the rule matters on real text


def test_hf_trainer_breaks_ties_by_smaller_ids_as_ours_does_on_letters():
    """HF's BpeTrainer takes the smaller pair of its own ids; for letters these follow byte order, so on a corpus of
    letter-only words full of ties it learns our "ids" merges exactly, and not our "bytes" ones."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 6))) for _ in range(400)]
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=256 + 1 + 60,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    theirs = [
        tuple(pair.split(" ")) if isinstance(pair, str) else tuple(pair)
        for pair in json.loads(hf.to_str())["model"]["merges"]
    ]
    theirs = [(a + b).encode("utf-8") for a, b in theirs]  # letters map to themselves in GPT-2's byte-to-unicode map
    by_ids = BPETokenizer().train(texts, 256 + 1 + 60)
    by_bytes = BPETokenizer().train(texts, 256 + 1 + 60, tie_break="bytes")
    assert [by_ids.vocab[i] for i in by_ids.merges.values()] == theirs
    assert [by_bytes.vocab[i] for i in by_bytes.merges.values()] != theirs


def test_an_unknown_tie_rule_is_refused():
    with pytest.raises(ValueError, match="tie_break='smallest' is not a rule"):
        BPETokenizer().train(TIED, 260, tie_break="smallest")
