"""In-context retrieval-augmented language modelling at course scale (Ram et al. 2023, "In-Context
Retrieval-Augmented Language Models"; the chunked set-up of RETRO, Borgeaud et al. 2022).

Each example is two consecutive chunks of a document, [c_i, c_(i+1)], each m tokens. The first chunk
is the query: its key retrieves the k nearest entries of a ``ChunkStore`` (each a chunk and its
continuation, 2m tokens), and they are simply prepended:

    input  = [nbr_1 (2m) | ... | nbr_k (2m) | c_i (m) | c_(i+1) (m)]      (B, 2(k+1)m)
    loss   = cross-entropy on the tokens of c_(i+1) only

Only c_(i+1) is scored, because only it comes after the query that chose the neighbours (RETRO's
causality rule: a chunk's neighbours may inform the next chunk, never the chunk itself). A model
without retrieval sees [c_i | c_(i+1)] and is scored on the same tokens, so the losses compare.
When the store is built from the training documents, an example never retrieves from its own
document (it would find itself and learn nothing but copying).

The model is the course's ``CausalLM``, unchanged: retrieval is only in how its input is made. RETRO
instead encodes the neighbours once and reads them through chunked cross-attention in some layers,
which keeps the decoder's sequence short; prepending costs attention over the neighbours' tokens
(``flops_per_predicted_token`` counts it). Left out: chunked cross-attention, retrieval during
generation (re-retrieving every m tokens), and training the retriever (REALM, RAG).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..models.counting import flops_per_token, matmul_parameters
from ..models.gpt import CausalLM
from ..train import TrainConfig, train
from .datastore import ChunkStore
from .knowledge import ngram_coverage

__all__ = [
    "make_examples",
    "target_loss",
    "evaluate",
    "train_on_examples",
    "LRSweep",
    "sweep_learning_rate",
    "flops_per_predicted_token",
    "neighbour_coverage",
]


@torch.no_grad()
def make_examples(
    store: ChunkStore, documents: list[str], k: int, exclude_own: bool = False, limit: int | None = None, seed: int = 0
) -> torch.Tensor:
    """(n, 2(k+1)m) inputs for the pairs of chunks of ``documents``; k = 0 gives no neighbours.

    ``exclude_own``: the documents are the store's first documents (in the same order), and an
    example must not retrieve from its own document. ``limit``: keep that many pairs, drawn at
    random (seeded), so that only the examples a run will use are searched for.
    """
    rows, docs = store.chunk(documents)  # (n, 2m), (n,)
    if limit is not None and limit < len(rows):
        keep = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:limit].sort().values
        rows, docs = rows[keep], docs[keep]
    if k == 0:
        return rows
    neighbours = store.search(store.embed(rows), k, exclude_docs=docs if exclude_own else None)  # (n, k, 2m)
    return torch.cat([neighbours.flatten(1), rows], dim=1)


def target_loss(model: CausalLM, inputs: torch.Tensor, m: int) -> torch.Tensor:
    """Mean cross-entropy (nats/token) of the last m tokens, each predicted from everything before it."""
    if inputs.shape[1] < 2 * m:
        raise ValueError(f"inputs of {inputs.shape[1]} tokens are shorter than a query of 2m = {2 * m}")
    logits = model(inputs)[:, -m - 1 : -1]  # (B, m, V): the predictions of the last m tokens
    return F.cross_entropy(logits.flatten(0, 1).float(), inputs[:, -m:].flatten())


@torch.no_grad()
def evaluate(model: CausalLM, inputs: torch.Tensor, m: int, batch: int = 64) -> float:
    """``target_loss`` over all rows, in batches."""
    model.eval()
    total = sum(
        target_loss(model, inputs[i : i + batch], m).item() * len(inputs[i : i + batch])
        for i in range(0, len(inputs), batch)
    )
    return total / len(inputs)


def train_on_examples(
    model: CausalLM, inputs: torch.Tensor, m: int, steps: int, batch: int = 32, lr: float = 3e-3, seed: int = 0
):
    """AdamW on random batches of ``inputs`` (rows drawn by a seeded generator), loss on the last m tokens."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randint(len(inputs), (steps, batch), generator=g)  # (steps, B): the same rows every run
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    return train(
        model,
        optimizer,
        lambda i: inputs[order[i]],
        lambda model, b: target_loss(model, b, m),
        TrainConfig(max_steps=steps, clip_grad_norm=1.0, progress=False),
    )


@dataclass
class LRSweep:
    lrs: list[float]
    dev_loss: list[float]  # after training at each lr, on the dev rows (never the reported held-out rows)
    curves: list[list[float]]  # training loss per step, at each lr
    best_lr: float
    model: CausalLM  # the model trained at best_lr

    @property
    def curve(self) -> list[float]:
        return self.curves[self.lrs.index(self.best_lr)]


def sweep_learning_rate(
    make_model: Callable[[], CausalLM],
    inputs: torch.Tensor,
    dev: torch.Tensor,
    m: int,
    steps: int,
    lrs: list[float],
    batch: int = 32,
    seed: int = 0,
) -> LRSweep:
    """Train a fresh ``make_model()`` at every lr of a list declared beforehand (same batches, same
    steps) and keep the one with the lowest loss on ``dev``: each model size gets its own learning rate,
    chosen on rows that the reported evaluation never uses."""
    if not lrs or any(not lr > 0 for lr in lrs):
        raise ValueError(f"lrs must be a non-empty list of positive learning rates, got {lrs}")
    if len(dev) == 0:
        raise ValueError("the dev split is empty: the learning rate would be chosen on nothing")
    models, dev_loss, curves = [], [], []
    for lr in lrs:
        model = make_model()
        curves.append(train_on_examples(model, inputs, m, steps, batch=batch, lr=lr, seed=seed)["loss"])
        dev_loss.append(evaluate(model, dev, m))
        models.append(model)
    best = min(range(len(lrs)), key=dev_loss.__getitem__)
    return LRSweep(list(lrs), dev_loss, curves, lrs[best], models[best].eval())


def flops_per_predicted_token(model: CausalLM, seq_len: int, m: int) -> float:
    """Forward FLOPs of one input of ``seq_len`` tokens, divided by the m tokens it predicts."""
    return flops_per_token(model.config, matmul_parameters(model), seq_len, training=False) * seq_len / m


def neighbour_coverage(inputs: torch.Tensor, k: int, m: int, n: int = 8) -> torch.Tensor:
    """(rows,) for each row of ``make_examples`` (rows, 2(k+1)m): the fraction of its m scored bytes whose
    n-gram (the byte and the n - 1 before it) occurs in the row's own k neighbours: how much of what it must
    predict its neighbours show it."""
    if inputs.dim() != 2 or inputs.shape[1] != 2 * (k + 1) * m:
        raise ValueError(f"inputs must be (rows, 2(k+1)m) = (rows, {2 * (k + 1) * m}), got {tuple(inputs.shape)}")
    return torch.tensor(
        [ngram_coverage(row[None, -2 * m :], row[: 2 * k * m].view(k, 2 * m), n, last=m) for row in inputs]
    )
