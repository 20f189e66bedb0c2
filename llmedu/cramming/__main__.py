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
from .cli import attach_negative_values, build_parser
from .finetune import SETTINGS, finetune
from .pretrain import PretrainRun, pretrain
from .recipe import CUDA_SHAPE, TINY_SHAPE, crammed, original_bert
from .studies.commands import STUDY_COMMANDS, parse_runs, run_study_command
from .studies.study import StudyConfig, pretrain_for_study, run_study


def _bench(args) -> dict:
    """Run ``benchmarks/bench_cramming.py`` of the source checkout (the benchmark is a script, not library code)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cramming.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: the benchmark ships with the source repository, not the package")
    namespace = runpy.run_path(str(script))
    return namespace["run"](budget=args.budget, device=args.device)


def _evaluate(args, device) -> dict:
    runs = parse_runs(args.runs)
    config = StudyConfig(
        tasks=tuple(args.tasks),
        lrs=tuple(args.lrs),
        seeds=tuple(args.seeds),
        label_sizes=tuple(args.label_sizes),
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
        sizes = {
            k: v for k, v in (("micro_batch", args.micro_batch), ("accumulation", args.accumulation)) if v is not None
        }
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
    elif args.command in STUDY_COMMANDS:
        result = run_study_command(args, device, parser, argv)
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
