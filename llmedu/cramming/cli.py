"""``python -m llmedu.cramming {pretrain,finetune,evaluate,scaling,vocab,probe-curve,more-seeds,widen-sweep,bench}``: the capstone from the command line.

    python -m llmedu.cramming pretrain --budget 10m --out runs/crammed
    python -m llmedu.cramming pretrain --budget 10m --out runs/crammed --resume     # after an interruption
    python -m llmedu.cramming pretrain --budget 24h --out runs/day --keep-checkpoints 3  # a GPU day: the newest 3 kept
    python -m llmedu.cramming finetune --checkpoint runs/crammed --task rotten_tomatoes
    python -m llmedu.cramming finetune --checkpoint runs/crammed --task rotten_tomatoes --from-scratch  # the control
    python -m llmedu.cramming evaluate --runs crammed=runs/crammed --out runs/evaluation.json  # issue #26's protocol
    python -m llmedu.cramming evaluate --runs crammed=runs/c original=runs/o --pretrain 1h --out runs/eval.json
    python -m llmedu.cramming scaling --budget 3m --out data/results/cramming_scaling_cpu.json  # sizes x shapes
    python -m llmedu.cramming scaling --shape tiny --budget 5s --out /tmp/scaling.json     # a smoke run
    python -m llmedu.cramming vocab --budget 3m --out data/results/cramming_vocab_cpu.json  # vocabulary sizes
    python -m llmedu.cramming probe-curve --run runs/crammed --out curve.json  # the probe along a run's checkpoints
    python -m llmedu.cramming more-seeds --study eval.json --runs crammed=runs/crammed --seeds 3 4 --out eval.json
    python -m llmedu.cramming widen-sweep --study eval.json --runs crammed=runs/crammed --lrs 1.6e-3 --out wide.json
    python -m llmedu.cramming bench

Progress goes to stderr; the last line of stdout is one line of JSON with the command's key figures.
This file defines the commands and their options; ``__main__.py`` turns them into calls of the library.
"""

from __future__ import annotations

import argparse

from ..data import available_corpora
from ..data.classification import available_classification
from .evaluate import TASKS
from .finetune import FIXED, SETTINGS
from .pretrain import CORPORA
from .recipe import parse_budget
from .scaling import BASES, GRIDS
from .study import StudyConfig
from .vocab_study import VOCAB_SIZES

__all__ = ["build_parser", "attach_negative_values"]


def _budget(text: str) -> float:
    try:
        return parse_budget(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmedu.cramming", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("pretrain", help="masked-LM pretraining from scratch under a wall-clock budget")
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
        type=int,
        default=400_000,
        help="characters of each corpus the WordPiece vocabulary is learnt from (default 400000)",
    )
    p.add_argument("--max-steps", type=int, default=None, help="also stop after this many optimizer steps")
    p.add_argument("--max-chars", type=int, default=None, help="use at most this many characters of each corpus")
    p.add_argument(
        "--corpora",
        nargs="+",
        default=list(CORPORA),
        choices=sorted(available_corpora()),
        help=f"corpora to train on (default: {' '.join(CORPORA)})",
    )
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default: the recipe's)")
    p.add_argument(
        "--accumulation", type=int, default=None, help="micro-batches per optimizer step (default: the recipe's)"
    )
    p.add_argument("--checkpoint-every", type=int, default=100, help="optimizer steps between checkpoints")
    p.add_argument(
        "--keep-checkpoints",
        type=int,
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
        "--eval-every", type=int, default=None, help="also measure the held-out MLM loss every this many steps"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue the interrupted run in --out from its latest checkpoint"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the batch order and the masks")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")

    f = commands.add_parser("finetune", help="fine-tune a pretrained run on a labelled task, fixed settings")
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
    f.add_argument("--epochs", type=int, default=FIXED.epochs, help=f"1 to 5 (default {FIXED.epochs})")
    f.add_argument("--lr", type=float, default=None, help="override the settings' learning rate (to study them)")
    f.add_argument("--batch-size", type=int, default=None, help="override the settings' batch size (to study them)")
    f.add_argument("--max-train", type=int, default=None, help="use a random slice of this many training examples")
    f.add_argument(
        "--max-eval", type=int, default=None, help="evaluate on a fixed random slice of this many validation examples"
    )
    f.add_argument("--seed", type=int, default=0, help="seed of the classifier head and the batch order")
    f.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")

    e = commands.add_parser(
        "evaluate", help="the fair protocol on three tasks, with calibration rows; one JSON (study.py)"
    )
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
        default=[str(n or "all") for n in StudyConfig.label_sizes],
        help="training-label budgets of the label-efficiency curve ('all' for every label; none: no curve)",
    )
    e.add_argument("--epochs", type=int, default=StudyConfig.epochs, help="fine-tuning epochs, 1 to 5")
    e.add_argument("--max-train", type=int, default=None, help="cap each task's train split (quick runs)")
    e.add_argument("--max-eval", type=int, default=None, help="cap each task's dev and test splits (quick runs)")
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
    e.add_argument("--max-chars", type=int, default=None, help="of each corpus, for the runs pretrained")
    e.add_argument("--tokenizer-chars", type=int, default=400_000)
    e.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations while pretraining")
    e.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")

    s = commands.add_parser(
        "scaling",
        help="MLM loss against tokens and seconds for several sizes and shapes, one budget each (scaling.py)",
    )
    _budget_study_options(s)
    s.add_argument(
        "--shape",
        choices=sorted(GRIDS),
        default="cpu",
        help="cpu: three sizes around the CPU shape (d 128, 4 layers, vocab 4096), each deep and wide; "
        "tiny: two sizes around the tiny shape (smoke tests)",
    )
    s.add_argument(
        "--grid",
        nargs="+",
        default=None,
        help="entries to run (default: the whole grid of --shape): names such as medium-deep, or "
        "SIZE-SHAPE=D_MODEL,N_LAYERS,N_HEADS for your own",
    )

    v = commands.add_parser(
        "vocab",
        help="pretraining at several vocabulary sizes, one budget each: compression, nats per character, "
        "linear probes (vocab_study.py)",
    )
    _budget_study_options(v)
    v.add_argument(
        "--vocab",
        nargs="+",
        type=int,
        default=list(VOCAB_SIZES),
        help=f"vocabulary sizes, each with its own WordPiece tokenizer (default {' '.join(map(str, VOCAB_SIZES))})",
    )
    v.add_argument(
        "--shape",
        choices=sorted(BASES),
        default="cpu",
        help="cpu: d 128, 4 layers (crammed()); tiny: d 64, 2 layers, 16-row micro-batches (smoke tests)",
    )
    v.add_argument("--no-probe", action="store_true", help="skip the linear probes (about 50 s a run at the CPU shape)")
    v.add_argument("--probe-max-train", type=int, default=None, help="cap each probe task's train split (quick runs)")
    v.add_argument("--probe-max-eval", type=int, default=None, help="cap each probe task's dev split (quick runs)")

    c = commands.add_parser(
        "probe-curve",
        help="the frozen encoder's linear probe at a run's checkpoints against random init: where the gap opens "
        "(probe_curve.py)",
    )
    c.add_argument("--run", required=True, help="a run folder written by pretrain (with its checkpoints/)")
    c.add_argument("--out", required=True, help="the curve's JSON (rewritten after every checkpoint)")
    c.add_argument("--points", type=int, default=8, help="checkpoints to probe, spaced in tokens (default 8)")
    c.add_argument("--steps", nargs="+", type=int, default=None, help="probe these checkpoints' steps instead")
    c.add_argument("--threshold", type=float, default=0.03, help="the gap the verdict looks for (default 0.03)")
    c.add_argument("--max-train", type=int, default=2000, help="cap each task's train split (default 2000)")
    c.add_argument("--max-eval", type=int, default=None, help="cap each task's dev and test splits")
    c.add_argument("--resume", action="store_true", help="keep the points of a stopped curve in --out")
    c.add_argument("--device", default=None, help="unused: the probe runs on the CPU")

    m = commands.add_parser(
        "more-seeds",
        help="score a finished study's fine-tuned rows with more seeds, at its chosen rates (more_seeds.py)",
    )
    m.add_argument("--seeds", nargs="+", type=int, required=True, help="the seeds to add (not the study's)")
    _finished_study_options(
        m,
        out="where to write the study with the seeds added (may be --study)",
        controls="the study holding the borrowed rows' new seeds (default: as recorded)",
    )

    w = commands.add_parser(
        "widen-sweep",
        help="sweep more learning rates for a finished study's fine-tuned rows; test again where the choice moves "
        "(widen_sweep.py)",
    )
    w.add_argument("--lrs", nargs="+", type=float, required=True, help="the rates to add (not the study's)")
    _finished_study_options(
        w,
        out="where to write the widened study (not --study: a stopped widening starts again from it)",
        controls="the widened study holding the borrowed rows (default: as recorded)",
    )

    a = commands.add_parser(
        "add-minilm",
        help="add MiniLM fine-tuned to a finished study under its protocol, journaling every fine-tune (minilm_row.py)",
    )
    a.add_argument("--study", required=True, help="the study's JSON (evaluate, more-seeds or widen-sweep wrote it)")
    a.add_argument(
        "--journal", required=True, help="the fine-tunes' journal: read where it holds a run, extended as runs end"
    )
    a.add_argument("--out", required=True, help="where to write the study with the row (may be --study)")
    a.add_argument("--device", default=None, help="unused: the fine-tunes run on the CPU, as the study's did")

    b = commands.add_parser(
        "bench", help="crammed model vs transformers' BertForMaskedLM: tokens/s, MFU, loss at a budget"
    )
    b.add_argument("--budget", type=_budget, default=None, help="budget of each loss run (default 20s fast, 2m full)")
    b.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    return parser


def _finished_study_options(p: argparse.ArgumentParser, out: str, controls: str) -> None:
    """The options of the commands that add to a finished study (more-seeds, widen-sweep)."""
    p.add_argument("--study", required=True, help="the study's JSON, as evaluate (or more-seeds) wrote it")
    p.add_argument("--runs", nargs="+", required=True, help="NAME=FOLDER of each run the study measured")
    p.add_argument("--out", required=True, help=out)
    p.add_argument("--controls-from", default=None, help=controls)
    p.add_argument("--device", default=None, help="unused: the fine-tunes run on the CPU, as the study's did")


def _budget_study_options(p: argparse.ArgumentParser) -> None:
    """The options every study of several runs under one budget takes (scaling, vocab: budget_runs.py)."""
    p.add_argument("--out", required=True, help="the results JSON (rewritten after every run)")
    p.add_argument(
        "--budget", type=_budget, default=parse_budget("3m"), help="wall-clock budget of each run (default 3m)"
    )
    p.add_argument("--evals", type=int, default=12, help="held-out evaluations of the slowest run (default 12)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every run every this many steps instead")
    p.add_argument("--eval-batches", type=int, default=20, help="batches per held-out evaluation (default 20)")
    p.add_argument("--max-steps", type=int, default=None, help="also stop each run after this many optimizer steps")
    p.add_argument("--max-chars", type=int, default=None, help="use at most this many characters of each corpus")
    p.add_argument(
        "--tokenizer-chars", type=int, default=400_000, help="characters of each corpus a tokenizer learns from"
    )
    p.add_argument("--runs", default=None, help="keep the run folders here (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")


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
