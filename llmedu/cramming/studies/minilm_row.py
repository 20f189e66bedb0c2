"""MiniLM fine-tuned, added to a finished study under the study's own protocol, in runs that survive stopping.

    python -m llmedu.cramming add-minilm --study study.json --journal minilm_journal.json --out study.json

Lesson 25's studies keep all-MiniLM-L6-v2 as a linear probe only (``--minilm-probe-only``): on 2 CPU cores one of
its fine-tunes on 2,000 Rotten Tomatoes reviews takes about 5 minutes, six times ours, and the widened studies'
protocol asks 20 fine-tunes per task (six rates on dev, five test seeds, label curves of three sizes over three
seeds), about thirteen of them full-size: some four hours for three tasks. This adds the row ``MiniLM-L6``
afterwards, as the study would have run it: ``evaluate.protocol`` with the study's rates and every test seed it
holds (its own and any ``more_seeds`` added), then ``evaluate.label_efficiency`` at the chosen rate with the
study's own seeds, as every other row's curve; the task averages are computed again, ``config.minilm_finetune``
becomes true, and ``added_minilm`` says how (the journal, runs trained and read, seconds, any choice at the edge
of the grid, which ``widen_sweep`` calls a handicap: the grid was set for our encoders, not for MiniLM).

The study must be finished and its splits the ones it was scored on: every task of its config, an average for
every row, a test score per seed in every fine-tuned row, and the digests of its splits (``study.check_splits``:
sha256 of the examples and labels, in order) equal to those of the splits made here.

Hours of fine-tuning must not be lost to a closed laptop. Every fine-tune's score goes into a journal (JSON,
replaced whole and synced after each run, so a stop leaves the last complete one), under a key of digests of the
training and the scored examples, the rate and the seed; the journal names the row, the fine-tuning settings, a
digest of MiniLM's files and the torch and transformers versions, and refuses a run with others; each run
names the machine it ran on (its seconds, and its last bits, are that machine's). Run the same
command again and every score the journal holds is read back; only the rest trains. A second study with the same
protocol and splits (lesson 25's hour, whose controls come from the half-hour's) finds every run there and
trains nothing. One process at a time may write a journal (a lock, released when the process ends, however it
ends). Each entry carries a digest of itself and its key (``sha256``), as a checkpoint does: an entry edited
by hand (a score changed, which could move the chosen rate) or stored as text is refused, named with its file.
The study's file is written once, when every task is done, so ``--out`` may be ``--study`` itself.
``more_seeds`` and ``widen_sweep`` refuse a study with the added row: grow the study it was added to, then add
the row again with the same journal (the runs it holds are read back).

Left out: the code of the fine-tune is not in the key (a change to ``finetune.fit_classifier`` needs a new
journal), and journaling the other rows (ours take a minute).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, replace
from importlib.metadata import version
from pathlib import Path

import torch

from ...data.references import reference_files
from ...hardware.probe import machine_summary
from ..evaluate import Data, Scorer, Splits, label_efficiency, protocol, task_average
from ..finetune import FIXED
from .encoders import minilm_scorer
from .more_seeds import _config, _test_seeds, _tuned_rows
from .report import load_study
from .study import StudyConfig, checked_splits, print_row, write_results
from .widen_sweep import _check_seeds

__all__ = ["ROW", "add_minilm", "journal_identity", "load_journal", "entry_digest"]

ROW = "MiniLM-L6"  # the row's name, as ``study._models`` gives it when a study fine-tunes MiniLM itself
_KIND = "llmedu fine-tune journal"


def journal_identity(settings: dict) -> dict:
    """What a journaled score depends on besides its data, rate and seed: the row, the fine-tuning settings,
    MiniLM's files (a digest) and the versions of the code that trains it."""
    files = hashlib.sha256()
    for name, path in sorted(reference_files("all-minilm-l6-v2").items()):
        files.update(name.encode() + path.read_bytes())
    return {
        "row": ROW,
        "settings": settings,
        "model_files": files.hexdigest()[:16],
        "torch": torch.__version__,
        "transformers": version("transformers"),
    }


def load_journal(path, identity: dict, allow_unchecked: bool = False) -> dict:
    """The journal at ``path`` (a new, empty one if there is none); an error for a file that is not one, one
    whose runs were made by another row, settings, model or library version, or an entry that fails its digest.
    ``allow_unchecked``: read the entries of a journal written before entries carried digests, with a warning."""
    path = Path(path)
    if not path.exists():
        return {"kind": _KIND, **identity, "runs": {}}
    try:
        journal = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a fine-tune journal: {error}") from None
    if not isinstance(journal, dict) or journal.get("kind") != _KIND or not isinstance(journal.get("runs"), dict):
        raise ValueError(f"{path} is not a fine-tune journal (no 'kind': {_KIND!r} and 'runs')")
    differ = [f"{k}: {journal.get(k)} there, {v} here" for k, v in identity.items() if journal.get(k) != v]
    if differ:
        raise ValueError(f"{path} journals other fine-tunes ({'; '.join(differ)}): its scores do not apply")
    _check_entries(path, journal["runs"], allow_unchecked)
    return journal


def entry_digest(key: str, entry: dict) -> str:
    """The sha256 of a journal entry and its key (the data's digests, the rate and the seed), its own digest left out."""
    body = {k: v for k, v in entry.items() if k != "sha256"}
    return hashlib.sha256(json.dumps([key, body], sort_keys=True).encode()).hexdigest()


def _check_entries(path, runs: dict, allow_unchecked: bool) -> None:
    """Every entry's score a number and its digest the one recorded when it was journaled."""
    unchecked = []
    for key, entry in runs.items():
        score = entry.get("score") if isinstance(entry, dict) else None
        if not isinstance(score, (int, float)) or isinstance(score, bool):
            raise ValueError(f"{path}: entry {key!r} holds the score {score!r}, not a number: remove the entry (it "
                             "is trained again) or restore the file")  # fmt: skip
        if "sha256" not in entry:
            unchecked.append(key)
        elif entry["sha256"] != entry_digest(key, entry):
            raise ValueError(f"{path}: entry {key!r} differs from the digest recorded when it was journaled: it was "
                             "edited or damaged; remove the entry (it is trained again) or restore the file")  # fmt: skip
    if unchecked:
        message = f"{path}: {len(unchecked)} entries record no digest (the first: {unchecked[0]!r})"
        if not allow_unchecked:
            raise ValueError(f"{message}, so they cannot be checked: a journal written before entries carried "
                             "digests (read it with load_journal(..., allow_unchecked=True)), or one edited")  # fmt: skip
        warnings.warn(f"{message}; read unchecked, as asked", RuntimeWarning, stacklevel=3)


@contextmanager
def _locked(path):
    """Hold ``path``.lock while writing the journal: two writers would each drop the other's runs. The kernel
    releases the lock when the process ends, so a killed run leaves nothing to clean up."""
    lock = Path(path).with_name(Path(path).name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another process is writing {path} (it holds {lock}): wait for it to end") from None
        yield


def _journaled(scorer: Scorer, journal: dict, path, task: str, splits: Splits, used: list, progress: bool) -> Scorer:
    """``scorer`` that reads a run's score from the journal if it is there, else trains, journals and saves it
    (``write_results``: the file replaced whole, so a stop mid-write leaves the previous journal).
    Each run it returns (read or trained) is appended to ``used`` as its journal entry."""
    named, machine = {splits.dev.digest(): "dev", splits.test.digest(): "test"}, machine_summary()

    def score(train: Data, test: Data, lr: float, seed: int) -> float:
        scored_on = test.digest()
        key = f"{train.digest()}/{scored_on}/{lr!r}/{seed}"
        entry = journal["runs"].get(key)
        if entry is None:
            start = time.perf_counter()
            accuracy = scorer(train, test, lr, seed)
            entry = {"task": task, "train": len(train.texts), "scored_on": named.get(scored_on, scored_on),
                     "lr": lr, "seed": seed, "score": accuracy, "seconds": round(time.perf_counter() - start, 1),
                     "machine": machine}  # fmt: skip
            entry["sha256"] = entry_digest(key, entry)
            journal["runs"][key] = entry
            write_results(path, journal)
            if progress:
                print(f"{task:<16} {ROW}: {entry['train']} examples, scored on {entry['scored_on']}, lr {lr}, "
                      f"seed {seed}: {accuracy:.4f} in {entry['seconds']:.0f} s", flush=True)  # fmt: skip
        used.append(entry)
        return entry["score"]

    return score


def _check(study: dict, source) -> tuple[StudyConfig, list[int]]:
    """The study's protocol and test seeds, once it is shown finished and without the row; an error otherwise."""
    config = _config(study)
    if any(ROW in entry["models"] for entry in study["tasks"].values()):
        raise ValueError(f"{source} has a {ROW!r} row already")
    if not config.minilm:
        raise ValueError(f"{source} was run without MiniLM's rows (--no-minilm): its protocol leaves MiniLM out")
    rows = list(next(iter(study["tasks"].values()))["models"])
    unfinished = study.get("widened", {}).get("unfinished")
    if unfinished or list(study["tasks"]) != list(config.tasks) or set(study["average"]) != set(rows):
        raise ValueError(f"{source} is not a finished study (a task, or an average, is missing): finish it first")
    seeds = _test_seeds(study)
    _check_seeds(study, _tuned_rows(study), seeds, source)
    return config, seeds


def _with_row(models: dict, result: dict) -> dict:
    """``models`` with the row placed where a study of its own puts it: before MiniLM's probe."""
    names = list(models)
    at = names.index(f"{ROW}, linear probe")
    return {**{n: models[n] for n in names[:at]}, ROW: result, **{n: models[n] for n in names[at:]}}


def add_minilm(study_file, journal_file, out=None, progress: bool = True) -> dict:
    """``study_file`` with the row ``MiniLM-L6`` added under its protocol; written to ``out`` (JSON) when done.
    Scores come from ``journal_file`` where it holds them; every new fine-tune is journaled as it ends."""
    if out is not None and Path(out).resolve() == Path(journal_file).resolve():
        raise ValueError(f"write the study to another file than the journal {journal_file}")
    study = load_study(study_file)
    config, seeds = _check(study, study_file)
    settings = replace(FIXED, epochs=config.epochs)
    splits_of = checked_splits(config, {study_file: study})
    scorer = minilm_scorer(settings)
    record = {"journal": str(journal_file), "trained": 0, "read": 0, "seconds": {}, "at_edge": {}}
    with _locked(journal_file):  # read under the lock too: a writer that just ended may have added runs
        journal = load_journal(journal_file, journal_identity(asdict(settings)))  # checked before the first fine-tune
        for task, entry in study["tasks"].items():
            splits, used, before = splits_of[task], [], len(journal["runs"])
            score = _journaled(scorer, journal, journal_file, task, splits, used, progress)
            result = protocol(score, splits, config.lrs, seeds)
            if result["lr"] in (min(config.lrs), max(config.lrs)):
                record["at_edge"][task] = result["lr"]
                if progress:
                    print(
                        f"{task:<16} {ROW}: chose {result['lr']}, the edge of the grid {list(config.lrs)}", flush=True
                    )
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
