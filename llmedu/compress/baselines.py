"""The baselines every table of lessons 22 and 23 stands beside: the majority class and TF-IDF + logistic regression.

TF-IDF (Salton & Buckley 1988): a document is the vector of its words' counts times
idf(w) = log((1 + N) / (1 + df(w))) + 1 (the smoothed form scikit-learn uses), scaled to unit l2 norm.
Logistic regression on it, trained full-batch with L-BFGS and an l2 penalty: a linear model of which
words appear, the classic strong baseline for sentiment of short text. The matrix is stored sparse
(``torch.sparse_coo_tensor``): 11.5k snippets x ~10k words would be 0.5 GB dense.

The l2 penalty is chosen by ``tune``: a seeded tenth of the training snippets is held out as a dev split,
the model is fitted on the rest once per candidate penalty, the one with the best dev accuracy wins, and
the final model is refitted on all the training snippets with it. The validation split, which the lessons
score every model on, is never read. The vocabulary and idf of the candidates come from all the training
texts (word counts, no labels), the dev tenth included.

Left out: bigrams, sub-linear tf, and tuning anything but the penalty (``min_count``, the L-BFGS steps).
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter

import torch

__all__ = ["majority_accuracy", "BagOfWords", "L2_CANDIDATES"]

L2_CANDIDATES = (1e-3, 1e-4, 1e-5, 1e-6)  # the penalties ``tune`` tries, times ||w||^2 on the mean loss

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
        """Vocabulary, idf and weights from ``texts``, at the penalty ``self.l2``."""
        self._vocabulary(texts)
        self._solve(self.features(texts), torch.tensor(labels, dtype=torch.float32))
        return self

    def tune(
        self, texts: list[str], labels: list[int], l2s=L2_CANDIDATES, dev_fraction: float = 0.1, seed: int = 0
    ) -> dict[float, float]:
        """Choose ``self.l2`` from ``l2s`` on a held-out part of the *training* data, then refit on all of it.

        Returns {penalty: dev accuracy}. The dev split is a seeded ``dev_fraction`` of ``texts``.
        """
        if not 0 < dev_fraction < 1:
            raise ValueError(f"dev_fraction must be in (0, 1), got {dev_fraction!r}")
        l2s = list(l2s)
        if not l2s or any(not l2 >= 0 for l2 in l2s):
            raise ValueError(f"l2s must be non-empty and hold penalties >= 0, got {l2s!r}")
        self._vocabulary(texts)
        x, y = self.features(texts), torch.tensor(labels, dtype=torch.float32)  # (N, V) sparse, (N,)
        order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed))
        n_dev = max(1, round(dev_fraction * len(texts)))
        dev, fit = order[:n_dev], order[n_dev:]
        x_fit, x_dev = x.index_select(0, fit), x.index_select(0, dev)
        dev_accuracy = {}
        for l2 in l2s:
            self.l2 = l2
            self._solve(x_fit, y[fit])
            dev_accuracy[l2] = (self._predict_features(x_dev) == y[dev].long()).float().mean().item()
        self.l2 = max(l2s, key=lambda l2: dev_accuracy[l2])  # the first of equals: the larger penalty
        self._solve(x, y)
        return dev_accuracy

    def _vocabulary(self, texts: list[str]) -> None:
        doc_freq = Counter(w for text in texts for w in set(self.words(text)))
        kept = sorted(w for w, c in doc_freq.items() if c >= self.min_count)
        self.vocab = {w: i for i, w in enumerate(kept)}
        n = len(texts)
        self._idf = [math.log((1 + n) / (1 + doc_freq[w])) + 1 for w in kept]
        self.idf = torch.tensor(self._idf)  # (V,)

    def _solve(self, coo: torch.Tensor, y: torch.Tensor) -> None:
        """Logistic regression on the sparse rows ``coo`` (N, V) with labels ``y`` (N,), at ``self.l2``."""
        coo = coo.coalesce()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch calls its CSR support "beta"
            x, x_t = coo.to_sparse_csr(), coo.t().coalesce().to_sparse_csr()  # and (V, N) for the gradient
        self.weight = torch.zeros(coo.shape[1], requires_grad=True)  # (V,)
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

    @torch.no_grad()
    def _predict_features(self, coo: torch.Tensor) -> torch.Tensor:
        logits = torch.sparse.mm(coo, self.weight[:, None]).squeeze(1) + self.bias  # (N,)
        return (logits > 0).long()

    @torch.no_grad()
    def predict(self, texts: list[str]) -> torch.Tensor:
        return self._predict_features(self.features(texts))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What must be stored to use it: the weights and idf (the vocabulary's words add their text)."""
        return {"weight": self.weight.detach(), "bias": self.bias.detach(), "idf": self.idf}
