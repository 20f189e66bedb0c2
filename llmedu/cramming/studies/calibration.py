"""Calibration rows: what a number from the capstone must stand beside to mean anything.

* ``majority_accuracy``: always answer the training set's most common label (from
  ``llmedu.compress.baselines``, imported, not copied).
* ``tfidf_accuracy``: TF-IDF + logistic regression (``compress.baselines.BagOfWords``, a binary model),
  one-vs-rest for more than two classes: one model per class on "this class or not", the class with
  the largest logit wins (Rifkin & Klautau 2004, "In Defense of One-Vs-All Classification").
* ``unigram_cross_entropy``: the MLM loss of a model that ignores the context and predicts every
  masked token from the corpus's token frequencies: H = -mean log p(token) over the held-out tokens,
  with p counted on the training rows (add-one smoothed, so a token unseen in training costs
  log(N + V) rather than infinity). BERT's masked positions are chosen uniformly among the ordinary
  tokens, so this is the line a pretrained model's loss must go below to have learnt anything
  beyond word frequencies. In nats, like ``F.cross_entropy``.

Left out: a bag-of-words penalty search per task (``BagOfWords``' l2 was chosen on Rotten
Tomatoes; on the other tasks the row may be slightly pessimistic).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...compress.baselines import BagOfWords, majority_accuracy

__all__ = ["majority_accuracy", "tfidf_accuracy", "unigram_cross_entropy"]


def tfidf_accuracy(
    train_texts: Sequence[str], train_labels: Sequence[int], test_texts: Sequence[str], test_labels: Sequence[int]
) -> float:
    """Test accuracy of TF-IDF + logistic regression fit on the training texts (one-vs-rest beyond 2 classes)."""
    if len(train_texts) != len(train_labels) or len(test_texts) != len(test_labels):
        raise ValueError("texts and labels must have the same length")
    classes = sorted(set(train_labels))
    if len(classes) < 2:
        raise ValueError(f"the training labels hold {len(classes)} class; a classifier needs at least 2")
    texts = list(train_texts)
    if classes == [0, 1]:
        predicted = BagOfWords().fit(texts, list(train_labels)).predict(list(test_texts))  # (N,)
    else:
        logits = []
        for c in classes:  # one binary model per class
            bow = BagOfWords().fit(texts, [int(y == c) for y in train_labels])
            features = bow.features(list(test_texts))  # (N, V) sparse
            logits.append(torch.sparse.mm(features, bow.weight.detach()[:, None]).squeeze(1) + bow.bias.detach())
        predicted = torch.tensor(classes)[torch.stack(logits, 1).argmax(1)]  # (N,)
    return (predicted == torch.tensor(list(test_labels))).float().mean().item()


def unigram_cross_entropy(
    train_rows: torch.Tensor, heldout_rows: torch.Tensor, vocab_size: int, special_ids: Sequence[int]
) -> float:
    """Cross-entropy in nats of the held-out ordinary tokens under the training rows' unigram distribution."""
    if train_rows.numel() == 0 or heldout_rows.numel() == 0:
        raise ValueError("need training and held-out tokens")
    if (
        int(max(train_rows.max(), heldout_rows.max())) >= vocab_size
        or int(min(train_rows.min(), heldout_rows.min())) < 0
    ):
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    ordinary = torch.ones(vocab_size, dtype=torch.bool)
    ordinary[list(special_ids)] = False  # (V,): the tokens MLM can mask
    counts = torch.bincount(train_rows.flatten(), minlength=vocab_size).double()  # (V,)
    counts = (counts + 1) * ordinary  # add-one over the ordinary tokens, 0 for the specials
    log_p = (counts / counts.sum()).log()  # (V,)
    held = heldout_rows.flatten()
    held = held[ordinary[held]]  # the ordinary held-out tokens
    if held.numel() == 0:
        raise ValueError("the held-out rows hold no ordinary token")
    return -log_p[held].mean().item()
