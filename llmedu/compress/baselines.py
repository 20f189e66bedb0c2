"""The baselines every row of lesson 20's table stands beside: the majority class and TF-IDF + logistic regression.

TF-IDF (Salton & Buckley 1988): a document is the vector of its words' counts times
idf(w) = log((1 + N) / (1 + df(w))) + 1 (the smoothed form scikit-learn uses), scaled to unit l2 norm.
Logistic regression on it, trained full-batch with L-BFGS and an l2 penalty: a linear model of which
words appear, the classic strong baseline for sentiment of short text. The matrix is stored sparse
(``torch.sparse_coo_tensor``): 11.5k snippets x ~10k words would be 0.5 GB dense.

Left out: bigrams, sub-linear tf, a search over the penalty (fixed at 1e-5 x ||w||^2 on the mean loss: of 1e-3, 1e-4
and 1e-5, the best on the validation split, 75% against 57% and 72%, so the row is slightly optimistic).
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter

import torch

__all__ = ["majority_accuracy", "BagOfWords"]

_WORD = re.compile(r"[a-z0-9']+")


def majority_accuracy(train_labels: list[int], eval_labels: list[int]) -> float:
    """Accuracy on ``eval_labels`` of always answering the training set's most common label."""
    majority = Counter(train_labels).most_common(1)[0][0]
    return sum(y == majority for y in eval_labels) / len(eval_labels)


class BagOfWords:
    """TF-IDF features + a 2-way logistic regression; ``fit(texts, labels)``, then ``predict(texts)``."""

    def __init__(self, min_count: int = 2, l2: float = 1e-5, steps: int = 100):
        self.min_count, self.l2, self.steps = min_count, l2, steps

    @staticmethod
    def words(text: str) -> list[str]:
        return _WORD.findall(text.lower())

    def features(self, texts: list[str]) -> torch.Tensor:
        """(N, V) sparse TF-IDF rows of unit l2 norm."""
        rows, cols, vals = [], [], []
        for i, text in enumerate(texts):
            counts = Counter(w for w in self.words(text) if w in self.vocab)
            weights = {self.vocab[w]: c * self._idf[self.vocab[w]] for w, c in counts.items()}
            norm = math.sqrt(sum(v * v for v in weights.values())) or 1.0
            for j, v in weights.items():
                rows.append(i)
                cols.append(j)
                vals.append(v / norm)
        size = (len(texts), len(self.vocab))
        return torch.sparse_coo_tensor([rows, cols], vals, size, check_invariants=False).coalesce()

    def fit(self, texts: list[str], labels: list[int]) -> BagOfWords:
        doc_freq = Counter(w for text in texts for w in set(self.words(text)))
        kept = sorted(w for w, c in doc_freq.items() if c >= self.min_count)
        self.vocab = {w: i for i, w in enumerate(kept)}
        n = len(texts)
        self._idf = [math.log((1 + n) / (1 + doc_freq[w])) + 1 for w in kept]
        self.idf = torch.tensor(self._idf)  # (V,)
        coo, y = self.features(texts), torch.tensor(labels, dtype=torch.float32)  # (N, V), (N,)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch calls its CSR support "beta"
            x, x_t = coo.to_sparse_csr(), coo.t().coalesce().to_sparse_csr()  # and (V, N) for the gradient
        self.weight = torch.zeros(len(kept), requires_grad=True)  # (V,)
        self.bias = torch.zeros((), requires_grad=True)
        optimizer = torch.optim.LBFGS([self.weight, self.bias], max_iter=self.steps, line_search_fn="strong_wolfe")

        @torch.no_grad()
        def closure():  # the loss and its gradient by hand: autograd through sparse products is slow
            logits = (x @ self.weight[:, None]).squeeze(1) + self.bias  # (N,)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y) + self.l2 * self.weight.pow(2).sum()
            residual = (torch.sigmoid(logits) - y) / len(y)  # d loss / d logits, (N,)
            self.weight.grad = (x_t @ residual[:, None]).squeeze(1) + 2 * self.l2 * self.weight  # (V,)
            self.bias.grad = residual.sum()
            return loss

        optimizer.step(closure)
        return self

    @torch.no_grad()
    def predict(self, texts: list[str]) -> torch.Tensor:
        logits = torch.sparse.mm(self.features(texts), self.weight[:, None]).squeeze(1) + self.bias  # (N,)
        return (logits > 0).long()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What must be stored to use it: the weights and idf (the vocabulary's words add their text)."""
        return {"weight": self.weight.detach(), "bias": self.bias.detach(), "idf": self.idf}
