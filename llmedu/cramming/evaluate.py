"""The fair downstream protocol: dev-chosen rates, held-out test scores, seeds, label curves.

Cramming fine-tunes every model with one fixed setting (Geiping & Goldstein 2022, sec. 5); lesson
25 found that this is unfair to the random-init control, which needs a higher rate. The usual
remedy (Devlin et al. 2019, sec. 4.1 and appendix A.3: "we selected the best fine-tuning learning
rate on the Dev set") gives every model the same small sweep and lets the dev split choose:

1. ``make_splits``: per task, a **test** split that nothing is chosen on (the task's own held-out
   split in ``llmedu.data``, fixed by a hash), a **dev** split (a seeded random ``dev_fraction`` of
   the training split) and the rest as **train**. Disjoint, deterministic given the seed.
2. ``sweep``: each rate of ``lrs`` trains on train and scores on dev (one seed); the best dev score
   picks the rate (ties: the earlier rate in the list).
3. ``protocol``: the chosen rate trains again with each of ``seeds`` and is scored on test; the
   report is the mean and the standard deviation over seeds (``summarize``).
4. ``label_efficiency``: the chosen rate on seeded random slices of train of growing size (100
   labels up to all), each size with each seed, scored on test.
5. ``task_average``: the headline, as the paper's GLUE average: per seed, the mean over tasks of
   the test score; then the mean and spread of those averages.

A model is a **scorer**: ``scorer(train, test, lr, seed) -> accuracy`` (``Data`` in, a float out),
so the protocol does not care whether it fine-tunes a transformer, probes a frozen one or fits a
bag of words; models without a rate (the baselines, the linear probe) are swept over ``(None,)``.
``studies.encoders`` makes the scorers; ``studies.study`` runs everything.

Left out: choosing the number of epochs or the batch size on dev, and significance tests (with 3
seeds the spread is a rough guide, not a confidence interval).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..data.classification import load_classification
from ..data.tweet_sentiment import PRETRAINING_OVERLAP as TWEET_OVERLAP
from ..data.tweet_sentiment import load_tweet_sentiment

__all__ = [
    "Data",
    "Splits",
    "TASKS",
    "Scorer",
    "split_data",
    "make_splits",
    "subsample",
    "summarize",
    "best_rate",
    "sweep",
    "protocol",
    "label_efficiency",
    "task_average",
    "check_no_overlap",
]


@dataclass(frozen=True)
class Data:
    texts: tuple[str, ...]
    labels: tuple[int, ...]

    def __post_init__(self):
        if len(self.texts) != len(self.labels):
            raise ValueError(f"{len(self.texts)} texts but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.texts)

    def digest(self) -> str:
        """A short sha256 of the examples and labels, in order: equal on any machine for the same data."""
        text = json.dumps([self.texts, self.labels], ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Splits:
    train: Data
    dev: Data
    test: Data

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.train), "dev": len(self.dev), "test": len(self.test)}

    def digests(self) -> dict[str, str]:
        """``Data.digest`` of each split: a study records them, and whatever extends it checks them."""
        return {"train": self.train.digest(), "dev": self.dev.digest(), "test": self.test.digest()}


Scorer = Callable[[Data, Data, float | None, int], float]  # (train, test, lr, seed) -> accuracy


@dataclass(frozen=True)
class _Task:
    load: Callable[[str], tuple[list[str], list[int]]]  # split -> (texts, labels)
    overlap: tuple[str, ...] = ()  # pretraining corpora that hold the task's text


TASKS: dict[str, _Task] = {
    "rotten_tomatoes": _Task(lambda split: load_classification("rotten_tomatoes", split)),
    "bbc_news": _Task(lambda split: load_classification("bbc_news", split)),
    "tweet_sentiment": _Task(load_tweet_sentiment, TWEET_OVERLAP),
}


def _task(name: str) -> _Task:
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    return TASKS[name]


def check_no_overlap(tasks: Sequence[str], corpora: Sequence[str]) -> None:
    """Refuse to score a task on an encoder pretrained on that task's own text."""
    for name in tasks:
        shared = sorted(set(_task(name).overlap) & set(corpora))
        if shared:
            raise ValueError(
                f"task {name!r} is the text of pretraining corpus {shared}: pretrain without it "
                f"(--corpora) or drop the task"
            )


def _permutation(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def split_data(
    train: Data,
    test: Data,
    dev_fraction: float = 0.1,
    seed: int = 0,
    max_train: int | None = None,
    max_eval: int | None = None,
) -> Splits:
    """train -> (train, dev) by a seeded shuffle, test kept. For quick runs, ``max_train`` caps train and
    ``max_eval`` caps dev and test (seeded slices); the dev split is taken before the caps."""
    if not 0 < dev_fraction < 1:
        raise ValueError(f"dev_fraction must be in (0, 1), got {dev_fraction}")
    order = _permutation(len(train), seed)
    n_dev = round(dev_fraction * len(train))
    if n_dev < 1 or n_dev >= len(train):
        raise ValueError(
            f"{len(train)} training examples cannot give a dev split of {dev_fraction:.0%} and a train split"
        )
    dev_idx, train_idx = order[:n_dev][:max_eval], order[n_dev:][:max_train]
    test_idx = _permutation(len(test), seed)[:max_eval] if max_eval is not None else range(len(test))

    def pick(data: Data, idx) -> Data:
        return Data(tuple(data.texts[i] for i in idx), tuple(data.labels[i] for i in idx))

    return Splits(pick(train, train_idx), pick(train, dev_idx), pick(test, test_idx))


def make_splits(task: str, dev_fraction: float = 0.1, seed: int = 0, **caps) -> Splits:
    """The splits of a task of ``TASKS``: test is its held-out split ("validation" in ``llmedu.data``)."""
    t = _task(task)
    train, test = (Data(*map(tuple, t.load(split))) for split in ("train", "validation"))
    return split_data(train, test, dev_fraction, seed, **caps)


def subsample(data: Data, n: int | None, seed: int) -> Data:
    """A seeded random ``n`` of ``data``; None or n >= len is ``data`` itself, in its order."""
    if n is not None and n < 1:
        raise ValueError(f"a label budget must be at least 1, got {n}")
    if n is None or n >= len(data):
        return data  # the protocol's own train split: its test scores can stand for this point
    idx = _permutation(len(data), seed)[:n]
    return Data(tuple(data.texts[i] for i in idx), tuple(data.labels[i] for i in idx))


def summarize(scores: Sequence[float]) -> dict:
    """{"scores", "mean", "std"}: the sample standard deviation over seeds (0 for one seed)."""
    scores = [float(s) for s in scores]
    std = statistics.stdev(scores) if len(scores) > 1 else 0.0
    return {"scores": scores, "mean": statistics.fmean(scores), "std": std}


def _check(lrs: Sequence, seeds: Sequence[int]) -> None:
    if len(lrs) == 0:
        raise ValueError("the learning-rate sweep is empty: give at least one rate (or (None,) for models without one)")
    if len(seeds) < 1:
        raise ValueError("give at least one seed")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"the seeds must differ, got {list(seeds)}")


def best_rate(dev: dict, lrs: Sequence[float | None]) -> float | None:
    """The rate of ``lrs`` with the best score in ``dev`` ({rate: score}); ties go to the earlier rate."""
    return max(lrs, key=lambda lr: (dev[lr], -list(lrs).index(lr)))


def sweep(scorer: Scorer, splits: Splits, lrs: Sequence[float | None], seed: int = 0) -> tuple[float | None, dict]:
    """(the rate with the best dev score, {str(rate): dev score}); ties go to the earlier rate."""
    _check(lrs, [seed])
    dev = {lr: scorer(splits.train, splits.dev, lr, seed) for lr in lrs}
    return best_rate(dev, lrs), {str(lr): score for lr, score in dev.items()}


def protocol(scorer: Scorer, splits: Splits, lrs: Sequence[float | None], seeds: Sequence[int]) -> dict:
    """Sweep on dev with ``seeds[0]``, then the chosen rate with every seed, scored on test."""
    _check(lrs, seeds)
    lr, dev = sweep(scorer, splits, lrs, seeds[0])
    test = summarize([scorer(splits.train, splits.test, lr, s) for s in seeds])
    return {"lr": lr, "dev": dev, "test": test, "sizes": splits.sizes()}


def label_efficiency(
    scorer: Scorer,
    splits: Splits,
    lr: float | None,
    sizes: Sequence[int | None],
    seeds: Sequence[int],
    all_labels: Sequence[float] | None = None,
) -> dict:
    """{str(n labels): summary of test scores}, each seed on its own random slice of train.

    A size of None, or one above the train split's, is all of it; a size met twice is run once.
    ``all_labels``: the test scores (one per seed, in ``seeds``' order) already measured at ``lr``
    on the whole train split, i.e. ``protocol``'s; the all-labels point reuses them instead of
    training the same models again (``subsample`` returns the whole split unchanged).
    """
    _check([lr], seeds)
    if all_labels is not None and len(all_labels) != len(seeds):
        raise ValueError(f"all_labels holds {len(all_labels)} scores for {len(seeds)} seeds")
    curve, whole = {}, str(len(splits.train))
    for n in sizes:
        key = whole if n is None else str(min(n, len(splits.train)))
        if key in curve:
            continue
        if key == whole and all_labels is not None:
            curve[key] = summarize(all_labels)
        else:
            curve[key] = summarize([scorer(subsample(splits.train, n, seed), splits.test, lr, seed) for seed in seeds])
    return curve


def task_average(results: dict[str, dict]) -> dict:
    """{task: protocol result} -> the mean over tasks of each seed's test score, summarized over seeds."""
    if not results:
        raise ValueError("no task results to average")
    per_seed = [r["test"]["scores"] for r in results.values()]
    if len({len(s) for s in per_seed}) != 1:
        raise ValueError("every task must have been scored with the same seeds")
    return summarize([statistics.fmean(column) for column in zip(*per_seed)]) | {"tasks": sorted(results)}
