"""The capstone's full evaluation in one call: every encoder and calibration row, every task, one JSON.

    python -m llmedu.cramming evaluate --runs crammed=runs/crammed --out runs/evaluation.json
    python -m llmedu.cramming evaluate --runs crammed=runs/crammed --pretrain 1h --out runs/evaluation.json

For each task of ``StudyConfig.tasks`` (``evaluate.TASKS``) and each model, ``evaluate.protocol``
(rate chosen on dev, test over seeds), then ``evaluate.label_efficiency`` at the chosen rate (its all-labels point is the protocol's test runs), then
``evaluate.task_average`` per model: the headline. The models:

* each pretraining run, fine-tuned, and its frozen encoder under a linear probe;
* random weights of the first run's shape, fine-tuned and probed: the control;
* all-MiniLM-L6-v2, fine-tuned and probed (``minilm=True``; ``minilm_finetune=False`` keeps only the
  probe, as its fine-tunes cost about 6x ours on a CPU): what far longer pretraining gives;
* the majority class and TF-IDF + logistic regression.

Every run's pretraining figures go in too: its summary (MLM loss, passes over the data, the
held-out history if it was recorded) and the unigram cross-entropy of its corpora with its own
tokenizer, the line an MLM loss plot needs. The JSON is rewritten after every task, so a long run
that is stopped keeps what it finished.

``controls_from`` (``--controls-from STUDY.json``) reuses an earlier study's control and calibration rows
(random init fine-tuned, MiniLM, majority class, TF-IDF): they depend on the tasks, the protocol and the
first run's tokenizer and shape, not on its pretrained weights, and they cost as much as the run's own
rows. Two checks guard the reuse: the earlier study's config must equal this one, and the random-init
linear probe, measured again here (a minute: frozen features and one convex fit), must equal the earlier
one on every task. That probe reads the tokenizer, the random weights of the shape and the splits, so it
fails for any of them changed; what it cannot see is the fine-tuning: its code, and its settings other than
epochs (``finetune.FIXED``, not part of ``StudyConfig``), may not change between the two studies (the result
file records the borrowing, so the reader knows).

``--pretrain BUDGET`` pretrains each run folder that does not exist yet with the crammed recipe on
the corpora that no task's text comes from (``evaluate.check_no_overlap``), deduplicated, with the
held-out loss recorded every ``eval_every`` steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..data import CORPORA, packed_data
from ..evaluate import TASKS, Splits, check_no_overlap, label_efficiency, make_splits, protocol, task_average
from ..finetune import FIXED, duration
from ..pretrain import PretrainRun, load_run, pretrain, read_run
from .calibration import unigram_cross_entropy
from .encoders import baseline_scorers, encoder_features, finetune_scorer, minilm_features, minilm_scorer, probe_scorer
from .report import load_study

__all__ = [
    "StudyConfig",
    "run_study",
    "pretrain_for_study",
    "unigram_line",
    "borrowable_rows",
    "check_fingerprint",
    "check_splits",
    "checked_splits",
    "task_splits",
    "repeats",
    "print_row",
    "write_results",
]

FINGERPRINT = "random init, linear probe"  # measured again by a study that borrows the other controls
REPEAT_EXAMPLES = 2  # a score measured again may differ by this many examples: see ``repeats``


@dataclass(frozen=True)
class StudyConfig:
    tasks: tuple[str, ...] = tuple(TASKS)
    lrs: tuple[float, ...] = (1e-4, 2e-4, 4e-4, 8e-4)  # lesson 25's range: 1e-4 suits pretrained, 4e-4+ random
    seeds: tuple[int, ...] = (0, 1, 2)
    label_sizes: tuple[int | None, ...] = (100, 300, 1000, 3000, None)  # None: all the training labels
    epochs: int = FIXED.epochs
    dev_fraction: float = 0.1
    max_train: int | None = None  # cap the train split (after the dev split is taken): for quick runs
    max_eval: int | None = None  # cap the dev and test splits: for quick runs
    minilm: bool = True
    minilm_finetune: bool = True  # False: MiniLM's linear probe only (its fine-tunes cost ~6x ours on a CPU)

    def __post_init__(self):
        for name in self.tasks:
            if name not in TASKS:
                raise KeyError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
        if not self.lrs:
            raise ValueError("the learning-rate sweep is empty")
        if len(self.seeds) < 1:
            raise ValueError("give at least one seed")


def unigram_line(run) -> float:
    """The unigram cross-entropy (nats) of a run's held-out text under its training text, with its tokenizer."""
    saved, (_, tokenizer) = read_run(run), load_run(run)
    # the text the run trained on and was measured on
    data = packed_data(tokenizer, saved.corpora, saved.recipe.model.max_seq_len, saved.max_chars, saved.dedup)
    train, held = data.train, data.validation
    special = [tokenizer.vocab[t] for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]") if t in tokenizer.vocab]
    return unigram_cross_entropy(train, held, tokenizer.vocab_size, special)


def pretrain_for_study(out, recipe, budget_seconds: float, tasks, eval_every: int = 50, **pretrain_kw) -> dict:
    """Pretrain ``recipe`` for the study: no corpus that holds a task's text, deduplicated, held-out history."""
    overlap = {c for name in tasks for c in TASKS[name].overlap}
    corpora = tuple(c for c in CORPORA if c not in overlap)
    run = PretrainRun(recipe, budget_seconds, corpora=corpora, dedup=True, max_chars=pretrain_kw.pop("max_chars", None))
    return pretrain(out, run, eval_every=eval_every, **pretrain_kw)


def _models(runs: dict[str, str], config: StudyConfig, controls: bool = True) -> dict[str, tuple]:
    """name -> (scorer, sweep): the sweep is the config's rates, or (None,) for models without a rate.
    ``controls=False``: only the runs' rows and the fingerprint (the others are borrowed)."""
    settings = replace(FIXED, epochs=config.epochs)
    rates, none = config.lrs, (None,)
    models = {}
    for name, folder in runs.items():
        models[name] = (finetune_scorer(folder, settings=settings), rates)
        models[f"{name}, linear probe"] = (probe_scorer(encoder_features(folder)[0]), none)
    first = next(iter(runs.values()))
    if controls:
        models["random init"] = (finetune_scorer(first, from_scratch=True, settings=settings), rates)
    models[FINGERPRINT] = (probe_scorer(encoder_features(first, from_scratch=True)[0]), none)
    if not controls:
        return models
    if config.minilm and config.minilm_finetune:
        models["MiniLM-L6"] = (minilm_scorer(settings), rates)
    if config.minilm:
        models["MiniLM-L6, linear probe"] = (probe_scorer(minilm_features()[0]), none)
    for name, scorer in baseline_scorers().items():
        models[name] = (scorer, none)
    return models


def borrowable_rows(earlier: dict) -> list[str]:
    """The rows of a study that do not depend on its runs' pretrained weights: every row but the runs' own
    (fine-tuned and probed) and the fingerprint, which a borrowing study measures again."""
    own = {row for name in earlier["pretraining"] for row in (name, f"{name}, linear probe")}
    rows = next(iter(earlier["tasks"].values()))["models"]
    return [row for row in rows if row not in own and row != FINGERPRINT]


def _check_borrowing(earlier: dict, config: StudyConfig, source) -> None:
    now = json.loads(json.dumps(asdict(config)))  # tuples as lists, as the earlier file holds them
    then = earlier["config"]
    differ = [f"{k}: {then.get(k)} there, {now[k]} here" for k in now if then.get(k) != now[k]]
    if differ:
        added = (
            " (add-minilm added its MiniLM row: borrow from the study it was added to)"
            if "added_minilm" in earlier
            else ""
        )
        raise ValueError(
            f"{source} was run with another protocol ({'; '.join(differ)}): its controls do not apply{added}"
        )
    missing = [t for t in config.tasks if t not in earlier["tasks"]]
    if missing:
        raise ValueError(f"{source} has no results for {', '.join(missing)}")


def repeats(ours: float, theirs: float, examples: int) -> bool:
    """Whether an accuracy on ``examples`` examples, measured again, repeats an earlier one: within
    ``REPEAT_EXAMPLES`` examples. A fit from zero on the same features repeats exactly on one machine, but not
    across CPUs: float32 sums round by the vector units' order (measured on the TF-IDF row: of the 3,655 tweet
    test examples, 1 changes class between the Intel AVX-512 machine that ran the studies and an AMD EPYC; dev
    and the two other tasks repeated exactly). How far the random-init probe moves across CPUs was not measured
    (its float32 encoder features may round more than TF-IDF's): if it moves further, the check refuses, and
    says by how many examples."""
    return abs(ours - theirs) * examples <= REPEAT_EXAMPLES + 1e-6


def task_splits(task: str, config: StudyConfig) -> Splits:
    """A task's splits under a study's protocol: split seed 0, the config's dev fraction and caps."""
    return make_splits(task, config.dev_fraction, seed=0, max_train=config.max_train, max_eval=config.max_eval)


def check_splits(entry: dict, splits, task: str, source) -> None:
    """The splits made here must be those ``source`` scored ``task`` on (its task ``entry``): the same examples
    and labels in the same order, by their digests (``Splits.digests``), which no CPU rounds."""
    if "digests" not in entry:
        raise ValueError(f"{source} records no digests of the {task} splits: it predates them, so nothing shows "
                         "that its splits are these")  # fmt: skip
    if splits.digests() != entry["digests"]:
        raise ValueError(f"{task}: the splits made here ({splits.sizes()}) are not the ones {source} was scored on "
                         f"({entry['sizes']}): another data file, split seed or cap")  # fmt: skip


def checked_splits(config: StudyConfig, studies: dict) -> dict[str, Splits]:
    """Every task's splits (``task_splits``), made once and checked against each study of ``studies``
    (``{source: study}``) that scored them (``check_splits``): all of it before any fine-tune, so that a mismatch
    on the last task costs no work on the first."""
    splits_of = {task: task_splits(task, config) for task in config.tasks}
    for source, study in studies.items():
        for task, splits in splits_of.items():
            if task not in study["tasks"]:
                raise ValueError(f"{source} holds no results for {task}: an unfinished study, or another protocol")
            check_splits(study["tasks"][task], splits, task, source)
    return splits_of


def check_fingerprint(earlier: dict, task: str, ours: float, source) -> None:
    """The random-init probe's test score on ``task``, measured here, must repeat the one in ``earlier``
    (``repeats``): the same tokenizer and model shape (the splits are checked by ``check_splits``)."""
    theirs = earlier["tasks"][task]["models"][FINGERPRINT]["test"]["mean"]
    examples = earlier["tasks"][task]["sizes"]["test"]
    if not repeats(ours, theirs, examples):
        raise ValueError(
            f"{task}: the random-init probe scores {ours:.6f} here and {theirs:.6f} in {source}, "
            f"{abs(ours - theirs) * examples:.0f} of {examples} examples apart: another tokenizer or model shape, "
            "so its rows do not apply to this run"
        )


def _borrow(earlier: dict, rows: list[str], task: str, measured: dict, source) -> dict:
    """The earlier study's ``rows`` for ``task``, once the fingerprint measured here repeats its own."""
    check_fingerprint(earlier, task, measured["test"]["mean"], source)
    models = earlier["tasks"][task]["models"]
    return {row: models[row] | {"borrowed": True} for row in rows}


def run_study(
    runs: dict[str, str], config: StudyConfig = StudyConfig(), out=None, progress: bool = True, controls_from=None
) -> dict:
    """Evaluate pretraining runs ``{name: folder}`` and the calibration rows; write ``out`` (JSON) as it goes.
    ``controls_from``: an earlier study's JSON whose control rows are reused (see the module's docstring)."""
    if not runs:
        raise ValueError("give at least one pretraining run")
    for folder in runs.values():
        saved = read_run(folder)
        check_no_overlap(config.tasks, saved.corpora)
        if not (Path(folder) / "summary.json").is_file():  # stopped: its last checkpoint is not the run's end
            raise ValueError(
                f"{folder} holds a pretraining run that did not finish (no summary.json): resume it first "
                f"(python -m llmedu.cramming pretrain --out {folder} --resume, with its budget)"
            )
    earlier = None
    if controls_from is not None:
        earlier = load_study(controls_from)
        _check_borrowing(earlier, config, controls_from)
        clash = [name for name in runs if name in borrowable_rows(earlier) or name == FINGERPRINT]
        if clash:
            raise ValueError(f"a run may not be named like a control row: {', '.join(clash)}")
    splits_of = checked_splits(config, {} if earlier is None else {controls_from: earlier})  # its controls' splits
    results = {"config": asdict(config), "pretraining": {}, "tasks": {}, "average": {}}
    if earlier is not None:
        rows = borrowable_rows(earlier)
        results["controls_from"] = {"file": str(controls_from), "rows": rows, "check": FINGERPRINT}
    for name, folder in runs.items():
        summary = Path(folder) / "summary.json"
        results["pretraining"][name] = {
            "summary": json.loads(summary.read_text()),
            "unigram_cross_entropy": round(unigram_line(folder), 4),
        }
    models = _models(runs, config, controls=earlier is None)
    if progress:
        models = _announce_cost(models, splits_of, config)
    for task in config.tasks:
        splits = splits_of[task]
        per_model = {}
        for name, (scorer, rates) in models.items():
            start = time.perf_counter()
            result = protocol(scorer, splits, rates, config.seeds)
            if config.label_sizes:
                result["label_efficiency"] = label_efficiency(
                    scorer, splits, result["lr"], config.label_sizes, config.seeds, result["test"]["scores"]
                )
            result["seconds"] = round(time.perf_counter() - start, 1)
            per_model[name] = result
            if progress:
                print_row(task, name, result)
        if earlier is not None:
            per_model |= _borrow(earlier, rows, task, per_model[FINGERPRINT], controls_from)
        results["tasks"][task] = {"sizes": splits.sizes(), "digests": splits.digests(), "models": per_model}
        write_results(out, results)
    for name in next(iter(results["tasks"].values()))["models"]:
        results["average"][name] = task_average({t: r["models"][name] for t, r in results["tasks"].items()})
    write_results(out, results)
    return results


MINILM_COST = 6  # a MiniLM fine-tuning step against one of ours at the CPU shape, as measured on a CPU


def _announce_cost(models: dict, splits_of: dict, config: StudyConfig) -> dict:
    """Print the fine-tunes' optimizer steps before the first, and wrap the first fine-tuned row's scorer so that
    its first fine-tune, timed, gives the estimate of the whole (MiniLM's steps counted at ``MINILM_COST`` ours)."""
    batch = FIXED.batch_size

    def steps(n: int) -> int:
        return config.epochs * (n // batch)

    per_row = 0
    for splits in splits_of.values():
        n = len(splits.train.texts)
        per_row += (len(config.lrs) + len(config.seeds)) * steps(n)
        per_row += sum(len(config.seeds) * steps(min(size, n)) for size in config.label_sizes if size)
    tuned = [name for name, (_, rates) in models.items() if rates != (None,)]
    weight = sum(MINILM_COST if name.startswith("MiniLM") else 1 for name in tuned)
    print(f"evaluate: {len(tuned)} fine-tuned rows ({', '.join(tuned)}) x {len(splits_of)} task(s): "
          f"{per_row * len(tuned):,} optimizer steps, then the probes and baselines; the duration is measured "
          "on the first fine-tune", file=sys.stderr, flush=True)  # fmt: skip
    if not tuned:
        return models
    first, (scorer, rates) = tuned[0], models[tuned[0]]
    timed = []

    def score(train, test, lr, seed):
        start = time.perf_counter()
        value = scorer(train, test, lr, seed)
        if not timed:
            timed.append(time.perf_counter() - start)
            rate = timed[0] / max(1, steps(len(train.texts)))
            print(f"evaluate: the first fine-tune ({steps(len(train.texts))} steps) took {timed[0]:.0f} s: about "
                  f"{duration(rate * per_row * weight)} for every fine-tune (measured on this machine; MiniLM's "
                  f"steps counted at {MINILM_COST}x ours)", file=sys.stderr, flush=True)  # fmt: skip
        return value

    return models | {first: (score, rates)}


def print_row(task: str, name: str, result: dict) -> None:
    """One progress line: a model's chosen rate and its test mean +- std on a task."""
    t = result["test"]
    print(f"{task:<16} {name:<32} lr {result['lr']!s:<7} test {t['mean']:.3f} +- {t['std']:.3f}", flush=True)


def write_results(out, results: dict) -> None:
    """Write a study's results as JSON to ``out`` (its folder made if need be); nothing when ``out`` is None.
    The file is replaced whole: a run stopped while writing leaves the previous version, never half of one."""
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        with open(part, "w") as handle:
            handle.write(json.dumps(results, indent=1))
            handle.flush()
            os.fsync(handle.fileno())  # on disk before it replaces the old: a power cut leaves one or the other
        os.replace(part, out)
