"""The capstone: cramming a BERT into a wall-clock budget on one device (Geiping & Goldstein 2022).

recipe      Recipe: the crammed recipe and the original BERT one as data, one field per trick;
            ABLATIONS; parse_budget("10m"); the budget clock that the learning rate follows
pretrain    pretrain(out, PretrainRun(recipe, budget_seconds)): data prepared outside the budget, the
            course's trainer, checkpoints that resume exactly, a JSON summary
finetune    finetune(run, "rotten_tomatoes"): fixed settings (FIXED, or the authors' AUTHORS),
            pretrained or random weights
evaluate    the fair protocol: fixed splits, a dev-chosen learning rate, seeds on test, label-efficiency
            curves, the task average
encoders    the models the protocol scores: our encoder fine-tuned, MiniLM, linear probes, baselines
calibration the rows a reader needs: majority class, TF-IDF + logistic regression, unigram cross-entropy
dedup       duplicate documents and repeated lines dropped from the pretraining text
target      time_to_target: when a run's held-out loss first reached a target
study       run_study: every model on every task, one JSON for the lesson
scaling     run_scaling: MLM loss against tokens and against seconds, sizes x shapes under one budget
            (the grid in scaling_grid, the machinery it shares in budget_runs, the reading in scaling_report)
vocab_study run_vocab_study: vocabulary sizes under one budget, compared per character and by linear
            probes (the reading in vocab_report)
probe_curve run_probe_curve: the linear probe at a run's checkpoints against random init, where the gap
            opens (the reading in probe_curve_report)
more_seeds  add_seeds: more test seeds for a finished study's fine-tuned rows, at the rates dev chose
widen_sweep widen_sweep: more rates in a finished study's sweep, test run again where the choice moves
minilm_row  add_minilm: MiniLM fine-tuned added to a finished study, every fine-tune journaled (hours on a CPU)
significance paired_gap: the paired t-test of a gap over seeds, and the exact sign-flip test beside it
cli         the command line's commands and options (__main__ runs them)

python -m llmedu.cramming pretrain --budget 10m --out runs/crammed
python -m llmedu.cramming finetune --checkpoint runs/crammed --task rotten_tomatoes
python -m llmedu.cramming evaluate --runs crammed=runs/crammed --out runs/evaluation.json
python -m llmedu.cramming scaling --budget 3m --out runs/scaling.json
python -m llmedu.cramming vocab --budget 3m --out runs/vocab.json
python -m llmedu.cramming probe-curve --run runs/crammed --out runs/probe_curve.json
python -m llmedu.cramming more-seeds --study runs/evaluation.json --runs crammed=runs/crammed --seeds 3 4 --out runs/evaluation.json
python -m llmedu.cramming widen-sweep --study runs/evaluation.json --runs crammed=runs/crammed --lrs 1.6e-3 --out runs/wide.json
python -m llmedu.cramming add-minilm --study runs/wide.json --journal runs/minilm_journal.json --out runs/wide.json
python -m llmedu.cramming bench
"""

from .calibration import unigram_cross_entropy
from .dedup import deduplicate
from .evaluate import TASKS, label_efficiency, make_splits, protocol, task_average
from .finetune import AUTHORS, FIXED, FinetuneSettings, finetune
from .pretrain import PretrainRun, load_pretrained, load_run, pretrain
from .probe_curve import run_probe_curve
from .probe_curve_report import load_probe_curve
from .recipe import ABLATIONS, Recipe, crammed, original_bert, parse_budget
from .scaling import GRIDS, run_scaling
from .scaling_report import load_scaling
from .study import StudyConfig, run_study
from .target import time_to_target
from .vocab_report import load_vocab_study
from .vocab_study import VOCAB_SIZES, run_vocab_study

__all__ = [
    "ABLATIONS",
    "AUTHORS",
    "FIXED",
    "FinetuneSettings",
    "GRIDS",
    "PretrainRun",
    "Recipe",
    "StudyConfig",
    "TASKS",
    "crammed",
    "deduplicate",
    "finetune",
    "label_efficiency",
    "load_pretrained",
    "load_run",
    "load_probe_curve",
    "load_scaling",
    "make_splits",
    "original_bert",
    "parse_budget",
    "pretrain",
    "protocol",
    "run_probe_curve",
    "run_scaling",
    "run_study",
    "task_average",
    "time_to_target",
    "unigram_cross_entropy",
    "VOCAB_SIZES",
    "load_vocab_study",
    "run_vocab_study",
]
