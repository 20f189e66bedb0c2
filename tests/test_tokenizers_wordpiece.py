"""WordPiece against BertTokenizerFast with the bert-base-uncased vocabulary, and its trainer."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from transformers import BertTokenizerFast, PreTrainedTokenizerFast

from llmedu.checks.tokenizers import hard_strings, varied_text
from llmedu.data import load_corpus, reference_files
from llmedu.tokenizers import WordPieceTokenizer
from llmedu.tokenizers.basic import basic_tokenize, normalize


@pytest.fixture(scope="module")
def bert():
    return WordPieceTokenizer.from_vocab(reference_files("bert-base-uncased")["vocab.txt"])


@pytest.fixture(scope="module")
def hf_bert():
    tok = BertTokenizerFast.from_pretrained(reference_files("bert-base-uncased")["vocab.txt"].parent)
    assert tok("Hello world")["input_ids"] == [101, 7592, 2088, 102], "the reference tokenizer itself is not BERT's"
    return tok


def test_bert_known_encoding(bert):
    assert bert.encode("Hello world") == [101, 7592, 2088, 102]
    assert bert.encode("Hello world", add_special_tokens=False) == [7592, 2088]
    assert bert.vocab_size == 30522
    assert bert.tokens("Tokenization is 中文") == ["[CLS]", "token", "##ization", "is", "中", "文", "[SEP]"]


def test_bert_parity_on_varied_text(bert, hf_bert):
    lines = varied_text().split("\n") + hard_strings() + ["[MASK] and [CLS] in text", "a" * 100, "a" * 101]
    assert sum(len(s.encode("utf-8")) for s in lines) >= 100_000
    different = [s for s in lines if bert.encode(s) != hf_bert(s)["input_ids"]]
    assert not different, f"{len(different)} of {len(lines)} lines differ, the first: {different[0]!r}"
    text = "\n".join(lines)  # and once as one long text, without [CLS]/[SEP]
    assert bert.encode(text, add_special_tokens=False) == hf_bert(text, add_special_tokens=False)["input_ids"]


def test_basic_tokenizer_steps():
    assert normalize("Héllo  WÖRLD\t中文") == "hello  world  中  文 "
    assert normalize("Héllo", lowercase=False) == "Héllo"
    assert basic_tokenize("hello, world!! it's") == ["hello", ",", "world", "!", "!", "it", "'", "s"]


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("shakespeare")[:120_000], load_corpus("shakespeare", "validation")[:40_000]


@pytest.fixture(scope="module")
def trained(corpus):
    return WordPieceTokenizer().train(corpus[0], 1200)


def test_first_merge_has_the_largest_likelihood_gain():
    words = ["hug"] * 10 + ["pug"] * 5 + ["pun"] * 12 + ["bun"] * 4 + ["hugs"] * 5
    tok = WordPieceTokenizer().train(" ".join(words), 5 + 7 + 1)  # specials, h p b ##u ##g ##n ##s, one merge
    split = [[w[0]] + ["##" + c for c in w[1:]] for w in words]
    pairs = Counter(p for s in split for p in zip(s, s[1:]))
    symbols = Counter(c for s in split for c in s)
    total = sum(symbols.values())
    gain = {p: n * math.log(n * total / (symbols[p[0]] * symbols[p[1]])) for p, n in pairs.items()}
    assert max(gain, key=gain.get) == ("##u", "##g") and tok.tokens_by_id[-1] == "##ug"
    # the unweighted score count(ab) / (count(a) count(b)) would have picked the rarer ('##g', '##s')
    assert max(pairs, key=lambda p: pairs[p] / (symbols[p[0]] * symbols[p[1]])) == ("##g", "##s")


def naive_wordpiece_vocab(text: str, vocab_size: int) -> list[str]:
    """The same trainer with every pair and symbol recounted from scratch before each merge."""
    words = Counter(basic_tokenize(normalize(text)))
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens += sorted({w[0] for w in words} | {"##" + c for w in words for c in w[1:]})
    split = {w: [w[0]] + ["##" + c for c in w[1:]] for w in words}
    while len(tokens) < vocab_size:
        pairs, symbols = Counter(), Counter()
        for w, n in words.items():
            for s in split[w]:
                symbols[s] += n
            for p in zip(split[w], split[w][1:]):
                pairs[p] += n
        if not pairs:
            break
        total, rank = sum(symbols.values()), {t: i for i, t in enumerate(tokens)}
        a, b = max(
            pairs,
            key=lambda p: (
                pairs[p] * math.log(pairs[p] * total / (symbols[p[0]] * symbols[p[1]])),
                pairs[p],
                -rank[p[0]],
                -rank[p[1]],
            ),
        )
        merged = a + b[2:]
        if merged not in rank:
            tokens.append(merged)
        for w, s in split.items():
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == (a, b):
                    out.append(merged)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            split[w] = out
    return tokens


def test_incremental_training_equals_naive_recount():
    text = load_corpus("kjv")[:15_000]
    assert WordPieceTokenizer().train(text, 400).tokens_by_id == naive_wordpiece_vocab(text, 400)


def test_trained_tokenizer_exports_to_transformers(corpus, trained, tmp_path):
    assert trained.vocab_size == 1200
    text = corpus[1]
    trained.save(tmp_path / "wp.json")
    assert WordPieceTokenizer.load(tmp_path / "wp.json").encode(text) == trained.encode(text)
    trained.save_hf(tmp_path / "tokenizer.json")
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for s in text.split("\n\n")[:300] + hard_strings():
        assert fast(s)["input_ids"] == trained.encode(s), s
    sample = "now, fair hippolyta, our nuptial hour draws on apace"
    assert trained.decode(trained.encode(sample, add_special_tokens=False)) == sample


def test_bad_input_is_a_clear_error(tmp_path, bert):
    with pytest.raises(ValueError, match="empty"):
        WordPieceTokenizer().train([], 100)
    with pytest.raises(ValueError, match="smaller than the special tokens plus the characters"):
        WordPieceTokenizer().train("abcdefghij klmnop", 10)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        bert.decode([30522])
    with pytest.raises(RuntimeError, match="no vocabulary"):
        WordPieceTokenizer().encode("hello")
    (tmp_path / "gap.txt").write_text("[PAD]\n[UNK]\n\n[CLS]\n[SEP]\n")
    with pytest.raises(ValueError, match="line 3"):
        WordPieceTokenizer.from_vocab(tmp_path / "gap.txt")
    (tmp_path / "no_unk.txt").write_text("[PAD]\n[CLS]\n[SEP]\nhello\n")
    with pytest.raises(ValueError, match=r"lacks the special token \[UNK\]"):
        WordPieceTokenizer.from_vocab(tmp_path / "no_unk.txt")
    (tmp_path / "twice.txt").write_text("[UNK]\n[CLS]\n[SEP]\nhello\nhello\n")
    with pytest.raises(ValueError, match="'hello' twice"):
        WordPieceTokenizer.from_vocab(tmp_path / "twice.txt")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(ValueError, match="not a UTF-8 vocab.txt"):
        WordPieceTokenizer.from_vocab(tmp_path / "binary.txt")


def test_bert_exported_by_us_loads_in_transformers(bert, hf_bert, tmp_path):
    bert.save_hf(tmp_path / "tokenizer.json")
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    lines = varied_text().split("\n")[::7]
    assert [fast(s)["input_ids"] for s in lines] == [hf_bert(s)["input_ids"] for s in lines]
