"""Widen a finished study's learning-rate sweep: the new rates on dev for every fine-tuned row, test again where
the choice moves.

    python -m llmedu.cramming widen-sweep --study study.json --runs crammed=runs/crammed --lrs 1e-4 1.6e-3 3.2e-3 --out wide.json

A sweep whose best rate is its first or its last has not found the model's best rate: lesson 25's control
(random init) chose 8e-4, the top of 2e-4..8e-4, on two tasks of three, and one rate further up it scored
4 points more on BBC News dev. A protocol that stops a model short of its best rate handicaps it; the gap it
reports is an upper estimate. This puts the protocol right without running the study again:

1. each new rate trains on train and is scored on dev with the sweep's seed (``config.seeds[0]``), for every
   fine-tuned row (the same grid for every model, as ``evaluate.protocol`` asks);
2. the rate is chosen again over the whole grid, by ``evaluate.best_rate`` (sorted, so ties go to the lower
   rate, as in the first sweep, which the module refuses unless it was sorted);
3. where the choice moved, the new rate trains with every test seed the row has (the study's and any added
   by ``more_seeds``) and is scored on test, and its label-efficiency curve is run again at the new rate;
   the row keeps its earlier rate and test scores as ``before_widening`` (its ``seconds`` stay the first
   protocol's; ``widened.seconds`` holds the widening's, per task). Where it did not move, nothing is
   trained again: the earlier runs are what the wider sweep would have run.

The deterministic rows (linear probes, baselines) have no rate and do not change; the task averages are
computed again; ``config.lrs`` becomes the whole grid and ``widened`` says what was added, what moved, in
how long. The file is written after every task; until the last, ``widened.unfinished`` is true and the
fine-tuned rows have no average. A study is widened once, with all its new rates (a widened one is refused),
into another file (a stopped widening starts again from the study).
As in ``more_seeds``, the runs must be the ones the study measured (``summary.json`` and the random-init
probe's fingerprint), every fine-tuned row must hold a test score per seed, and rows borrowed from another
study (``--controls-from``) are taken from that study widened to the same grid, its seeds and its scores
before the widening equal to these; all of this is checked before anything trains.

Left out: widening the epochs or the batch size, and a second look at dev for the rows that did not move.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

from ..evaluate import best_rate, label_efficiency, summarize, task_average
from .more_seeds import _check_not_added, _check_runs, _config, _test_seeds, _tuned_rows
from .report import load_study
from .study import FINGERPRINT, _models, check_fingerprint, checked_splits, print_row, write_results

__all__ = ["widen_sweep"]


def _grid(old: Sequence[float], new: Sequence[float]) -> list[float]:
    if list(old) != sorted(old):
        raise ValueError(f"the study's sweep {list(old)} is not in rising order: its ties would not match a wider one")
    bad = [lr for lr in new if not math.isfinite(lr) or lr <= 0]
    if not new or bad or len(set(new)) != len(new) or set(new) & set(old):
        raise ValueError(f"give new positive rates, each once; the study swept {list(old)}, got {list(new)}")
    return sorted([*old, *new])


def _check_seeds(study: dict, rows: list[str], seeds: list[int], source) -> None:
    """Every fine-tuned row must hold one test score per seed: a moved row trains them all again."""
    for task, entry in study["tasks"].items():
        for row in rows:
            if len(entry["models"][row]["test"]["scores"]) != len(seeds):
                raise ValueError(f"{task}, {row}: {source} holds another number of test scores than its seeds {seeds}")


def _borrowed_row(source: dict, grid: list[float], task: str, row: str, ours: dict, where) -> dict:
    """The row as the source study holds it after its own widening, once what it held before is ours."""
    theirs = source["tasks"][task]["models"][row]
    then = theirs.get("before_widening", theirs)
    same_dev = all(theirs["dev"].get(k) == v for k, v in ours["dev"].items())
    if (
        source.get("widened") is None
        or source["config"]["lrs"] != grid
        or set(theirs["dev"]) != {str(lr) for lr in grid}
    ):
        raise ValueError(f"{task}, {row}: borrowed from {where}, which has not been widened to {grid}: widen it first")
    if not same_dev or then["lr"] != ours["lr"] or then["test"] != ours["test"]:
        raise ValueError(f"{task}, {row}: {where} held other dev or test scores before its widening than this study")
    return theirs | {"borrowed": True}


def widen_sweep(
    study_file, runs: dict[str, str], lrs: Sequence[float], out=None, progress: bool = True, controls_from=None
) -> dict:
    """Sweep ``lrs`` too for every fine-tuned row of ``study_file``; write ``out`` (JSON) after every task.
    ``controls_from``: the widened copy of the study the borrowed rows came from (default: as recorded)."""
    if out is not None and Path(out).resolve() == Path(study_file).resolve():
        raise ValueError(
            f"write the widened study to another file than {study_file}: a stopped widening starts again from it"
        )
    study = load_study(study_file)
    _check_not_added(study, study_file)
    if "widened" in study:
        raise ValueError(f"{study_file} was widened already: widen the study it came from, with all the rates at once")
    config = _config(study)
    grid = _grid(config.lrs, [float(lr) for lr in lrs])
    new = [lr for lr in grid if lr not in config.lrs]
    _check_runs(study, runs)
    tuned, test_seeds = _tuned_rows(study), _test_seeds(study)
    _check_seeds(study, tuned, test_seeds, study_file)
    borrowed = [row for row in study.get("controls_from", {}).get("rows", []) if row in tuned]  # the rest keep
    source_file = (controls_from or study["controls_from"]["file"]) if borrowed else None
    if borrowed:  # every borrowed row checked before anything trains
        source = load_study(source_file)
        their_seeds = _test_seeds(source)
        if their_seeds != test_seeds:
            raise ValueError(f"{source_file} holds the test seeds {their_seeds}, this study {test_seeds}")
        taken = {
            task: {row: _borrowed_row(source, grid, task, row, entry["models"][row], source_file) for row in borrowed}
            for task, entry in study["tasks"].items()
        }
    ordered = {name: runs[name] for name in study["pretraining"]}  # random init takes the first run's shape
    checked = {study_file: study} | ({source_file: source} if borrowed else {})  # borrowed rows: its splits too
    splits_of = checked_splits(config, checked)  # every task, before any model is loaded
    models = _models(ordered, config, controls="controls_from" not in study)
    record = {"lrs": new, "rows": tuned, "moved": {}, "seconds": {}, "unfinished": True}
    if borrowed:
        record["controls_from"] = str(source_file)
    study["widened"] = record
    averages = study["average"]
    study["average"] = {k: v for k, v in averages.items() if k not in tuned}  # none mixes widened and not, part-way
    for task, entry in study["tasks"].items():
        splits = splits_of[task]
        probe = models[FINGERPRINT][0](splits.train, splits.test, None, config.seeds[0])
        check_fingerprint(study, task, probe, study_file)
        start, moved = time.perf_counter(), []
        for row in tuned:
            old = entry["models"][row]
            if row in borrowed:
                result = taken[task][row]
            else:
                scorer = models[row][0]
                dev = {float(lr): score for lr, score in old["dev"].items()}
                dev |= {lr: scorer(splits.train, splits.dev, lr, config.seeds[0]) for lr in new}
                result = old | {"dev": {str(lr): dev[lr] for lr in grid}, "lr": best_rate(dev, grid)}
                if result["lr"] != old["lr"]:
                    result["test"] = summarize([scorer(splits.train, splits.test, result["lr"], s) for s in test_seeds])
                    if config.label_sizes:
                        result["label_efficiency"] = label_efficiency(
                            scorer, splits, result["lr"], config.label_sizes, config.seeds, result["test"]["scores"][: len(config.seeds)]
                        )  # fmt: skip
                    result["before_widening"] = {"lr": old["lr"], "test": old["test"]}
            entry["models"][row] = result
            if result["lr"] != old["lr"]:
                moved.append(row)
            if progress:
                print_row(task, row, result)
        record["moved"][task] = moved
        record["seconds"][task] = round(time.perf_counter() - start, 1)
        write_results(out, study)
    for row in tuned:
        averages[row] = task_average({t: e["models"][row] for t, e in study["tasks"].items()})
    study["average"] = averages
    study["config"]["lrs"] = grid
    del record["unfinished"]
    write_results(out, study)
    return study
