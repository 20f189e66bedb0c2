"""Packing and MLM masking: no padding, nothing lost, BERT's 80/10/10, and batches that replay exactly."""

import pytest
import torch

from llmedu.data.packing import MLMBatches, mask_tokens, pack, packed_rows, train_tokenizer
from llmedu.tokenizers import WordPieceTokenizer

CLS, SEP, MASK = 2, 3, 4


def test_pack_keeps_every_token_in_order_without_padding():
    docs = [list(range(10, 10 + n)) for n in (5, 9, 3, 14)]  # 31 tokens + 4 [SEP] = 35
    rows = pack(docs, seq_len=8, cls_id=CLS, sep_id=SEP)  # 7 stream tokens per row: 5 rows
    assert rows.shape == (5, 8)
    assert (rows[:, 0] == CLS).all()
    stream = [t for d in docs for t in (*d, SEP)]
    assert rows[:, 1:].flatten().tolist() == stream[:35]  # the stream, cut into rows, nothing reordered
    assert 0 not in rows.tolist()  # no [PAD] anywhere


def test_pack_drops_only_the_incomplete_tail():
    rows = pack([[7] * 20], seq_len=8, cls_id=CLS, sep_id=SEP)  # 21 stream tokens: 3 full rows of 7
    assert rows.shape == (3, 8)
    with pytest.raises(ValueError, match="seq_len"):
        pack([[7]], seq_len=1, cls_id=CLS, sep_id=SEP)


def test_masking_rates_and_labels():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (256, 128), generator=g)
    ids[:, 0] = CLS
    inputs, labels = mask_tokens(ids, 0.15, MASK, 1000, [0, 1, CLS, SEP, MASK], g)
    chosen = labels != -100
    assert not chosen[:, 0].any(), "special tokens are never chosen"
    assert (labels[chosen] == ids[chosen]).all(), "labels are the original ids"
    assert (inputs[~chosen] == ids[~chosen]).all(), "unchosen tokens are untouched"
    n = chosen.sum().item()
    rate = n / (256 * 127)
    masked = (inputs[chosen] == MASK).float().mean().item()
    kept = (inputs[chosen] == ids[chosen]).float().mean().item()  # includes random draws that hit the same id
    # 32,512 Bernoulli draws: the standard error of the rate is 0.002, of the fractions about 0.004
    assert abs(rate - 0.15) < 0.01 and abs(masked - 0.8) < 0.02 and abs(kept - 0.1) < 0.02, (rate, masked, kept)


@pytest.mark.parametrize("kwargs, match", [(dict(rate=0.0), "rate"), (dict(rate=0.15, mask=0.9, random=0.2), "sum")])
def test_masking_rejects_bad_fractions(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mask_tokens(
            torch.zeros(2, 4, dtype=torch.long),
            mask_id=MASK,
            vocab_size=10,
            special_ids=[0],
            generator=torch.Generator(),
            **kwargs,
        )


@pytest.fixture(scope="module")
def tokenizer():
    return WordPieceTokenizer().train("the cat sat on the mat. the dog sat on the log. " * 20, 30)


def test_batches_replay_exactly_and_cover_an_epoch(tokenizer):
    rows = torch.arange(40 * 16).reshape(40, 16) % 50 + 10
    rows[:, 0] = tokenizer.vocab["[CLS]"]
    batches = MLMBatches(rows, batch_size=8, tokenizer=tokenizer, seed=3)
    first = [batches(i) for i in range(7)]
    again = MLMBatches(rows, batch_size=8, tokenizer=tokenizer, seed=3)
    for i in (6, 2, 0):  # any order, a fresh object: the same batch (what an exact resume needs)
        assert torch.equal(again(i)["input_ids"], first[i]["input_ids"])
        assert torch.equal(again(i)["labels"], first[i]["labels"])
    seen = torch.cat([torch.where(b["labels"] != -100, b["labels"], b["input_ids"]) for b in first[:5]])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, rows.tolist())), "epoch 0 visits every row once"


def test_too_small_a_corpus_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="too small for one batch"):
        MLMBatches(torch.zeros(3, 16, dtype=torch.long), batch_size=8, tokenizer=tokenizer)


def test_real_corpus_rows_are_cached(tmp_path):
    tok = train_tokenizer(["kjv"], 300, sample_chars=30_000, cache=tmp_path)
    rows = packed_rows(tok, ["kjv"], "train", seq_len=32, max_chars=20_000, cache=tmp_path, progress=False)
    assert rows.shape[1] == 32 and len(rows) > 50 and (rows[:, 0] == tok.vocab["[CLS]"]).all()
    assert (rows != tok.vocab["[PAD]"]).all()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert any(f.startswith("rows-train") for f in files) and any(f.startswith("wordpiece") for f in files)
    again = packed_rows(tok, ["kjv"], "train", seq_len=32, max_chars=20_000, cache=tmp_path, progress=False)
    assert torch.equal(rows, again)
    text = tok.decode(rows[0, 1:].tolist())
    assert "god" in " ".join(tok.decode(r[1:].tolist()) for r in rows[:5]).lower(), text
