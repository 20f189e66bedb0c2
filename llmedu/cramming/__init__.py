"""The capstone: cramming a BERT into a wall-clock budget on one device (Geiping & Goldstein 2022).

recipe      Recipe: the crammed recipe and the original BERT one as data, one field per trick;
            ABLATIONS; parse_budget("10m"); the budget clock that the learning rate follows
pretrain    pretrain(out, PretrainRun(recipe, budget_seconds)): data prepared outside the budget, the
            course's trainer, checkpoints that resume exactly, a JSON summary
finetune    finetune(run, "rotten_tomatoes"): fixed settings (FIXED, or the authors' AUTHORS),
            pretrained or random weights

python -m llmedu.cramming pretrain --budget 10m --out runs/crammed
python -m llmedu.cramming finetune --checkpoint runs/crammed --task rotten_tomatoes
python -m llmedu.cramming bench
"""

from .finetune import AUTHORS, FIXED, FinetuneSettings, finetune
from .pretrain import PretrainRun, load_pretrained, load_run, pretrain
from .recipe import ABLATIONS, Recipe, crammed, original_bert, parse_budget

__all__ = [
    "ABLATIONS",
    "AUTHORS",
    "FIXED",
    "FinetuneSettings",
    "PretrainRun",
    "Recipe",
    "crammed",
    "finetune",
    "load_pretrained",
    "load_run",
    "original_bert",
    "parse_budget",
    "pretrain",
]
