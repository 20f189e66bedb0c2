"""The capstone: cramming a BERT into a wall-clock budget on one device (Geiping & Goldstein 2022).

recipe      Recipe: the crammed recipe and the original BERT one as data, one field per trick;
            ABLATIONS; parse_budget("10m"); the budget clock that the learning rate follows
data        prepare_data: the tokenizer, the packed train and held-out rows and their counts, in one step
            before the clock starts; deduplicate drops duplicate documents and repeated lines
loop        crammed_loop: the budgeted training step in one loop (budget clock, schedule, batch ramp,
            autocast, sparse prediction, clipping), the one pretrain runs
pretrain    pretrain(out, PretrainRun(recipe, budget_seconds)): the run folder around crammed_loop,
            checkpoints that resume exactly, a JSON summary
finetune    finetune(run, "rotten_tomatoes"): fixed settings (FIXED, or the authors' AUTHORS),
            pretrained or random weights
evaluate    the fair protocol: fixed splits, a dev-chosen learning rate, seeds on test, label-efficiency
            curves, the task average
target      time_to_target: when a run's held-out loss first reached a target
cli         the command line's commands and options (__main__ runs them)
studies/    the research apparatus behind ``data/results/``: the study of every model on every task
            (``evaluate``), more seeds, a widened sweep, MiniLM's row, probe curves, scaling and
            vocabulary grids, significance; not what a student needs to read

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

from .data import CORPORA, deduplicate, prepare_data
from .evaluate import TASKS, label_efficiency, make_splits, protocol, task_average
from .finetune import AUTHORS, FIXED, FinetuneSettings, finetune
from .pretrain import PretrainRun, load_pretrained, load_run, pretrain
from .recipe import ABLATIONS, Recipe, crammed, original_bert, parse_budget
from .target import time_to_target

__all__ = [
    "ABLATIONS",
    "AUTHORS",
    "CORPORA",
    "FIXED",
    "FinetuneSettings",
    "PretrainRun",
    "Recipe",
    "TASKS",
    "crammed",
    "deduplicate",
    "finetune",
    "label_efficiency",
    "load_pretrained",
    "load_run",
    "make_splits",
    "original_bert",
    "parse_budget",
    "prepare_data",
    "pretrain",
    "protocol",
    "task_average",
    "time_to_target",
]
