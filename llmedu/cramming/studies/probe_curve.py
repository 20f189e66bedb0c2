"""At what budget does pretraining's advantage open? The linear probe along one run's checkpoints.

    results = run_probe_curve("runs/crammed", out="runs/probe_curve.json", points=8,
                              references=study_references())         # TF-IDF and MiniLM rows of lesson 25's study
    print(curve_table(results)); print(curve_verdict(results)); plot_probe_curve(results)   # probe_curve_report

The study (``study.py``) scores a run's *final* weights; when pretraining's lead over random init is
small, the next question is where along the budget the lead opens, if it does. Fine-tuning
every checkpoint with the study's learning-rate sweep and seeds costs hours on a CPU, so the curve uses the
study's other row, the frozen encoder's **linear probe** (``encoders.probe_scorer``): mean-pooled last hidden
states, standardised, a multinomial logistic regression fit by L-BFGS from zero with a fixed l2 penalty. It
has no learning rate to choose and no seed (the loss is convex and the start fixed), so one fit per split
measures what the representation holds at that checkpoint.

For each chosen checkpoint of a run folder written by ``pretrain.pretrain`` (``checkpoints/step-NNNNNN``,
every ``checkpoint_every`` steps and one at the end), the probe runs with exactly the study's protocol
(``evaluate.make_splits`` with the study's split seed 0 and caps, ``evaluate.protocol`` over the rate
sweep ``(None,)``, ``evaluate.task_average``), and so does the control, the probe on random weights of the run's
shape and tokenizer (``encoder_features(run, from_scratch=True)``: the study's "random init, linear probe",
once). Each point records the step, the tokens read (``position`` x micro-batch x row length: with the batch
ramp a step reads 1 to ``accumulation`` micro-batches, so tokens are not proportional to steps), the seconds
on the budget's clock (the trainer's sum of step times, saved in the checkpoint), the fraction of the budget
spent and the one-cycle learning-rate multiplier there, the held-out MLM loss at that step when the run's
``val_history`` has it (``eval_every`` dividing the step), per-task and average probe accuracy, and the gap to
the control. The JSON is rewritten after every checkpoint, so a stopped curve keeps its points
(``resume=True`` continues it). The latest checkpoint holds the run's final weights: its point is the study's
"<run>, linear probe" row, given the same tasks and caps.

What this does **not** measure:

* A checkpoint at minute 10 of a 30-minute run is not a 10-minute run. The learning rate follows a
  triangular one-cycle schedule tied to the *whole* budget (``recipe.budget_schedule``): at a third of the
  budget it is still rising (two thirds of the peak), at half it peaks, and only the final checkpoint has
  annealed to zero; the batch also grows with the budget spent (``budget_accumulation``). A run given the
  smaller budget would have annealed by then and probably ends better than this checkpoint, so the curve
  likely *understates* what a shorter budget gives, most in its middle, where the rate is highest.
  ``lr_factor`` says where each point sits on the schedule.
* The probe measures what a linear map reads from mean-pooled features, not what fine-tuning extracts;
  the fine-tuned gap may open earlier or later.
* One pretraining run (one seed). The test splits (1,285, 438 and 3,655 examples) carry a standard error of
  roughly 1.4, 2.0 and 0.8 points per task, about 0.9 on the average, so a single point crossing the
  threshold is weak evidence; ``curve_verdict`` says whether the gap stays above it to the end.

Cost (2 shared CPU cores, CPU shape d_model 128 x 4 layers, the study's caps: train 2,000 per task, dev and
test whole): per checkpoint the features of 15.5k texts (two thirds of them tweet_sentiment's dev and test)
and two L-BFGS fits per task, about 40 s; the control first, about 100 s, as it also tokenizes the texts
(once for the whole curve). Eight points: about 7 minutes.

Left out: fine-tuning per checkpoint, separate runs per budget (the honest version of the first caveat;
``scaling.py`` trains those for the MLM loss), probes of intermediate layers.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ...hardware import machine_summary
from ...train import checkpoint as ckpt
from ..evaluate import TASKS, check_no_overlap, make_splits, protocol, task_average
from ..pretrain import PretrainRun, encoder_weights, read_run
from ..recipe import BudgetClock, budget_schedule
from .encoders import encoder_features, probe_scorer
from .probe_curve_report import CONTROL, curve_verdict, load_probe_curve

__all__ = [
    "run_checkpoints",
    "choose_checkpoints",
    "checkpoint_weights",
    "checkpoint_features",
    "probe_scores",
    "run_probe_curve",
]


# -- the run's checkpoints -------------------------------------------------------------------------
def _saved_run(run: Path) -> PretrainRun:
    if not (run / "run.json").is_file():
        raise FileNotFoundError(
            f"{run} is not a pretraining run (no run.json): give a folder written by pretrain / "
            f"python -m llmedu.cramming pretrain --out ..."
        )
    return read_run(run)


def run_checkpoints(run) -> list[dict]:
    """Every complete checkpoint of run folder ``run``, by step: {"step", "path", "position", "tokens_seen", "seconds"}.

    ``position`` is the micro-batches read, ``seconds`` the budget's clock at that step (both from the
    checkpoint's ``state.json``); tokens seen = position x micro-batch x row length, as ``pretrain``'s summary.
    """
    run = Path(run)
    saved = _saved_run(run)
    found = ckpt.checkpoints(run / "checkpoints")  # complete folders only, numerically by step
    if not found:
        raise FileNotFoundError(
            f"no checkpoint under {run / 'checkpoints'}: pretrain writes one every checkpoint_every steps "
            f"and one at the end"
        )
    row_tokens = saved.recipe.micro_batch * saved.recipe.model.max_seq_len
    out = []
    for path in found:
        state = json.loads((path / ckpt.STATE).read_text())
        out.append(
            {
                "step": state["step"],
                "path": str(path),
                "position": state["position"],
                "tokens_seen": state["position"] * row_tokens,
                "seconds": round(state["seconds"], 3),
            }
        )
    return out


def choose_checkpoints(found: list[dict], points: int | None = None, steps: Sequence[int] | None = None) -> list[dict]:
    """A subset of ``run_checkpoints``' list: the given ``steps``; or ``points`` of them spaced evenly in tokens
    seen (the nearest to 1/points, 2/points, ... of the last's tokens; the last always); or all of them."""
    if steps is not None and points is not None:
        raise ValueError("give points or steps, not both")
    if steps is not None:
        by_step = {c["step"]: c for c in found}
        missing = [s for s in steps if s not in by_step]
        if missing:
            raise ValueError(f"no checkpoint at step {missing}; the run has steps {sorted(by_step)}")
        return [by_step[s] for s in sorted(set(steps))]
    if points is not None and (isinstance(points, bool) or not isinstance(points, int) or points < 1):
        raise ValueError(f"points must be an int >= 1 or None (every checkpoint), got {points!r}")
    if points is None or points >= len(found):
        return list(found)
    last = found[-1]["tokens_seen"]
    chosen = {
        min(range(len(found)), key=lambda i: abs(found[i]["tokens_seen"] - last * k / points))
        for k in range(1, points + 1)
    }
    return [found[i] for i in sorted(chosen)]  # near-equal targets may pick one checkpoint twice: fewer points


def checkpoint_weights(path) -> dict[str, torch.Tensor]:
    """The encoder weights (``transformer.*`` of the MaskedLM) of one checkpoint folder, as ``load_pretrained``
    reads them from the latest one."""
    path = Path(path)
    if not (path / ckpt.TENSORS).is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint folder (no {ckpt.TENSORS})")
    return encoder_weights(path)


def checkpoint_features(run, weights: dict[str, torch.Tensor], max_len: int = 128):
    """(texts -> (N, d) features, the frozen Transformer) of ``run``'s encoder holding ``weights``.

    ``encoder_features`` builds the frozen encoder of the run's shape and the features function that reads it
    (the run's tokenizer, mean pooling); loading a checkpoint's weights into that encoder gives the features
    ``encoder_features(run)`` would give had the run stopped there: the same code, other numbers.
    """
    features, encoder = encoder_features(run, from_scratch=True, max_len=max_len)
    encoder.load_state_dict(weights)  # strict: a checkpoint of another shape raises here
    return features, encoder


def probe_scores(features, splits: dict, seeds: Sequence[int] = (0,)) -> dict:
    """{"tasks": {task: protocol result}, "average": task average}: the study's linear-probe rows for ``features``."""
    scorer = probe_scorer(features)  # caches the features of each text set: dev and test reuse them across seeds
    per_task = {task: protocol(scorer, s, (None,), seeds) for task, s in splits.items()}
    return {"tasks": per_task, "average": task_average(per_task)}


# -- the schedule at a checkpoint ------------------------------------------------------------------
def _schedule_at(saved: PretrainRun, step: int, seconds: float) -> tuple[float, float]:
    """(fraction of the budget spent, learning-rate multiplier of the next step) at a checkpoint."""
    clock = BudgetClock(saved.budget_seconds, saved.max_steps, elapsed=seconds)
    return clock.fraction(step), budget_schedule(saved.recipe, clock)(step)


# -- the curve ------------------------------------------------------------------------------------
def run_probe_curve(
    run,
    out=None,
    *,
    points: int | None = 8,
    steps: Sequence[int] | None = None,
    tasks: Sequence[str] = tuple(TASKS),
    seeds: Sequence[int] = (0,),
    dev_fraction: float = 0.1,
    max_train: int | None = 2000,
    max_eval: int | None = None,
    threshold: float = 0.03,
    references: dict[str, float] | None = None,
    resume: bool = False,
    progress: bool = True,
) -> dict:
    """The linear probe at ``points`` checkpoints of run folder ``run`` (spaced in tokens; ``steps`` picks them
    instead; ``points=None`` takes all), and once on random weights; writes ``out`` (JSON) after each.

    The defaults are lesson 25's recorded study (``report.RECORDED``): all three tasks, split seed 0, dev a
    tenth of train, train capped at 2,000, dev and test whole. ``seeds``: the study used (0, 1, 2), which give
    the probe three equal scores (``probe_scorer`` is seed-free), so one seed gives the same means at a third of
    the fits. ``threshold``: the gap (a fraction: 0.03 is 3 points) the verdict looks for. ``references``:
    {name: task-average accuracy} drawn as lines (``study_references()`` reads them from a study's JSON).
    ``resume``: keep the points of an existing ``out`` made with the same settings and add the missing ones.

    Cost on 2 shared CPU cores at the CPU shape with these caps (measured): the control ~100 s (it tokenizes
    the 15.5k texts, once for the curve), then ~40 s per checkpoint: ~7 minutes for 8 points.
    """
    run = Path(run)
    saved = _saved_run(run)
    tasks = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    for name in tasks:
        if name not in TASKS:
            raise KeyError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    if not tasks:
        raise ValueError("give at least one task")
    if not 0 < threshold < 1:
        raise ValueError(f"threshold is a gap in accuracy, a fraction in (0, 1), got {threshold}")
    check_no_overlap(tasks, saved.corpora)  # as the study: no task scored on an encoder trained on its text
    chosen = choose_checkpoints(run_checkpoints(run), points, steps)
    latest = ckpt.latest(run / "checkpoints")
    config = {
        "tasks": list(tasks),
        "seeds": list(seeds),
        "split_seed": 0,
        "dev_fraction": dev_fraction,
        "max_train": max_train,
        "max_eval": max_eval,
        "points": points,
        "steps": [c["step"] for c in chosen],
        "threshold": threshold,
        "probe": "encoders.probe_scorer's defaults: mean-pooled last hidden states (max_len 128), l2 1e-3, "
        "200 L-BFGS iterations",
    }
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    val_loss = {h["step"]: h["val_loss"] for h in (summary or {}).get("val_history") or []}
    start = datetime.datetime.now(datetime.timezone.utc)
    results = {
        "provenance": {
            "command": " ".join(sys.argv),
            "date": start.strftime("%Y-%m-%d"),
            "started_utc": start.strftime("%H:%M:%S"),
            "machine": machine_summary(torch.device("cpu")),
            "torch": torch.__version__,
            "run": str(run),
            "run_settings": saved.to_dict(),
            "run_finished": summary is not None,  # summary.json is written at the end of pretraining
            "summary": {k: v for k, v in (summary or {}).items() if k not in ("val_history", "dedup")} or None,
            "checkpoints": len(ckpt.checkpoints(run / "checkpoints")),
        },
        "config": config,
        "references": dict(references or {}),
        "control": None,
        "points": [],
    }
    done: dict[int, dict] = {}
    if resume and out is not None and Path(out).is_file():
        before = load_probe_curve(out)
        if before["config"] != config or before["provenance"]["run"] != str(run):
            raise ValueError(f"{out} holds a curve of another run or other settings: use another --out, or no resume")
        results["control"] = before["control"]
        done = {p["step"]: p for p in before["points"]}

    splits = {t: make_splits(t, dev_fraction, seed=0, max_train=max_train, max_eval=max_eval) for t in tasks}
    todo = [c for c in chosen if c["step"] not in done]
    if results["control"] is None or todo:
        # One frozen encoder for the whole curve: random weights (seed 0: the study's control) first, then each
        # checkpoint's loaded into it (``checkpoint_features``). Its features function remembers the token ids
        # of each batch of texts, so the tasks are tokenized once, not once per checkpoint (about half the cost
        # of a point); ``probe_scorer`` keeps the features themselves, so each checkpoint gets a new one.
        features, encoder = encoder_features(run, from_scratch=True)
    if results["control"] is None:
        clock = time.perf_counter()
        results["control"] = {"name": CONTROL, **probe_scores(features, splits, seeds)}
        results["control"]["probe_seconds"] = round(time.perf_counter() - clock, 1)
        _write(out, results, start)
        if progress:
            print(f"{CONTROL:<28} average {100 * results['control']['average']['mean']:.1f}%", flush=True)
    control = results["control"]
    for c in chosen:
        if c["step"] in done:
            results["points"].append(done[c["step"]])
            continue
        clock = time.perf_counter()
        encoder.load_state_dict(checkpoint_weights(c["path"]))  # strict: a checkpoint of another shape raises
        scores = probe_scores(features, splits, seeds)
        fraction, lr_factor = _schedule_at(saved, c["step"], c["seconds"])
        point = {
            "step": c["step"],
            "tokens_seen": c["tokens_seen"],
            "seconds": c["seconds"],
            "minutes": round(c["seconds"] / 60, 3),
            "budget_fraction": round(fraction, 4),
            "lr_factor": round(lr_factor, 4),
            "val_loss": val_loss.get(c["step"]),
            "latest": Path(c["path"]) == latest,  # the run's final weights when run_finished
            **scores,
            "gap": {
                "average": scores["average"]["mean"] - control["average"]["mean"],
                "tasks": {t: scores["tasks"][t]["test"]["mean"] - control["tasks"][t]["test"]["mean"] for t in tasks},
            },
            "probe_seconds": round(time.perf_counter() - clock, 1),
        }
        results["points"].append(point)
        _write(out, results, start)
        if progress:
            print(
                f"step {c['step']:>7,} {c['seconds'] / 60:6.1f} min {c['tokens_seen'] / 1e6:7.2f}M tokens  "
                f"probe {100 * scores['average']['mean']:.1f}%  gap {100 * point['gap']['average']:+.1f} points  "
                f"({point['probe_seconds']:.0f} s)",
                flush=True,
            )
    results["verdict"] = curve_verdict(results)
    _write(out, results, start)
    return results


def _write(out, results: dict, start: datetime.datetime) -> None:
    results["provenance"]["wall_seconds"] = round(
        (datetime.datetime.now(datetime.timezone.utc) - start).total_seconds(), 1
    )
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1))
