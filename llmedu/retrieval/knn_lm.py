"""kNN-LM (Khandelwal et al. 2020, "Generalization through Memorization: Nearest Neighbor Language Models").

A datastore holds one (key, value) pair per token of some text: the key is the LM's hidden state
f(c_t) for the context c_t, the value the token w_t that came next. At test time the hidden state of
the current context retrieves its k nearest keys (squared L2 distance d_i), and their values vote:

    p_kNN(w | c) = sum_{i: v_i = w} exp(-d_i / tau) / sum_i exp(-d_i / tau)        (eq. 2)
    p(w | c)     = lambda p_kNN(w | c) + (1 - lambda) p_LM(w | c)                   (eq. 3)

Eq. 3 mixes probabilities, not log-probabilities: in log space it is a logsumexp,

    log p = logaddexp(log lambda + log p_kNN, log(1 - lambda) + log p_LM)

which stays a distribution (sums to 1) for every lambda in [0, 1]; lambda = 0 is the LM exactly.
The LM is not retrained: the datastore can be any text, swapped or grown at will.

The key here is the final hidden state (after the final norm, the input of the output projection);
the paper found the input of the last feed-forward layer slightly better. Left out: the paper's
IVF-PQ index of 100M+ keys with re-computed exact distances (here any index of ``llmedu.retrieval``
with metric "l2" will do), and the continuous-cache baseline.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from ..models.gpt import CausalLM

__all__ = ["build_datastore", "knn_log_probs", "interpolate", "KNNLM"]


@torch.no_grad()
def build_datastore(
    model: CausalLM, windows: torch.Tensor, last: int | None = None, batch: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (N, d) and values (N,) from token windows (n, T+1): a position's hidden state -> the next token.

    ``last``: only the predictions of the last ``last`` tokens of each window (contexts at least
    T + 1 - last long), else every position.
    """
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be (n, T+1) token ids with T >= 1, got shape {tuple(windows.shape)}")
    last = windows.shape[1] - 1 if last is None else last
    if not 1 <= last < windows.shape[1]:
        raise ValueError(f"last must be from 1 to T = {windows.shape[1] - 1}, got {last}")
    keys, values = [], []
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        h = model.transformer(w[:, :-1])[:, -last:]  # (b, last, d)
        keys.append(h.flatten(0, 1))
        values.append(w[:, -last:].flatten())
    return torch.cat(keys).float(), torch.cat(values)


def _check_values(values: torch.Tensor, vocab_size: int) -> None:
    """Every value is a token id of the LM's vocabulary (else scatter_add fails with a bare index error)."""
    if values.numel() and (values.min() < 0 or values.max() >= vocab_size):
        bad = int(values.min()) if values.min() < 0 else int(values.max())
        raise ValueError(
            f"datastore value {bad} is not a token id of the vocabulary of {vocab_size} (ids 0..{vocab_size - 1}): "
            "the values must be the next tokens of the same tokenizer as the LM"
        )


def knn_log_probs(distances: torch.Tensor, values: torch.Tensor, vocab_size: int, temperature: float = 1.0):
    """log p_kNN (N, vocab) from the neighbours' squared distances and values, each (N, k) (eq. 2)."""
    if distances.shape != values.shape:
        raise ValueError(f"distances {tuple(distances.shape)} and values {tuple(values.shape)} must match")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    _check_values(values, vocab_size)
    weights = torch.softmax(-distances / temperature, dim=-1).nan_to_num(0.0)  # (N, k); a row with no neighbour: 0
    p = torch.zeros(len(values), vocab_size).scatter_add_(1, values.long(), weights)  # (N, vocab)
    return p.log()  # -inf for a token no neighbour voted for


def interpolate(log_p_lm: torch.Tensor, log_p_knn: torch.Tensor, lam: float) -> torch.Tensor:
    """log(lambda p_kNN + (1 - lambda) p_LM), computed in log space (eq. 3)."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must lie in [0, 1], got {lam}")
    log_lam = math.log(lam) if lam > 0 else float("-inf")
    log_rest = math.log1p(-lam) if lam < 1 else float("-inf")
    return torch.logaddexp(log_p_knn + log_lam, log_p_lm + log_rest)


class KNNLM:
    """A frozen LM plus a datastore: ``index`` holds the keys (metric "l2"), ``values`` their tokens."""

    def __init__(self, model: CausalLM, index, values: torch.Tensor, k: int = 16, temperature: float = 1.0):
        if getattr(index, "metric", None) != "l2":
            raise ValueError("kNN-LM scores neighbours by squared L2 distance: build the index with metric='l2'")
        if index.ntotal != len(values):
            raise ValueError(f"the index holds {index.ntotal} keys but there are {len(values)} values")
        _check_values(values, model.config.vocab_size)
        self.model, self.index, self.values = model, index, values
        self.k, self.temperature = k, temperature

    @torch.no_grad()
    def lm_and_knn(self, ids: torch.Tensor, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """log p_LM and log p_kNN for every position of ``ids`` (B, T), or its ``last`` positions only
        (no search for the others): each (B, T or last, vocab)."""
        if last is not None and not 1 <= last <= ids.shape[1]:
            raise ValueError(f"last must be from 1 to T = {ids.shape[1]}, got {last}")
        h = self.model.transformer(ids)  # (B, T, d)
        h = h if last is None else h[:, -last:]  # (B, last, d)
        log_p_lm = F.log_softmax(self.model.lm_head(h).float(), dim=-1)  # (B, T, V)
        dist, nn_ids = self.index.search(h.flatten(0, 1).float(), self.k)  # (B*T, k) each
        found = nn_ids >= 0  # IVF may return fewer than k: those slots get zero weight
        dist = torch.where(found, dist, torch.full_like(dist, float("inf")))
        log_p_knn = knn_log_probs(dist, self.values[nn_ids.clamp_min(0)], log_p_lm.shape[-1], self.temperature)
        return log_p_lm, log_p_knn.view_as(log_p_lm)

    def log_probs(self, ids: torch.Tensor, lam: float) -> torch.Tensor:
        """(B, T, vocab): the interpolated next-token log-probabilities."""
        return interpolate(*self.lm_and_knn(ids), lam)

    @staticmethod
    def nll(log_probs: torch.Tensor, ids: torch.Tensor, last: int | None = None) -> torch.Tensor:
        """Mean negative log-likelihood (nats/token) of ids[:, 1:] under log_probs[:, :-1] (the last ``last`` only)."""
        scored = -log_probs[:, :-1].gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)  # (B, T-1)
        return scored[:, -last:].mean() if last else scored.mean()
