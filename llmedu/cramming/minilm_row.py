"""MiniLM fine-tuned, added to a finished study under the study's own protocol, in runs that survive stopping.

    python -m llmedu.cramming add-minilm --study study.json --journal minilm_journal.json --out study.json

Lesson 22's studies keep all-MiniLM-L6-v2 as a linear probe only (``--minilm-probe-only``): on 2 CPU cores one of
its fine-tunes takes about 5 minutes on Rotten Tomatoes where ours takes under one, and the studies' protocol
(six rates on dev, five test seeds, label curves over three seeds, three tasks) asks about 40 of them per
model: hours. This adds the row ``MiniLM-L6`` afterwards, as the study would have run it: ``evaluate.protocol``
with the study's rates and every test seed it holds (its own and any ``more_seeds`` added), then
``evaluate.label_efficiency`` at the chosen rate with the study's own seeds, as every other row's curve; the
task averages are computed again, ``config.minilm_finetune`` becomes true and ``added_minilm`` says how.

Hours of fine-tuning must not be lost to a closed laptop. Every fine-tune's score goes into a journal (JSON,
replaced whole after each run, so a stop leaves the last complete one), under a key made of what determines
the score: digests of the training and the scored examples, the rate and the seed; the journal itself names
the row and the fine-tuning settings, and refuses a run with others. Run the same command again and every
score the journal holds is read back; only the rest trains. A second study with the same protocol and splits
(lesson 22's hour, whose controls come from the half-hour's) finds every run in the journal and trains nothing.
The study's file is written once, when every task is done, so ``--out`` may be ``--study`` itself.

Left out: journaling the other rows (ours take minutes) and sharing one journal between processes.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

from .encoders import minilm_scorer
from .evaluate import Data, Scorer, Splits, label_efficiency, make_splits, protocol, task_average
from .finetune import FIXED
from .more_seeds import _config, _test_seeds
from .report import load_study
from .study import print_row, write_results

__all__ = ["ROW", "add_minilm", "load_journal"]

ROW = "MiniLM-L6"  # the row's name, as ``study._models`` gives it when a study fine-tunes MiniLM itself
_KIND = "llmedu fine-tune journal"


def _digest(data: Data) -> str:
    """A short digest of a split's examples and labels, in order: equal digests, the same fine-tune."""
    text = json.dumps([data.texts, data.labels], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_journal(path, settings: dict) -> dict:
    """The journal at ``path`` (a new, empty one if there is none); an error for another row's or settings'."""
    path = Path(path)
    if not path.exists():
        return {"kind": _KIND, "row": ROW, "settings": settings, "runs": {}}
    try:
        journal = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a fine-tune journal: {error}") from None
    if not isinstance(journal, dict) or journal.get("kind") != _KIND or not isinstance(journal.get("runs"), dict):
        raise ValueError(f"{path} is not a fine-tune journal (no 'kind': {_KIND!r} and 'runs')")
    if journal.get("row") != ROW or journal.get("settings") != settings:
        raise ValueError(
            f"{path} journals {journal.get('row')!r} fine-tuned with {journal.get('settings')}; this study fine-tunes "
            f"{ROW!r} with {settings}: its scores do not apply (give another --journal)"
        )
    return journal


def _journaled(scorer: Scorer, journal: dict, path, task: str, splits: Splits, used: list, progress: bool) -> Scorer:
    """``scorer`` that reads a run's score from the journal if it is there, else trains, journals and saves it
    (``write_results``: the file replaced whole, so a stop mid-write leaves the previous journal).
    Each run it returns (read or trained) is appended to ``used`` as its journal entry."""
    named = {_digest(splits.dev): "dev", _digest(splits.test): "test"}

    def score(train: Data, test: Data, lr: float, seed: int) -> float:
        scored_on = _digest(test)
        key = f"{_digest(train)}/{scored_on}/{lr!r}/{seed}"
        entry = journal["runs"].get(key)
        if entry is None:
            start = time.perf_counter()
            accuracy = scorer(train, test, lr, seed)
            entry = {"task": task, "train": len(train.texts), "scored_on": named.get(scored_on, scored_on),
                     "lr": lr, "seed": seed, "score": accuracy, "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
            journal["runs"][key] = entry
            write_results(path, journal)
            if progress:
                print(f"{task:<16} {ROW}: {entry['train']} examples, scored on {entry['scored_on']}, lr {lr}, "
                      f"seed {seed}: {accuracy:.4f} in {entry['seconds']:.0f} s", flush=True)  # fmt: skip
        used.append(entry)
        return entry["score"]

    return score


def _check(study: dict, source) -> None:
    if any(ROW in entry["models"] for entry in study["tasks"].values()):
        raise ValueError(f"{source} has a {ROW!r} row already")
    if study.get("widened", {}).get("unfinished"):
        raise ValueError(f"{source} is a stopped widening: finish it first (widen-sweep)")


def _with_row(models: dict, result: dict) -> dict:
    """``models`` with the row placed where a study of its own puts it: before MiniLM's probe, or last."""
    names = list(models)
    at = names.index(f"{ROW}, linear probe") if f"{ROW}, linear probe" in names else len(names)
    return {**{n: models[n] for n in names[:at]}, ROW: result, **{n: models[n] for n in names[at:]}}


def add_minilm(study_file, journal_file, out=None, progress: bool = True) -> dict:
    """``study_file`` with the row ``MiniLM-L6`` added under its protocol; written to ``out`` (JSON) when done.
    Scores come from ``journal_file`` where it holds them; every new fine-tune is journaled as it ends."""
    study = load_study(study_file)
    _check(study, study_file)
    config, seeds = _config(study), _test_seeds(study)
    settings = replace(FIXED, epochs=config.epochs)
    journal = load_journal(journal_file, asdict(settings))
    scorer = minilm_scorer(settings)
    splits_of = {}
    for task, entry in study["tasks"].items():  # every task's splits checked before anything trains
        splits = make_splits(task, config.dev_fraction, seed=0, max_train=config.max_train, max_eval=config.max_eval)
        if splits.sizes() != entry["sizes"]:
            raise ValueError(f"{task}: the splits are {splits.sizes()} here and {entry['sizes']} in {study_file}")
        splits_of[task] = splits
    record = {"journal": str(journal_file), "trained": 0, "read": 0, "seconds": {}}
    for task, entry in study["tasks"].items():
        splits, used, before = splits_of[task], [], len(journal["runs"])
        score = _journaled(scorer, journal, journal_file, task, splits, used, progress)
        result = protocol(score, splits, config.lrs, seeds)
        if config.label_sizes:
            curve_seeds = list(config.seeds)  # every row's curve has the study's own seeds
            all_labels = result["test"]["scores"][: len(curve_seeds)]
            result["label_efficiency"] = label_efficiency(
                score, splits, result["lr"], config.label_sizes, curve_seeds, all_labels
            )
        result["seconds"] = round(sum(e["seconds"] for e in used), 1)  # the fine-tunes' own time, whenever run
        entry["models"] = _with_row(entry["models"], result)
        trained = len(journal["runs"]) - before
        record["trained"] += trained
        record["read"] += len(used) - trained
        record["seconds"][task] = result["seconds"]
        if progress:
            print_row(task, ROW, result)
    average = {t: e["models"][ROW] for t, e in study["tasks"].items()}
    study["average"] = _with_row(study["average"], task_average(average))
    study["config"]["minilm_finetune"] = True
    study["added_minilm"] = record
    write_results(out, study)
    return study
