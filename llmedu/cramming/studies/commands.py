"""The study commands of ``python -m llmedu.cramming``: scaling, vocab, probe-curve, more-seeds, widen-sweep, add-minilm,
data-lever.

``cli.py`` adds these parsers beside the capstone's own (``add_study_commands``) and ``__main__`` hands a parsed
study command to ``run_study_command``: the capstone's command line reads without them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..data import CORPORA
from ..recipe import parse_budget
from .budget_runs import StudyBudget
from .data_lever import SHAPES, TREATMENTS, check_settings, run_data_lever
from .minilm_row import add_minilm
from .more_seeds import add_seeds
from .probe_curve import run_probe_curve
from .probe_curve_report import study_references
from .report import RECORDED
from .scaling import BASES, GRIDS, check_grid, parse_entry, run_scaling
from .vocab_study import VOCAB_SIZES, check_vocab_sizes, run_vocab_study
from .widen_sweep import widen_sweep

__all__ = ["STUDY_COMMANDS", "add_study_commands", "run_study_command", "parse_runs"]

STUDY_COMMANDS = ("scaling", "vocab", "probe-curve", "more-seeds", "widen-sweep", "add-minilm", "data-lever")
_M = "python -m llmedu.cramming"
STUDY_EXAMPLES = {  # each command's --help examples: the first finishes in about a minute (2 cores; data cached)
    "scaling": f"""  {_M} scaling --shape tiny --budget 5s --out runs/scaling_smoke.json  # about a minute
  {_M} scaling --budget 3m --out runs/scaling.json  # the recorded grid, 6 runs of 3 minutes: about 25 minutes""",
    "vocab": f"""  {_M} vocab --shape tiny --budget 5s --vocab 1024 2048 --no-probe --max-chars 100000 --out runs/vocab_smoke.json
      # about a minute
  {_M} vocab --budget 3m --out runs/vocab.json  # the recorded study, 5 sizes with probes: about 30 minutes""",
    "probe-curve": f"""  {_M} probe-curve --run runs/smoke --points 2 --max-train 256 --max-eval 128 --out runs/curve_smoke.json
      # about a minute (runs/smoke: pretrain --help's first example)
  {_M} probe-curve --run runs/crammed --out runs/probe_curve.json  # the recorded curve, 8 checkpoints: about 3 minutes""",
    "more-seeds": f"""  {_M} more-seeds --study runs/eval_smoke.json --runs smoke=runs/smoke --seeds 1 --out runs/eval_smoke.json
      # about a minute (runs/eval_smoke.json: evaluate --help's first example)
  {_M} more-seeds --study runs/evaluation.json --runs crammed=runs/crammed --seeds 3 4 --out runs/evaluation.json
      # the recorded two seeds more for the fine-tuned rows: about 12 minutes on 2 cores""",
    "widen-sweep": f"""  {_M} widen-sweep --study runs/eval_smoke.json --runs smoke=runs/smoke --lrs 1.6e-3 --out runs/wide_smoke.json
      # about a minute
  {_M} widen-sweep --study runs/evaluation.json --runs crammed=runs/crammed --lrs 1e-4 1.6e-3 3.2e-3 \\
      --out runs/wide.json  # the recorded widening: about 47 minutes on 2 cores""",
    "add-minilm": f"""  {_M} add-minilm --study runs/wide_smoke.json --journal runs/journal_smoke.json --out runs/minilm_smoke.json
      # about a minute (MiniLM's fine-tunes cost about 6x ours a step)
  {_M} add-minilm --study runs/wide.json --journal runs/minilm_journal.json --out runs/wide.json
      # the recorded row, 60 fine-tunes: about 4 hours on 2 cores (stop and run again: the journal keeps each)""",
    "data-lever": f"""  {_M} data-lever --steps 8 --seeds 0 1 --max-chars 20000 --evals 2 --out runs/data_lever_smoke.json
      # about a minute
  OMP_NUM_THREADS=1 {_M} data-lever --out runs/data_lever.json  # the recorded study, 12 runs: about 30 minutes""",
}


def parse_runs(entries: list[str]) -> dict[str, str]:
    """``--runs`` as {name: folder}: NAME=FOLDER, or a bare FOLDER named by its last part."""
    return dict(r.split("=", 1) if "=" in r else (Path(r).name, r) for r in entries)


def add_study_commands(add_parser, budget, size) -> None:
    """The study commands' parsers, made by cli.py's ``add_parser`` (``budget`` and ``size``: its argument types)."""
    s = add_parser(
        "scaling",
        help="MLM loss against tokens and seconds for several sizes and shapes, one budget each (scaling.py)",
    )
    _budget_study_options(s, budget, size)
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

    v = add_parser(
        "vocab",
        help="pretraining at several vocabulary sizes, one budget each: compression, nats per character, "
        "linear probes (vocab_study.py)",
    )
    _budget_study_options(v, budget, size)
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
    v.add_argument(
        "--probe-max-train",
        type=size("--probe-max-train"),
        default=None,
        help="cap each probe task's train split (quick runs)",
    )
    v.add_argument(
        "--probe-max-eval",
        type=size("--probe-max-eval"),
        default=None,
        help="cap each probe task's dev split (quick runs)",
    )

    c = add_parser(
        "probe-curve",
        help="the frozen encoder's linear probe at a run's checkpoints against random init: where the gap opens "
        "(probe_curve.py)",
    )
    c.add_argument("--run", required=True, help="a run folder written by pretrain (with its checkpoints/)")
    c.add_argument("--out", required=True, help="the curve's JSON (rewritten after every checkpoint)")
    c.add_argument(
        "--points", type=size("--points"), default=8, help="checkpoints to probe, spaced in tokens (default 8)"
    )
    c.add_argument(
        "--steps", nargs="+", type=size("--steps"), default=None, help="probe these checkpoints' steps instead"
    )
    c.add_argument("--threshold", type=float, default=0.03, help="the gap the verdict looks for (default 0.03)")
    c.add_argument(
        "--max-train", type=size("--max-train"), default=2000, help="cap each task's train split (default 2000)"
    )
    c.add_argument("--max-eval", type=size("--max-eval"), default=None, help="cap each task's dev and test splits")
    c.add_argument("--resume", action="store_true", help="keep the points of a stopped curve in --out")
    c.add_argument("--device", default=None, help="unused: the probe runs on the CPU")

    m = add_parser(
        "more-seeds",
        help="score a finished study's fine-tuned rows with more seeds, at its chosen rates (more_seeds.py)",
    )
    m.add_argument("--seeds", nargs="+", type=int, required=True, help="the seeds to add (not the study's)")
    _finished_study_options(
        m,
        out="where to write the study with the seeds added (may be --study)",
        controls="the study holding the borrowed rows' new seeds (default: as recorded)",
    )

    w = add_parser(
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

    a = add_parser(
        "add-minilm",
        help="add MiniLM fine-tuned to a finished study under its protocol, journaling every fine-tune (minilm_row.py)",
    )
    a.add_argument("--study", required=True, help="the study's JSON (evaluate, more-seeds or widen-sweep wrote it)")
    a.add_argument(
        "--journal", required=True, help="the fine-tunes' journal: read where it holds a run, extended as runs end"
    )
    a.add_argument("--out", required=True, help="where to write the study with the row (may be --study)")
    a.add_argument("--device", default=None, help="unused: the fine-tunes run on the CPU, as the study's did")

    d = add_parser(
        "data-lever",
        help=f"the paper's dataset optimisations, one row each ({', '.join(TREATMENTS)}): held-out MLM loss "
        "after the same optimizer steps, over seeds (data_lever.py)",
    )
    d.add_argument("--out", required=True, help="the results JSON (rewritten after every run)")
    d.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="the recipe's shape (default tiny)")
    d.add_argument("--steps", type=size("--steps"), default=400, help="optimizer steps of every run (default 400)")
    d.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="at least two (default 0 1 2)")
    d.add_argument("--drop-share", type=float, default=0.1, help="of the characters, dropped by the filter (0.1)")
    d.add_argument(
        "--max-chars", type=size("--max-chars"), default=600_000, help="of each corpus's train split (default 600000)"
    )
    d.add_argument("--evals", type=size("--evals"), default=4, help="held-out evaluations per run (default 4)")
    d.add_argument("--tokenizer-chars", type=size("--tokenizer-chars"), default=400_000)
    d.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")


def _finished_study_options(p: argparse.ArgumentParser, out: str, controls: str) -> None:
    """The options of the commands that add to a finished study (more-seeds, widen-sweep)."""
    p.add_argument("--study", required=True, help="the study's JSON, as evaluate (or more-seeds) wrote it")
    p.add_argument("--runs", nargs="+", required=True, help="NAME=FOLDER of each run the study measured")
    p.add_argument("--out", required=True, help=out)
    p.add_argument("--controls-from", default=None, help=controls)
    p.add_argument("--device", default=None, help="unused: the fine-tunes run on the CPU, as the study's did")


def _budget_study_options(p: argparse.ArgumentParser, budget, size) -> None:
    """The options every study of several runs under one budget takes (scaling, vocab: budget_runs.py)."""
    p.add_argument("--out", required=True, help="the results JSON (rewritten after every run)")
    p.add_argument(
        "--budget", type=budget, default=parse_budget("3m"), help="wall-clock budget of each run (default 3m)"
    )
    p.add_argument("--evals", type=int, default=12, help="held-out evaluations of the slowest run (default 12)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every run every this many steps instead")
    p.add_argument(
        "--eval-batches", type=size("--eval-batches"), default=20, help="batches per held-out evaluation (default 20)"
    )
    p.add_argument("--max-steps", type=int, default=None, help="also stop each run after this many optimizer steps")
    p.add_argument(
        "--max-chars", type=size("--max-chars"), default=None, help="use at most this many characters of each corpus"
    )
    p.add_argument(
        "--tokenizer-chars",
        type=size("--tokenizer-chars"),
        default=400_000,
        help="characters of each corpus a tokenizer learns from",
    )
    p.add_argument("--runs", default=None, help="keep the run folders here (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")


def run_study_command(args, device, parser, argv) -> dict:
    """Run a parsed study command; its key figures, as the command line prints them."""
    if args.command == "scaling":
        return _scaling(args, device, parser, argv)
    if args.command == "vocab":
        return _vocab(args, device, parser, argv)
    if args.command == "probe-curve":
        return _probe_curve(args)
    if args.command == "data-lever":
        return _data_lever(args, device, parser, argv)
    if args.command == "more-seeds":
        study = add_seeds(args.study, parse_runs(args.runs), args.seeds, out=args.out, controls_from=args.controls_from)
        result = {"out": args.out}
    elif args.command == "widen-sweep":
        study = widen_sweep(args.study, parse_runs(args.runs), args.lrs, out=args.out, controls_from=args.controls_from)
        result = {"out": args.out, "moved": study["widened"]["moved"]}
    else:
        study = add_minilm(args.study, args.journal, out=args.out)
        result = {"out": args.out, "journal": args.journal} | {k: study["added_minilm"][k] for k in ("trained", "read")}
    return result | {"average": {k: round(v["mean"], 4) for k, v in study["average"].items()}}


def _scaling(args, device, parser, argv) -> dict:
    """Check every input before the first run: a bad entry or number is a usage error, not a crash later."""
    try:
        grid = [parse_entry(text, args.shape) for text in args.grid] if args.grid else list(GRIDS[args.shape])
        for name, value in (
            ("--evals", args.evals),
            ("--eval-every", args.eval_every),
            ("--max-steps", args.max_steps),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        check_grid(grid, BASES[args.shape])
    except ValueError as error:
        parser.error(f"scaling: {error}")
    results = run_scaling(grid, args.budget, args.out, **_study_settings(args, device, argv))
    return {
        "out": args.out,
        "unigram_cross_entropy": results["unigram_cross_entropy"],
        "runs": {
            name: {k: r[k] for k in ("tokens_per_s", "tokens_seen", "val_loss")} for name, r in results["runs"].items()
        },
    }


def _study_settings(args, device, argv) -> dict:
    """The keyword arguments that ``run_scaling`` and ``run_vocab_study`` share, from ``_budget_study_options``."""
    words = sys.argv[1:] if argv is None else argv
    return dict(
        base=BASES[args.shape],
        max_steps=args.max_steps,
        max_chars=args.max_chars,
        seed=args.seed,
        evals=args.evals,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        tokenizer_chars=args.tokenizer_chars,
        runs_dir=args.runs,
        device=device,
        command="python -m llmedu.cramming " + " ".join(words),
        stream=sys.stderr,
    )


def _vocab(args, device, parser, argv) -> dict:
    """Check every input before the first run (the vocabulary sizes against the tokenizer's sample too)."""
    try:
        StudyBudget(args.budget, args.max_steps, CORPORA, args.max_chars, args.seed, args.evals, args.eval_every)
        for name in ("eval_batches", "tokenizer_chars", "max_chars", "probe_max_train", "probe_max_eval"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        check_vocab_sizes(args.vocab, CORPORA, args.tokenizer_chars)  # reads the tokenizer's sample: seconds
    except ValueError as error:
        parser.error(f"vocab: {error}")
    results = run_vocab_study(
        args.vocab,
        args.budget,
        args.out,
        probe=not args.no_probe,
        probe_max_train=args.probe_max_train,
        probe_max_eval=args.probe_max_eval,
        **_study_settings(args, device, argv),
    )
    keys = ("tokens_per_char", "chars_per_s", "val_loss", "nats_per_char", "probe")
    return {"out": args.out, "runs": {name: {k: r[k] for k in keys} for name, r in results["runs"].items()}}


def _probe_curve(args) -> dict:
    """The probe curve of a run folder, with lesson 25's recorded study as the reference lines where it exists."""
    references = study_references() if RECORDED.is_file() else None
    results = run_probe_curve(
        args.run,
        args.out,
        points=None if args.steps else args.points,
        steps=args.steps,
        threshold=args.threshold,
        max_train=args.max_train,
        max_eval=args.max_eval,
        references=references,
        resume=args.resume,
    )
    gaps = {p["step"]: round(p["gap"]["average"], 4) for p in results["points"]}
    return {"out": args.out, "control": round(results["control"]["average"]["mean"], 4), "gaps": gaps}


def _data_lever(args, device, parser, argv) -> dict:
    """The data-lever study; a bad setting is a usage error before any text is read."""
    settings = dict(shape=args.shape, steps=args.steps, seeds=args.seeds, drop_share=args.drop_share, evals=args.evals)
    try:
        check_settings(**settings)
    except ValueError as error:
        parser.error(f"data-lever: {error}")
    settings |= dict(max_chars=args.max_chars, tokenizer_chars=args.tokenizer_chars)
    command = "python -m llmedu.cramming " + " ".join(sys.argv[1:] if argv is None else argv)
    results = run_data_lever(args.out, device=device, command=command, stream=sys.stderr, **settings)
    rows = {
        name: {k: r[k] for k in ("mean", "std", "n")} | r.get("vs_baseline", {}) for name, r in results["rows"].items()
    }
    return {"out": args.out, "threshold": results["filter"]["threshold"], "rows": rows}
