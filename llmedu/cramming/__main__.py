"""``python -m llmedu.cramming``: the capstone from the command line (``cli.py`` defines its commands and options).

Each command calls the library; this file turns the parsed options into those calls. The last line of stdout is
one line of JSON with the command's key figures.
"""

from __future__ import annotations

import json
import runpy
import sys
from dataclasses import replace
from pathlib import Path

from .. import runtime
from .budget_runs import StudyBudget
from .cli import attach_negative_values, build_parser
from .finetune import SETTINGS, finetune
from .minilm_row import add_minilm
from .more_seeds import add_seeds
from .pretrain import CORPORA, PretrainRun, pretrain
from .probe_curve import run_probe_curve
from .probe_curve_report import study_references
from .recipe import CUDA_SHAPE, TINY_SHAPE, crammed, original_bert
from .report import RECORDED
from .scaling import BASES, GRIDS, check_grid, parse_entry, run_scaling
from .study import StudyConfig, pretrain_for_study, run_study
from .vocab_study import check_vocab_sizes, run_vocab_study
from .widen_sweep import widen_sweep


def _bench(args) -> dict:
    """Run ``benchmarks/bench_cramming.py`` of the source checkout (the benchmark is a script, not library code)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cramming.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: the benchmark ships with the source repository, not the package")
    namespace = runpy.run_path(str(script))
    return namespace["run"](budget=args.budget, device=args.device)


def _runs(entries: list[str]) -> dict[str, str]:
    """``--runs`` as {name: folder}: NAME=FOLDER, or a bare FOLDER named by its last part."""
    return dict(r.split("=", 1) if "=" in r else (Path(r).name, r) for r in entries)


def _evaluate(args, device) -> dict:
    runs = _runs(args.runs)
    sizes = tuple(None if n == "all" else int(n) for n in args.label_sizes)
    config = StudyConfig(
        tasks=tuple(args.tasks),
        lrs=tuple(args.lrs),
        seeds=tuple(args.seeds),
        label_sizes=sizes,
        epochs=args.epochs,
        max_train=args.max_train,
        max_eval=args.max_eval,
        minilm=not args.no_minilm,
        minilm_finetune=not args.minilm_probe_only,
    )
    for name, folder in runs.items():
        if (Path(folder) / "run.json").is_file():
            continue
        if args.pretrain is None:
            raise FileNotFoundError(f"{folder} holds no pretraining run: pretrain it, or pass --pretrain BUDGET")
        shape = _shape(args.shape, device)
        recipe = (original_bert if name == "original" else crammed)(**shape)
        pretrain_for_study(
            folder,
            recipe,
            args.pretrain,
            config.tasks,
            eval_every=args.eval_every,
            max_chars=args.max_chars,
            device=device,
            tokenizer_chars=args.tokenizer_chars,
        )
    results = run_study(runs, config, out=args.out, controls_from=args.controls_from)
    return {"out": args.out, "average": {k: round(v["mean"], 4) for k, v in results["average"].items()}}


def _scaling(args, device, parser, argv) -> dict:
    """Check every input before the first run: a bad entry or number is a usage error, not a crash later."""
    try:
        grid = [parse_entry(text, args.shape) for text in args.grid] if args.grid else list(GRIDS[args.shape])
        for name, value in (("--evals", args.evals), ("--eval-batches", args.eval_batches)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name, value in (("--eval-every", args.eval_every), ("--max-steps", args.max_steps)):
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
    """The probe curve of a run folder, with lesson 22's recorded study as the reference lines where it exists."""
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


def _shape(name: str, device) -> dict:
    return {"tiny": TINY_SHAPE, "cpu": {}, "cuda": CUDA_SHAPE}[
        name if name != "auto" else "cuda" if device.type == "cuda" else "cpu"
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(attach_negative_values(sys.argv[1:] if argv is None else argv))
    try:
        device = runtime.device(args.device)
    except (ValueError, RuntimeError) as error:
        parser.error(f"--device: {error}")
    if args.command == "pretrain":
        shape = _shape(args.shape, device)
        sizes = {k: v for k, v in (("micro_batch", args.micro_batch), ("accumulation", args.accumulation)) if v}
        recipe = (crammed if args.recipe == "crammed" else original_bert)(**{**shape, **sizes})
        run = PretrainRun(
            recipe,
            budget_seconds=args.budget,
            max_steps=args.max_steps,
            corpora=args.corpora,
            max_chars=args.max_chars,
            seed=args.seed,
            dedup=args.dedup,
        )
        result = pretrain(
            args.out,
            run,
            resume=args.resume,
            device=device,
            tokenizer_chars=args.tokenizer_chars,
            checkpoint_every=args.checkpoint_every,
            keep_checkpoints=args.keep_checkpoints,
            eval_every=args.eval_every,
        )
        result.pop("history")
    elif args.command == "finetune":
        overrides = {k: v for k, v in (("lr", args.lr), ("batch_size", args.batch_size)) if v is not None}
        settings = replace(SETTINGS[args.settings], epochs=args.epochs, **overrides)
        init = "random" if args.from_scratch else "pretrained"
        out = args.out or Path(args.checkpoint) / "finetuned" / f"{args.task}-{init}-seed{args.seed}"
        result = finetune(
            args.checkpoint,
            args.task,
            out=out,
            from_scratch=args.from_scratch,
            settings=settings,
            max_train=args.max_train,
            max_eval=args.max_eval,
            device=device,
            seed=args.seed,
        )
    elif args.command == "evaluate":
        result = _evaluate(args, device)
    elif args.command == "scaling":
        result = _scaling(args, device, parser, argv)
    elif args.command == "vocab":
        result = _vocab(args, device, parser, argv)
    elif args.command == "probe-curve":
        result = _probe_curve(args)
    elif args.command == "more-seeds":
        runs = _runs(args.runs)
        study = add_seeds(args.study, runs, args.seeds, out=args.out, controls_from=args.controls_from)
        result = {"out": args.out, "average": {k: round(v["mean"], 4) for k, v in study["average"].items()}}
    elif args.command == "widen-sweep":
        runs = _runs(args.runs)
        study = widen_sweep(args.study, runs, args.lrs, out=args.out, controls_from=args.controls_from)
        result = {"out": args.out, "moved": study["widened"]["moved"]}
        result["average"] = {k: round(v["mean"], 4) for k, v in study["average"].items()}
    elif args.command == "add-minilm":
        study = add_minilm(args.study, args.journal, out=args.out)
        result = {"out": args.out, "journal": args.journal} | {k: study["added_minilm"][k] for k in ("trained", "read")}
        result["average"] = {k: round(v["mean"], 4) for k, v in study["average"].items()}
    else:
        result = _bench(args)
    print(json.dumps(result), flush=True)
    return result


_GO_ON = {  # what a stopped command kept, and how to go on from it
    "pretrain": "the last finished step is saved: run the same command with --resume to continue",
    "probe-curve": "the finished points are in --out: run the same command with --resume to continue",
    "add-minilm": "the journal holds every finished fine-tune: run the same command to continue",
}


def stopped_message(argv: list[str]) -> str:
    """The line printed when a command is stopped (Ctrl-C): what it kept, if it keeps anything."""
    command = next((word for word in argv if not word.startswith("-")), None)
    return "stopped; " + _GO_ON.get(command, "run the command again to start it over")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(stopped_message(sys.argv[1:]), file=sys.stderr)
        sys.exit(130)
