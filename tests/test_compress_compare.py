"""The measurement helpers of lesson 22's table: bytes, the int8 embedding, pruned copies, the Pareto front."""

import copy
import statistics

import pytest
import torch
from safetensors.torch import save

from llmedu.compress import compare
from llmedu.compress.pruning import is_nm_sparse, linear_weights, sparsity

IDS = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(0))


def test_int8_embedding_is_within_half_a_step_of_each_row(tiny_bert):
    table = tiny_bert.bert.embeddings.word_embeddings
    q = compare.Int8Embedding(table)
    step = table.weight.abs().amax(dim=1) / 127  # (V,)
    error = (q(IDS) - table(IDS)).abs()  # (B, T, d)
    assert (error <= step[IDS][..., None] / 2 + 1e-7).all()  # rounding: half a step, plus fp32 slack
    assert q.weight_q.dtype == torch.int8
    from llmedu.compress import int8

    assert compare.Int8Embedding is int8.Int8Embedding  # it lives in int8.py; the old import still works
    with pytest.raises(TypeError, match="quantizes an nn.Embedding"):
        int8.Int8Embedding(torch.nn.Linear(4, 4))


def test_file_bytes_is_the_safetensors_length_or_torch_save(tiny_bert):
    size, fmt = compare.file_bytes(tiny_bert)
    assert fmt == "safetensors" and size == len(save({k: v.contiguous() for k, v in tiny_bert.state_dict().items()}))
    assert compare.file_bytes(compare.to_bf16(tiny_bert))[0] < 0.55 * size  # 2 bytes a number plus the header
    _, fmt = compare.file_bytes(compare.torch_ao_int8(tiny_bert))
    assert fmt == "torch.save"  # packed weights are not tensors


def test_pruned_copies_leave_the_base_alone(tiny_bert):
    before = copy.deepcopy(tiny_bert.state_dict())
    nm = compare.nm_pruned(tiny_bert)
    assert all(is_nm_sparse(w) for w in linear_weights(nm).values())
    n = sum(w.numel() for w in linear_weights(tiny_bert).values())
    assert sparsity(linear_weights(compare.magnitude_pruned(tiny_bert, 0.3))) == round(0.3 * n) / n
    heads = compare.heads_pruned(tiny_bert, torch.tensor([[1.0, 2, 3, 4], [9, 9, 9, 9]]), 0.5)  # layer 0 loses all 4
    assert heads.bert.encoder.layer[0].attention.self.query.out_features == 8  # one head of 8 kept
    assert all(torch.equal(v, before[k]) for k, v in tiny_bert.state_dict().items())


def test_finetune_is_seeded_so_a_row_is_the_same_model_in_every_cell():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    base = BertForSequenceClassification(config)  # dropout 0.1 in training: the draws the seed must fix
    batch = dict(input_ids=IDS, attention_mask=torch.ones_like(IDS), labels=torch.tensor([0, 1, 0]))

    class OneBatch:
        def __getitem__(self, i):
            return batch

    def tuned(seed):
        return compare.finetune(copy.deepcopy(base), OneBatch(), steps=3, lr=1e-2, seed=seed).state_dict()

    a, b, c = tuned(3), tuned(3), tuned(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # the seed reaches the dropout masks


def test_pareto_front():
    rows = [compare.Row(m, "", b, 0, 0, a) for m, b, a in [("a", 10, 0.9), ("b", 5, 0.8), ("c", 6, 0.7), ("d", 1, 0.5)]]
    assert [r.method for r in compare.pareto_front(rows)] == ["a", "b", "d"]


def test_bag_of_words_gradient_matches_autograd_and_separates_easy_text():
    from llmedu.compress.baselines import BagOfWords, majority_accuracy

    texts = ["good fun film", "good and warm", "bad dull film", "dull and bad", "good good", "bad bad"]
    labels = [1, 1, 0, 0, 1, 0]
    bow = BagOfWords(min_count=1, l2=1e-3, steps=50).fit(texts, labels)
    assert bow.predict(["a good film", "a dull film"]).tolist() == [1, 0]
    x = bow.features(texts).to_dense()  # (6, V)
    w, b = bow.weight.detach().clone().requires_grad_(), bow.bias.detach().clone().requires_grad_()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, torch.tensor(labels).float())
    (loss + 1e-3 * w.pow(2).sum()).backward()
    assert w.grad.abs().max() < 1e-4  # L-BFGS reached the optimum of the same objective (fp32)
    assert majority_accuracy([1, 1, 0], [0, 1, 1, 1]) == 0.75


def test_nf4_copy_is_close_and_smaller(tiny_bert):
    nf4 = compare.nf4_linears(tiny_bert)
    with torch.no_grad():
        a, b = nf4.bert(input_ids=IDS).last_hidden_state, tiny_bert.bert(input_ids=IDS).last_hidden_state
    relative = (a - b).norm() / b.norm()  # LayerNorm outputs, O(1)
    assert 0 < relative < 0.2  # 4 bits with 16 levels per block: about 10% per weight, not exact
    assert compare.file_bytes(nf4)[0] < compare.file_bytes(tiny_bert)[0]


def test_lesson_base_takes_the_full_recipe_when_cached_and_says_so(monkeypatch, capsys):
    from llmedu.compress import finetuned

    monkeypatch.setattr(finetuned, "finetuned_classifier", lambda recipe, verbose=True: f"model of {recipe.key()}")
    monkeypatch.setattr(finetuned, "shipped_base", lambda: "the shipped model")
    monkeypatch.setattr(finetuned, "is_cached", lambda recipe: False)
    assert finetuned.lesson_base(fast=True) == ("the shipped model", finetuned.SHIPPED)  # nothing trained
    assert "fast mode's shipped base (the full recipe is not cached)" in capsys.readouterr().out
    assert finetuned.lesson_base(fast=False, verbose=False)[1] == finetuned.Recipe()  # full mode trains it
    monkeypatch.setattr(finetuned, "is_cached", lambda recipe: recipe == finetuned.Recipe())
    model, recipe = finetuned.lesson_base(fast=True)
    assert recipe == finetuned.Recipe() and model == f"model of {recipe.key()}"
    assert "the full recipe" in capsys.readouterr().out
    assert finetuned.SHIPPED.key() != finetuned.Recipe().key()


def test_a_cached_base_counts_only_while_its_checksum_holds(monkeypatch, tmp_path):
    from llmedu.compress import finetuned
    from llmedu.data.cache import write_derived

    monkeypatch.setenv("LLMEDU_DATA", str(tmp_path))
    recipe = finetuned.Recipe(steps=3, seed=7)
    assert not finetuned.is_cached(recipe)
    path = tmp_path / "compress" / f"minilm-rt-{recipe.key()}.safetensors"
    write_derived(path, save({"w": torch.zeros(2)}))
    assert finetuned.is_cached(recipe)
    path.write_bytes(path.read_bytes()[:-1])  # truncated
    assert not finetuned.is_cached(recipe)


class FakeHost:
    """A clock that only stub models move: each call costs its stub's work times the host's slowness then,
    ``slowness(k)`` for the k-th call of the run (warm-ups included), as a machine whose speed drifts."""

    def __init__(self, slowness):
        self.now, self.slowness, self.calls = 0.0, slowness, []

    def __call__(self):
        return self.now


class Stub(torch.nn.Module):
    def __init__(self, name, work, host):
        super().__init__()
        self.name, self.work, self.host = name, work, host

    def forward(self, input_ids, attention_mask):
        self.host.now += self.work * self.host.slowness(len(self.host.calls))
        self.host.calls.append((self.name, input_ids))


BATCH = {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}


def test_paired_latency_cancels_drift_between_pairs():
    # the host runs 3x slower from its 9th call on; the model does exactly twice the reference's work
    host = FakeHost(lambda k: 1.0 if k < 8 else 3.0)
    model, reference = Stub("model", 2.0, host), Stub("reference", 1.0, host)
    timing = compare.paired_latency(model, reference, BATCH, repeats=7, clock=host)
    # paired, every ratio sees one speed; timed apart (all of one, then all of the other) the ratio would be
    # 2 / 3 or 6, and the model's own median would not be the reference's median times 2
    assert timing.ratios == [2.0] * 7 and timing.ratio == timing.ratio_lo == timing.ratio_hi == 2.0
    names = [name for name, _ in host.calls]
    assert names[:2] == ["reference", "model"]  # one warm-up each
    assert names.count("model") == names.count("reference") == 8  # the same repeats for both
    assert all(ids is IDS for _, ids in host.calls)  # the same batch for both
    timed_model = [
        2.0 * (1.0 if k < 8 else 3.0) for k, (name, _) in enumerate(host.calls) if k >= 2 and name == "model"
    ]
    assert timing.median_s == statistics.median(timed_model) and timing.min_s == min(timed_model)


def test_paired_latency_alternates_the_order_so_drift_within_a_pair_shows_as_spread():
    host = FakeHost(lambda k: 1.1**k)  # slower at every call: the second of a pair always pays 10% more
    model, reference = Stub("model", 2.0, host), Stub("reference", 1.0, host)
    timing = compare.paired_latency(model, reference, BATCH, repeats=6, clock=host)
    pairs = [tuple(name for name, _ in host.calls[k : k + 2]) for k in range(2, 14, 2)]
    assert pairs == [("reference", "model"), ("model", "reference")] * 3
    # reference first: 2 x 1.1 = 2.2; model first: 2 / 1.1 = 1.82. The same order every time would give 2.2
    # in every pair: a bias with no spread to warn of it
    assert timing.ratio_lo == pytest.approx(2 / 1.1) and timing.ratio_hi == pytest.approx(2.2)
    assert timing.ratio_lo < 2.0 < timing.ratio_hi


def test_latency_is_the_models_own_times_after_one_warm_up():
    host = FakeHost(lambda k: 1.0 + k)
    median, fastest = compare.latency(Stub("model", 1.0, host), BATCH, repeats=3, clock=host)
    assert (median, fastest) == (3.0, 2.0)  # calls 1, 2, 3 cost 2, 3, 4; call 0 is the warm-up


def test_measure_with_a_reference_fills_the_pair_ratios(tiny_bert):
    class Val:  # two batches of labelled snippets, as finetuned.Batches
        texts = [None] * 6
        labels = [0] * 6

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return {**BATCH, "labels": torch.zeros(3, dtype=torch.long)}

    alone = compare.measure("fp32", "32 bit", tiny_bert, Val(), BATCH, repeats=3)
    assert alone.ratio is None and alone.ratio_lo is None and alone.latency_s > 0
    row = compare.measure("fp32 paired", "32 bit", tiny_bert, Val(), BATCH, repeats=3, reference=tiny_bert)
    assert row.ratio_lo <= row.ratio <= row.ratio_hi and row.latency_min_s <= row.latency_s
    assert (row.bytes, row.accuracy, row.note) == (alone.bytes, alone.accuracy, alone.note)
    # the row keeps one prediction per snippet, in order, and its accuracy is theirs
    from llmedu.compress.finetuned import accuracy

    expected = tiny_bert(input_ids=BATCH["input_ids"], attention_mask=BATCH["attention_mask"]).logits.argmax(-1)
    assert torch.equal(row.predictions, torch.cat([expected, expected]))
    assert row.accuracy == accuracy(tiny_bert, Val()) == float((row.predictions == 0).float().mean())


def test_accuracy_standard_error_by_hand():
    assert compare.accuracy_se(0.8, 1285) == pytest.approx(0.011158, abs=1e-6)  # sqrt(0.16 / 1285)
    assert compare.accuracy_se(0.5, 100) == 0.05 and compare.accuracy_se(1.0, 10) == 0.0
    for p, n in ((1.2, 10), (0.5, 0), (0.5, 2.5)):
        with pytest.raises(ValueError, match="an accuracy in"):
            compare.accuracy_se(p, n)


def test_bad_repeats_and_a_reference_too_fast_to_time():
    host = FakeHost(lambda k: 1.0)
    for repeats in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="repeats must be a positive int"):
            compare.paired_latency(Stub("m", 1.0, host), Stub("r", 1.0, host), BATCH, repeats=repeats, clock=host)
    with pytest.raises(ValueError, match="too fast for this clock"):
        compare.paired_latency(Stub("m", 1.0, host), Stub("r", 0.0, host), BATCH, repeats=2, clock=host)
