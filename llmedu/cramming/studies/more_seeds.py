"""More test seeds for a finished study's fine-tuned rows, at the rates its dev sweep chose.

    python -m llmedu.cramming more-seeds --study study.json --runs crammed=runs/crammed --seeds 3 4 --out study.json

Three seeds leave a gap of a few points hard to read: lesson 25's hour gave +3.8 +- 3.0 points over 3 seeds
(p about 0.16 with 2 degrees of freedom), half of it from one run of the control. More seeds narrow the
spread without a second look at the dev split: each fine-tuned row keeps the rate that dev chose
(``evaluate.protocol``'s first step), each new seed trains on the same train split and is scored on the same
test split, and its score joins the row's ``test.scores``; the task averages are computed again. Nothing else
changes: the linear probes and the baselines are deterministic (their one score stands for every seed), the
label-efficiency curves keep the seeds they were run with, and ``config`` keeps the protocol as it was run.
``added_seeds`` in the file says which seeds were added, to which rows, in how long.

The runs must be the ones the study measured. Each folder's ``summary.json`` must equal the study's record
of it, and the random-init linear probe, measured again (deterministic: frozen features and a convex fit),
must repeat the study's on every task, as ``study.py`` checks before borrowing rows: the same tokenizer,
shape and splits. Rows the study borrowed from another study (``--controls-from``) take their new scores from
that study (or from the copy ``controls_from`` names), which must hold the same seeds already, its earlier
scores equal to these.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from ..evaluate import summarize, task_average
from .report import load_study
from .study import (
    FINGERPRINT,
    StudyConfig,
    _models,
    check_fingerprint,
    checked_splits,
    print_row,
    write_results,
)

__all__ = ["add_seeds"]


def _config(study: dict) -> StudyConfig:
    return StudyConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in study["config"].items()})


def _test_seeds(study: dict) -> list[int]:
    """The seeds a study's fine-tuned rows were scored on: its own, then any that ``add_seeds`` added."""
    return list(_config(study).seeds) + study.get("added_seeds", {}).get("seeds", [])


def _tuned_rows(study: dict) -> list[str]:
    """The rows with a learning rate (the fine-tuned ones), in the study's order."""
    return [row for row, result in next(iter(study["tasks"].values()))["models"].items() if result["lr"] is not None]


def _check_not_added(study: dict, source) -> None:
    """A row that ``minilm_row.add_minilm`` added has its runs in a journal, which this module does not keep."""
    if "added_minilm" in study:
        raise ValueError(
            f"{source} holds a MiniLM row that add-minilm added, its runs journaled in "
            f"{study['added_minilm']['journal']}: grow the study it was added to, then add-minilm again with that "
            "journal (it reads back the runs it holds)"
        )


def _check_runs(study: dict, runs: dict[str, str]) -> None:
    measured = list(study["pretraining"])
    if sorted(runs) != sorted(measured):
        raise ValueError(f"the study measured the runs {measured}; give exactly those (got {list(runs)})")
    for name, folder in runs.items():
        summary = Path(folder) / "summary.json"
        if not summary.is_file() or json.loads(summary.read_text()) != study["pretraining"][name]["summary"]:
            raise ValueError(f"{folder} is not the run the study measured as {name!r}: its summary.json differs")


def add_seeds(
    study_file, runs: dict[str, str], seeds: Sequence[int], out=None, progress: bool = True, controls_from=None
) -> dict:
    """Score every fine-tuned row of ``study_file`` with ``seeds`` too; write ``out`` (JSON) after every task.
    ``controls_from``: where borrowed rows find their new seeds (default: the study they were borrowed from,
    as recorded, or the widened copy of it a widened study took them from; name another file when the seeds
    were added to a copy of it)."""
    study = load_study(study_file)
    _check_not_added(study, study_file)
    config, seeds = _config(study), [int(s) for s in seeds]
    before = study.get("added_seeds", {"seeds": [], "seconds": {}})  # seeds added by an earlier call
    done = _test_seeds(study)
    if not seeds or len(set(seeds)) != len(seeds) or set(seeds) & set(done):
        raise ValueError(f"give new seeds, each once; the study already has {done}, got {seeds}")
    _check_runs(study, runs)
    ordered = {name: runs[name] for name in study["pretraining"]}  # random init takes the first run's shape
    borrowed = study.get("controls_from", {}).get("rows", [])
    recorded = study.get("widened", {}).get("controls_from") or study.get("controls_from", {}).get("file")
    source_file = (controls_from or recorded) if borrowed else None  # a widened study's rows: its widened source
    source = load_study(source_file) if borrowed else None
    their_seeds = _test_seeds(source) if borrowed else []
    checked = {study_file: study} | ({source_file: source} if borrowed else {})  # borrowed rows: its splits too
    splits_of = checked_splits(config, checked)  # every task, before any model is loaded
    models = _models(ordered, config, controls=not borrowed)
    tuned = _tuned_rows(study)
    record = {"seeds": before["seeds"] + seeds, "rows": tuned, "seconds": dict(before["seconds"])}
    if borrowed:
        record["controls_from"] = str(source_file)
    for task, entry in study["tasks"].items():
        splits = splits_of[task]
        probe = models[FINGERPRINT][0](splits.train, splits.test, None, config.seeds[0])
        check_fingerprint(study, task, probe, study_file)
        start = time.perf_counter()
        for row in tuned:
            result = entry["models"][row]
            old = result["test"]["scores"]
            if row in borrowed:
                theirs = source["tasks"][task]["models"][row]["test"]["scores"]
                if theirs[: len(old)] != old or their_seeds[: len(done) + len(seeds)] != done + seeds:
                    raise ValueError(
                        f"{task}, {row}: borrowed from {source_file}, which does not hold "
                        f"seeds {seeds} after these scores: add them there first"
                    )
                new = theirs[len(old) : len(old) + len(seeds)]
            else:
                scorer = models[row][0]
                new = [scorer(splits.train, splits.test, result["lr"], s) for s in seeds]
            result["test"] = summarize(old + new)
            if progress:
                print_row(task, row, result)
        record["seconds"][task] = round(record["seconds"].get(task, 0.0) + time.perf_counter() - start, 1)
        study["added_seeds"] = record
        write_results(out, study)
    for row in tuned:
        study["average"][row] = task_average({t: e["models"][row] for t, e in study["tasks"].items()})
    write_results(out, study)
    return study
