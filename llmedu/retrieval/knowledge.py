"""Knowledge outside the weights, measured: kNN-LM losses, the datastore's overlap with the text,
the search's cost, and a knowledge update with no gradient step.

kNN-LM (Khandelwal et al. 2020) helps where the datastore holds continuations like the ones being
predicted: the paper's gain grows with the datastore (its figure 2), and a datastore of another
domain adapts a frozen LM to that domain (its domain-adaptation experiment). RETRO (Borgeaud et al.
2022, §4.4) reports its gain rising with the overlap between evaluation and training chunks, and
says so. So every loss here comes with the overlap that explains it:

    coverage_n = fraction of scored bytes whose n-gram (the byte and the n - 1 before it)
                 occurs somewhere in the datastore's text

All text is bytes (a 256-token vocabulary), cut into rows [c_j, c_(j+1)] of two m-byte chunks
(``chunk_pairs``); the model reads the row and is scored on the second chunk only, the positions whose
context is at least m bytes long. A datastore holds one key (the LM's final hidden state) per scored
byte of its rows.

``knowledge_update`` is the experiment of lesson 24 §5: a frozen LM, a datastore of corpus A, held-out
documents of a corpus B the LM never trained on; B's *other* documents are added to the datastore and
the held-out loss is measured again. Nothing is trained, and the evaluated documents are never in the
datastore (a shared document is an error): what is added is related text, not the answer.

Left out: approximate search for the big datastores (exact search is the oracle; ``search_flops``
counts what IVF would cost instead), RETRO's 13-gram deduplication against the evaluation set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from ..models.gpt import CausalLM
from .datastore import chunk_pairs
from .exact import FlatIndex
from .knn_lm import KNNLM, build_datastore, interpolate

__all__ = [
    "ngram_coverage",
    "search_flops",
    "knn_lm_losses",
    "lm_loss",
    "size_to_reach",
    "UpdateResult",
    "knowledge_update",
]


def _packed_ngrams(rows: np.ndarray, n: int) -> np.ndarray:
    """(rows, L) uint8 -> (rows, L - n + 1) uint64: each n-gram's bytes packed into one integer, exactly."""
    grams = np.lib.stride_tricks.sliding_window_view(rows, n, axis=1)  # (r, L-n+1, n)
    padded = np.zeros(grams.shape[:2] + (8,), dtype=np.uint8)
    padded[..., :n] = grams
    return padded.view(np.uint64)[..., 0]  # 8 bytes read as one uint64: equal iff the n-grams are equal


def ngram_coverage(rows: torch.Tensor, store_rows: torch.Tensor, n: int = 8, last: int | None = None) -> float:
    """Fraction of the scored bytes of ``rows`` (r, L) (its last ``last`` columns; by default every byte
    with n - 1 before it) whose n-gram ending at that byte occurs anywhere inside a row of ``store_rows``
    (N, L'). Bytes (0..255) only; 1 <= n <= 8."""
    if not 1 <= n <= 8:
        raise ValueError(f"n must be from 1 to 8 (an n-gram is packed into 64 bits), got {n}")
    last = rows.shape[1] - n + 1 if last is None else last
    if not 1 <= last <= rows.shape[1] - n + 1:
        raise ValueError(f"last={last} scored bytes need rows of at least last + n - 1 = {last + n - 1} bytes")
    if min(int(rows.min()), int(store_rows.min())) < 0 or max(int(rows.max()), int(store_rows.max())) > 255:
        raise ValueError("ngram_coverage counts byte n-grams: every token must lie in 0..255")
    scored = _packed_ngrams(rows.to(torch.uint8).numpy(), n)[:, -last:]  # (r, last)
    stored = np.unique(_packed_ngrams(store_rows.to(torch.uint8).numpy(), n))
    return float(np.isin(scored, stored).mean())


def search_flops(n_keys: int, d: int, nlist: int | None = None, nprobe: int | None = None) -> float:
    """FLOPs (2 per multiply-add) of one query: exact search scores all n keys; IVF scores the nlist
    centroids and then nprobe lists of n / nlist keys each (equal lists assumed). A count, not a timing."""
    if nlist is None:
        return 2.0 * n_keys * d
    if nprobe is None or not 1 <= nprobe <= nlist:
        raise ValueError(f"nprobe must be from 1 to nlist = {nlist}, got {nprobe}")
    return 2.0 * (nlist * d + nprobe * n_keys / nlist * d)


@torch.no_grad()
def knn_lm_losses(
    model: CausalLM,
    index,
    values: torch.Tensor,
    rows: torch.Tensor,
    m: int,
    lams: list[float],
    k: int = 16,
    temperature: float = 1.0,
    batch: int = 64,
) -> list[float]:
    """Mean loss (nats/byte) on the last m bytes of ``rows`` (n, 2m), for every lambda in ``lams``.

    One forward pass and one search per scored position, however many lambdas."""
    if rows.dim() != 2 or rows.shape[1] <= m:
        raise ValueError(f"rows must be (n, L) with L > m = {m}, got shape {tuple(rows.shape)}")
    knn = KNNLM(model.eval(), index, values, k=k, temperature=temperature)
    totals = torch.zeros(len(lams), dtype=torch.float64)
    for i in range(0, len(rows), batch):
        r = rows[i : i + batch]
        log_p_lm, log_p_knn = knn.lm_and_knn(r[:, :-1], last=m)  # (b, m, V) each: predictions of r[:, -m:]
        target = r[:, -m:].unsqueeze(2)  # (b, m, 1)
        for j, lam in enumerate(lams):
            totals[j] -= interpolate(log_p_lm, log_p_knn, lam).gather(2, target).sum().double()
    return (totals / (len(rows) * m)).tolist()


@dataclass
class UpdateResult:
    lams: list[float]
    before: list[float]  # held-out loss at each lambda, datastore = corpus A
    after: list[float]  # the same, datastore = corpus A + B's other documents
    coverage_before: float  # n-gram coverage of the scored bytes by the datastore's text
    coverage_after: float
    keys_before: int
    keys_after: int
    n_eval: int  # scored bytes
    unigram: float  # the scored bytes under the byte frequencies of the added documents (add-one): no context at all

    @property
    def lm_alone(self) -> float:
        return self.before[self.lams.index(0.0)]


def _rows(documents: list[str], m: int, limit: int | None, seed: int) -> torch.Tensor:
    rows, _ = chunk_pairs(documents, m)  # (N, 2m)
    if limit is not None and limit < len(rows):
        keep = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:limit].sort().values
        rows = rows[keep]
    return rows


def knowledge_update(
    model: CausalLM,
    old_documents: list[str],
    new_documents: list[str],
    eval_documents: list[str],
    m: int = 32,
    lams: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5),
    k: int = 16,
    n_eval: int | None = None,
    n_old: int | None = None,
    ngram: int = 8,
    seed: int = 0,
) -> UpdateResult:
    """Held-out loss on ``eval_documents`` under a kNN-LM whose datastore holds ``old_documents``, then
    ``old_documents`` + ``new_documents``; the model is frozen. ``n_eval`` / ``n_old``: seeded random subsets
    of the evaluated rows / of corpus A's rows. Lambda 0 must be in ``lams`` (the LM alone)."""
    if 0.0 not in lams:
        raise ValueError("lams must include 0.0: the LM alone is the baseline")
    if set(eval_documents) & set(new_documents):
        raise ValueError("an evaluated document is among the documents added: the datastore would hold the answer")
    eval_rows = _rows(eval_documents, m, n_eval, seed)
    old_rows = _rows(old_documents, m, n_old, seed + 1)
    new_rows = _rows(new_documents, m, None, seed)
    model.eval()
    old_keys, old_values = build_datastore(model, old_rows, last=m)  # (N_A, d), (N_A,)
    new_keys, new_values = build_datastore(model, new_rows, last=m)
    losses = []
    for keys, values in (
        (old_keys, old_values),
        (torch.cat([old_keys, new_keys]), torch.cat([old_values, new_values])),
    ):
        index = FlatIndex(keys.shape[1], metric="l2")
        index.add(keys)
        losses.append(knn_lm_losses(model, index, values, eval_rows, m, list(lams), k=k))
    return UpdateResult(
        lams=list(lams),
        before=losses[0],
        after=losses[1],
        coverage_before=ngram_coverage(eval_rows, old_rows, ngram, last=m),
        coverage_after=ngram_coverage(eval_rows, torch.cat([old_rows, new_rows]), ngram, last=m),
        keys_before=len(old_keys),
        keys_after=len(old_keys) + len(new_keys),
        n_eval=eval_rows.shape[0] * m,
        unigram=_unigram_loss(eval_rows[:, -m:], new_rows[:, -m:]),
    )


def _unigram_loss(scored: torch.Tensor, text: torch.Tensor) -> float:
    """Mean -log p(byte) of ``scored`` under the add-one byte frequencies of ``text`` (nats/byte)."""
    counts = torch.bincount(text.flatten(), minlength=256).double() + 1
    return -(counts / counts.sum()).log()[scored].mean().item()


def lm_loss(model: CausalLM, rows: torch.Tensor, m: int, batch: int = 64) -> float:
    """The LM alone on the last m bytes of ``rows``: the reference that ``knn_lm_losses`` at lambda 0 must equal."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            r = rows[i : i + batch]
            logits = model(r[:, :-1])[:, -m:]  # (b, m, V)
            total += F.cross_entropy(logits.flatten(0, 1).float(), r[:, -m:].flatten(), reduction="sum").item()
    return total / (len(rows) * m)


def size_to_reach(sizes: list[int], losses: list[float], target: float) -> float | None:
    """Fit loss = a + b ln(size) by least squares through the measured points and return the size at
    which the line reaches ``target`` (None if the line does not fall). An extrapolation from a few
    points, to be read as one: it says how far off the target is, not what a larger run would give."""
    if len(sizes) != len(losses) or len(sizes) < 2:
        raise ValueError(f"need at least two (size, loss) points of equal count, got {len(sizes)} and {len(losses)}")
    x = np.log(np.asarray(sizes, dtype=np.float64))
    b, a = np.polyfit(x, np.asarray(losses, dtype=np.float64), 1)
    if b >= 0:
        return None
    return float(np.exp((target - a) / b))
