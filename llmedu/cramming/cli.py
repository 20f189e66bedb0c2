"""``python -m llmedu.cramming COMMAND``: the capstone from the command line (``COMMAND --help``: its examples).

    python -m llmedu.cramming pretrain --shape tiny --budget 30s --max-chars 200000 --out runs/smoke  # about a minute
    python -m llmedu.cramming pretrain --budget 10m --out runs/crammed          # about 12 minutes
    python -m llmedu.cramming finetune --checkpoint runs/crammed --task rotten_tomatoes
    python -m llmedu.cramming evaluate --runs crammed=runs/crammed --out runs/evaluation.json
    python -m llmedu.cramming bench

Commands: pretrain, finetune, evaluate (the evaluation protocol: dev-chosen rates, held-out test, seeds), bench;
and the studies behind ``data/results/`` (``studies/commands.py``): scaling, vocab, probe-curve, more-seeds,
widen-sweep, add-minilm, data-lever. Progress goes to stderr; the last line of stdout is one line of JSON with the
command's key figures. This file defines the commands and their options; ``__main__.py`` turns them into calls.
"""

from __future__ import annotations

import argparse

from ..data import available_corpora
from ..data.classification import available_classification
from .data import CORPORA
from .evaluate import TASKS
from .finetune import FIXED, SETTINGS
from .recipe import parse_budget
from .studies.commands import STUDY_EXAMPLES, add_study_commands
from .studies.study import StudyConfig

__all__ = ["build_parser", "attach_negative_values", "EXAMPLES"]

_PRETRAIN = "python -m llmedu.cramming pretrain --shape tiny --budget 30s --max-chars 200000 --out runs/smoke"
EXAMPLES = {  # each command's --help examples: the first finishes in about a minute (2 cores; data cached)
    "pretrain": f"""  {_PRETRAIN}  # about a minute
  python -m llmedu.cramming pretrain --budget 10m --out runs/crammed  # about 12 minutes (10 of them training)
  python -m llmedu.cramming pretrain --budget 10m --out runs/crammed --resume  # after an interruption
  python -m llmedu.cramming pretrain --budget 24h --out runs/day --keep-checkpoints 3  # about 24 hours on a GPU, 3 checkpoints kept""",
    "finetune": """  python -m llmedu.cramming finetune --checkpoint runs/smoke --max-train 512 --epochs 1  # about a minute
  python -m llmedu.cramming finetune --checkpoint runs/crammed --task rotten_tomatoes  # about 5 minutes at the CPU shape
  python -m llmedu.cramming finetune --checkpoint runs/crammed --from-scratch  # the control, as long""",
    "evaluate": """  python -m llmedu.cramming evaluate --runs smoke=runs/smoke --tasks rotten_tomatoes --lrs 1e-4 4e-4 --seeds 0 \\
      --label-sizes --max-train 256 --max-eval 128 --epochs 1 --no-minilm --out runs/eval_smoke.json  # about a minute
  python -m llmedu.cramming evaluate --runs crammed=runs/crammed --lrs 2e-4 4e-4 8e-4 --label-sizes 100 300 1000 all \\
      --max-train 2000 --minilm-probe-only --out runs/evaluation.json  # the recorded study: about 1.5 hours on 2 cores
  python -m llmedu.cramming evaluate --runs crammed=runs/crammed --out runs/evaluation.json  # whole train splits,
      # MiniLM fine-tuned too (~6x ours a step): about 20 hours on 2 cores (estimated from the recorded study)""",
    "bench": """  python -m llmedu.cramming bench --budget 10s  # about 2 minutes
  python -m llmedu.cramming bench  # about 6 minutes at the CPU shape""",
}


def _budget(text: str) -> float:
    try:
        return parse_budget(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _size(option: str):
    """The type of a size or count option: a whole number >= 1 (0 would be dropped or mean nothing)."""

    def size(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} must be a whole number >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{option} must be >= 1, got {value}")
        return value

    return size


def _label_size(text: str) -> int | None:
    return None if text == "all" else _size("--label-sizes")(text)


def _parser(commands, name: str, **kw) -> argparse.ArgumentParser:
    """A command's parser, its examples shown by ``--help``."""
    epilog = f"examples:\n{(EXAMPLES | STUDY_EXAMPLES)[name]}"
    return commands.add_parser(name, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmedu.cramming", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    p = _parser(commands, "pretrain", help="masked-LM pretraining from scratch under a wall-clock budget")
    p.add_argument("--out", required=True, help="run folder: run.json, tokenizer.json, checkpoints/, summary.json")
    p.add_argument(
        "--budget",
        type=_budget,
        default=parse_budget("10m"),
        help="wall-clock budget of the training steps: 30s, 10m, 24h, or seconds (default 10m)",
    )
    p.add_argument(
        "--recipe",
        choices=("crammed", "original"),
        default="crammed",
        help="crammed: all of Cramming's tricks; original: BERT's recipe at the same shape",
    )
    p.add_argument(
        "--shape",
        choices=("auto", "tiny", "cpu", "cuda"),
        default="auto",
        help="model size: tiny = d 64, 2 layers, vocab 1024 (smoke tests); cpu = d 128, 4 layers, "
        "vocab 4096; cuda = BERT-base (768, 12 layers, vocab 32768); auto: cuda on a GPU, else cpu",
    )
    p.add_argument(
        "--tokenizer-chars",
        type=_size("--tokenizer-chars"),
        default=400_000,
        help="characters of each corpus the WordPiece vocabulary is learnt from (default 400000)",
    )
    p.add_argument("--max-steps", type=int, default=None, help="also stop after this many optimizer steps")
    p.add_argument(
        "--max-chars", type=_size("--max-chars"), default=None, help="use at most this many characters of each corpus"
    )
    p.add_argument(
        "--corpora",
        nargs="+",
        default=list(CORPORA),
        choices=sorted(available_corpora()),
        help=f"corpora to train on (default: {' '.join(CORPORA)})",
    )
    p.add_argument(
        "--micro-batch",
        type=_size("--micro-batch"),
        default=None,
        help="sequences per micro-batch (default: the recipe's)",
    )
    p.add_argument(
        "--accumulation",
        type=_size("--accumulation"),
        default=None,
        help="micro-batches per optimizer step (default: the recipe's)",
    )
    p.add_argument(
        "--checkpoint-every", type=_size("--checkpoint-every"), default=100, help="optimizer steps between checkpoints"
    )
    p.add_argument(
        "--keep-checkpoints",
        type=_size("--keep-checkpoints"),
        default=None,
        help="keep only the newest N (>= 2) checkpoints (default: all, which probe-curve reads; a day at the "
        "GPU shape writes about 1.2 GB per checkpoint)",
    )
    p.add_argument(
        "--dedup",
        action="store_true",
        help="drop duplicate documents and repeated lines first (counted in the summary)",
    )
    p.add_argument(
        "--eval-every",
        type=_size("--eval-every"),
        default=None,
        help="also measure the held-out MLM loss every this many steps",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue the interrupted run in --out from its latest checkpoint"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the batch order and the masks")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")

    f = _parser(commands, "finetune", help="fine-tune a pretrained run on a labelled task, fixed settings")
    f.add_argument("--checkpoint", required=True, help="a pretraining run folder (its latest checkpoint is used)")
    f.add_argument(
        "--task",
        default="rotten_tomatoes",
        choices=sorted(available_classification()),
        help="labelled task: rotten_tomatoes (sentiment, 2 classes) or bbc_news (5 topics)",
    )
    f.add_argument("--from-scratch", action="store_true", help="same architecture from random weights: the control")
    f.add_argument(
        "--out",
        default=None,
        help="where to keep the fine-tuned weights (model.safetensors) and results.json "
        "(default: CHECKPOINT/finetuned/TASK-INIT-seedN)",
    )
    described = "; ".join(
        f"{name}: lr {s.lr:.0e}, batch {s.batch_size}, {s.schedule} decay" for name, s in SETTINGS.items()
    )
    f.add_argument(
        "--settings",
        choices=sorted(SETTINGS),
        default="fixed",
        help=f"fine-tuning settings: fixed is the course's, for every model; authors is Geiping & "
        f"Goldstein's GLUE setting ({described})",
    )
    f.add_argument("--epochs", type=_size("--epochs"), default=FIXED.epochs, help=f"1 to 5 (default {FIXED.epochs})")
    f.add_argument("--lr", type=float, default=None, help="override the settings' learning rate (to study them)")
    f.add_argument(
        "--batch-size",
        type=_size("--batch-size"),
        default=None,
        help="override the settings' batch size (to study them)",
    )
    f.add_argument(
        "--max-train", type=_size("--max-train"), default=None, help="use a random slice of this many training examples"
    )
    f.add_argument(
        "--max-eval",
        type=_size("--max-eval"),
        default=None,
        help="evaluate on a fixed random slice of this many validation examples",
    )
    f.add_argument("--seed", type=int, default=0, help="seed of the classifier head and the batch order")
    f.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")

    e = _parser(commands, "evaluate", help="the evaluation protocol on three tasks, with calibration rows; one JSON")
    e.add_argument(
        "--runs",
        nargs="+",
        required=True,
        help="NAME=FOLDER of each pretraining run (FOLDER alone: its name). With --pretrain, a missing "
        "folder is pretrained first: the original recipe when NAME is 'original', else the crammed one",
    )
    e.add_argument("--out", required=True, help="the results JSON (rewritten after every task)")
    e.add_argument("--tasks", nargs="+", default=list(StudyConfig.tasks), choices=sorted(TASKS))
    e.add_argument("--lrs", nargs="+", type=float, default=list(StudyConfig.lrs), help="the sweep, the same for all")
    e.add_argument("--seeds", nargs="+", type=int, default=list(StudyConfig.seeds))
    e.add_argument(
        "--label-sizes",
        nargs="*",
        type=_label_size,
        default=list(StudyConfig.label_sizes),
        help="training-label budgets of the label-efficiency curve ('all' for every label; none: no curve)",
    )
    e.add_argument("--epochs", type=_size("--epochs"), default=StudyConfig.epochs, help="fine-tuning epochs, 1 to 5")
    e.add_argument(
        "--max-train", type=_size("--max-train"), default=None, help="cap each task's train split (quick runs)"
    )
    e.add_argument(
        "--max-eval", type=_size("--max-eval"), default=None, help="cap each task's dev and test splits (quick runs)"
    )
    e.add_argument("--no-minilm", action="store_true", help="leave out the MiniLM rows")
    e.add_argument(
        "--minilm-probe-only", action="store_true", help="MiniLM's linear probe, not its fine-tunes (~6x ours on a CPU)"
    )
    e.add_argument(
        "--controls-from",
        default=None,
        help="an earlier study's JSON with the same protocol and tokenizer: reuse its random-init, MiniLM and "
        "baseline rows instead of measuring them again (checked by the random-init probe, measured again)",
    )
    e.add_argument("--pretrain", type=_budget, default=None, help="budget for the runs whose folder is missing")
    e.add_argument("--shape", choices=("auto", "tiny", "cpu", "cuda"), default="auto", help="of the runs pretrained")
    e.add_argument(
        "--max-chars", type=_size("--max-chars"), default=None, help="of each corpus, for the runs pretrained"
    )
    e.add_argument("--tokenizer-chars", type=_size("--tokenizer-chars"), default=400_000)
    e.add_argument(
        "--eval-every",
        type=_size("--eval-every"),
        default=50,
        help="steps between held-out evaluations while pretraining",
    )
    e.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")

    add_study_commands(lambda name, **kw: _parser(commands, name, **kw), _budget, _size)

    b = _parser(
        commands, "bench", help="crammed model vs transformers' BertForMaskedLM: tokens/s, MFU, loss at a budget"
    )
    b.add_argument("--budget", type=_budget, default=None, help="budget of each loss run (default 20s fast, 2m full)")
    b.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    return parser


def attach_negative_values(argv: list[str]) -> list[str]:
    """``--budget -5m`` -> ``--budget=-5m``: argparse takes "-5m" for an option, and its error then
    says the argument is missing; attached, the value reaches the budget parser, which says why."""
    out = []
    for arg in argv:
        if out and out[-1] in ("--budget", "--max-steps") and arg.startswith("-"):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out
