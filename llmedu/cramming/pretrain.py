"""Masked-LM pretraining from scratch under a wall-clock budget (Geiping & Goldstein 2023, sec. 2-4).

    run = PretrainRun(crammed(), budget_seconds=parse_budget("10m"))
    summary = pretrain("runs/crammed", run)

The rules of the game (the paper's sec. 2): a model trained from random weights on raw text, on one
device, for a fixed number of seconds; the data preparation (``data.prepare_data``: tokenizer, packing,
deduplication) happens once, before the clock starts. The training itself is ``loop.crammed_loop``, the
budgeted step in one loop (budget clock, schedule, batch ramp, sparse prediction, clipping); its clock sums
the optimizer steps' times, leaving out checkpoints and held-out evaluations. This file manages the run
around it: the run folder, resuming, and the hooks that write checkpoints and the held-out history.

The run folder holds ``run.json`` (the ``PretrainRun``: recipe, corpora, budget and seed, what a
resume must match), ``tokenizer.json``, ``checkpoints/step-NNNNNN`` (resumable exactly: weights, Adam's
moments, RNG, data position and clock; resumed from the newest intact one) and ``summary.json``.

Passes over the data: the summary states the training split's packed tokens (``corpus_tokens``), the
tokens read across resumes (``tokens_seen``) and their ratio (``passes``): a run that reads its data eight
times is a repeated-data result. ``PretrainRun(dedup=True)`` trains on the text less exact duplicate
documents and repeated lines (``data.py``), and the summary says how much went. ``eval_every=N`` measures
the held-out MLM loss every N steps (outside the clock) into ``val_history`` (``target.time_to_target``).
Left out: multi-GPU runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from tqdm import tqdm

from .. import runtime
from ..data.packing import MLMBatches
from ..models import MaskedLM
from ..models.counting import count_parameters, flops_per_token, matmul_parameters
from ..tokenizers import WordPieceTokenizer
from ..train import checkpoint as ckpt
from ..train.history import StepInfo
from ..train.precision import Precision
from .data import CORPORA, prepare_data
from .loop import Hooks, crammed_loop, mlm_loss_fn
from .recipe import BudgetClock, Recipe

__all__ = ["PretrainRun", "pretrain", "mlm_loss_fn", "mlm_flops_per_token", "evaluate_mlm", "passes_over_data"]
__all__ += ["read_run", "load_run", "load_pretrained", "encoder_weights"]


@dataclass(frozen=True)
class PretrainRun:
    """What a pretraining run is: the recipe, the data and the budget. ``run.json`` holds it, and a
    resumed run must be the saved one; how it is executed (device, checkpoints, progress) may change."""

    recipe: Recipe
    budget_seconds: float | None  # of training steps; None: max_steps alone
    max_steps: int | None = None  # also stop after this many optimizer steps
    corpora: tuple[str, ...] = CORPORA
    max_chars: int | None = None  # of each corpus; None: all of it
    seed: int = 0  # of the weights, the batch order and the masks
    dedup: bool = False  # train on the text less duplicate documents and repeated lines (data.py)

    def __post_init__(self):
        # checked here, before anything is written: a rejected run must not leave a run.json behind
        check_budget(self.budget_seconds, self.max_steps)
        if self.max_chars is not None and (not isinstance(self.max_chars, int) or self.max_chars < 1):
            raise ValueError(f"max_chars must be an int >= 1, got {self.max_chars!r}")
        if not self.corpora:
            raise ValueError("give at least one corpus")
        object.__setattr__(self, "corpora", tuple(self.corpora))  # a list from JSON compares equal after this

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> PretrainRun:
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(f"unknown run fields {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}")
        return cls(**{**values, "recipe": Recipe.from_dict(values["recipe"])})

    def differences(self, other: PretrainRun) -> dict[str, tuple]:
        """{setting: (self's value, other's value)} for every setting that differs, the recipe's included."""
        diff = self.recipe.differences(other.recipe)
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name != "recipe" and a != b:
                diff[f.name] = (a, b)
        return diff


def pretrain(
    out: str | Path,
    run: PretrainRun,
    *,
    resume: bool = False,
    device: torch.device | None = None,
    tokenizer_chars: int = 400_000,
    checkpoint_every: int = 100,
    keep_checkpoints: int | None = None,
    eval_batches: int = 20,
    eval_every: int | None = None,
    progress: bool = True,
    callbacks: Iterable[Callable] = (),
) -> dict:
    """Pretrain ``run.recipe`` until its budget (seconds) or ``run.max_steps`` is spent; the run folder is ``out``.

    Returns the summary (also written to ``out/summary.json``). ``resume=True`` continues an
    interrupted run from its newest intact checkpoint (``checkpoint.newest_intact``: a damaged newer one
    is moved aside with a warning); ``run`` must be the saved one. ``eval_every``: also measure the
    held-out loss (``eval_batches`` batches) every that many steps, into ``val_history``.
    ``keep_checkpoints``: keep only the newest N (>= 2) checkpoints (None: every one, which the probe curve reads).
    """
    if eval_every is not None and (not isinstance(eval_every, int) or eval_every < 1):
        raise ValueError(f"eval_every must be an int >= 1 (steps) or None, got {eval_every!r}")
    if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be an int >= 1 (steps), got {checkpoint_every!r}")
    if keep_checkpoints is not None:
        ckpt.check_keep(keep_checkpoints, "keep_checkpoints")
    out, recipe = Path(out), run.recipe
    _check_folder(out, run, resume)
    device = device or runtime.device()
    data = prepare_data(recipe, run.corpora, run.max_chars, tokenizer_chars, progress, dedup=run.dedup)
    if data.tokenizer.vocab_size != recipe.model.vocab_size:
        raise ValueError(f"the tokenizer has {data.tokenizer.vocab_size} entries, the model {recipe.model.vocab_size}")
    # raises if the data are too small for one batch, before anything is written
    batches = MLMBatches(data.train, recipe.micro_batch, data.tokenizer, seed=run.seed, **_masking(recipe))
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        (out / "run.json").write_text(json.dumps(run.to_dict(), indent=1))
        data.tokenizer.save(out / "tokenizer.json")

    runtime.seed_everything(run.seed)
    model = MaskedLM(recipe.model).to(device)
    optimizer = _adamw(model, recipe)
    policy = Precision(recipe.resolved_precision(device))  # fp16 carries a loss scaler, which checkpoints save
    checkpoints = out / "checkpoints"
    # everything a resume reads (clock, step, position, weights, RNG) comes from this one checked checkpoint;
    # a run stopped before its first checkpoint starts again from step 0
    had_checkpoints = resume and bool(ckpt.checkpoints(checkpoints))
    saved = ckpt.newest_intact(checkpoints) if resume else None
    if had_checkpoints and saved is None:
        raise FileNotFoundError(f"no intact checkpoint in {checkpoints} to resume from (damaged ones are moved aside)")
    if not saved and ckpt.latest(checkpoints) is not None:
        raise FileExistsError(f"{checkpoints} already holds checkpoints: resume the run, or use an empty folder")
    start = ckpt.load(saved, model, optimizer) if saved else {"step": 0, "position": 0, "seconds": 0.0}
    if policy.scaler is not None and start.get("scaler"):
        policy.scaler.load_state_dict(start["scaler"])
    clock = BudgetClock(run.budget_seconds, run.max_steps, elapsed=start["seconds"])
    val = None  # the held-out batches, where there are rows enough for one
    if len(data.validation) >= recipe.micro_batch:
        val = MLMBatches(data.validation, recipe.micro_batch, data.tokenizer, seed=12345, **_masking(recipe))
    bar = tqdm(total=run.max_steps, initial=start["step"], disable=not progress, desc="train", unit="step")
    held_out = lambda: evaluate_mlm(model, val, eval_batches, policy.name, device)  # noqa: E731
    hooks = _RunFolder(checkpoints, keep_checkpoints, model, optimizer, policy, held_out, bar, callbacks)
    hooks.saved_at = start["step"] if saved else None
    where = dict(step=start["step"], position=start["position"], checkpoint_every=checkpoint_every)
    where["eval_every"] = eval_every if val is not None else None

    wall = time.perf_counter()
    try:
        with runtime.sigterm_as_interrupt():  # a scheduler's SIGTERM saves the last step, as Ctrl-C does
            history = crammed_loop(
                model, optimizer, batches, recipe, clock, device=device, precision=policy, hooks=hooks, **where
            )
    except KeyboardInterrupt:
        print(f"interrupted: step {hooks.saved_at} is saved in {checkpoints}; resume=True continues from it")
        raise
    finally:
        bar.close()
    wall = time.perf_counter() - wall

    val_loss = evaluate_mlm(model, val, eval_batches, policy.name, device) if val else None
    summary = _summary(run, model, history, start, device, policy.name, wall, val_loss)
    # passes over the data: the trainer's position counts micro-batches across resumes
    position = json.loads((ckpt.latest(checkpoints) / ckpt.STATE).read_text())["position"]
    tokens_seen = position * recipe.micro_batch * recipe.model.max_seq_len
    summary |= {"corpus_tokens": data.corpus_tokens, "tokens_seen": tokens_seen}
    summary["passes"] = round(passes_over_data(tokens_seen, data.corpus_tokens), 3)
    summary |= {"dedup": data.dedup} if data.dedup is not None else {}  # what deduplication removed
    summary["eval_every"] = eval_every
    summary["val_history"] = hooks.val_history
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["history"] = history  # for notebooks: every step; not written to the JSON file
    return summary


def passes_over_data(tokens_seen: int, corpus_tokens: int) -> float:
    """How many times a run read its training text: tokens seen / distinct token positions in the corpus."""
    if corpus_tokens < 1 or tokens_seen < 0:
        raise ValueError(f"need corpus_tokens >= 1 and tokens_seen >= 0, got {corpus_tokens} and {tokens_seen}")
    return tokens_seen / corpus_tokens


def mlm_flops_per_token(recipe: Recipe, model: MaskedLM) -> float:
    """Training FLOPs per token, 6N + 12LTd (``llmedu.models.counting``), counting only what runs.

    With sparse prediction the head's matmuls (dense and the d x vocab decoder) run on the masked
    positions alone, so their N counts at ``mask_rate`` of the tokens; MFU computed from the full
    count would credit the model with the ~85% of the decoder's work that it skips.
    """
    head = matmul_parameters(model.mlm_head)
    body = matmul_parameters(model) - head
    share = recipe.mask_rate if recipe.sparse_prediction else 1.0
    return flops_per_token(recipe.model, body + share * head, recipe.model.max_seq_len)


@torch.no_grad()
def evaluate_mlm(model: MaskedLM, batches: MLMBatches, n_batches: int, precision: str, device) -> float:
    """Mean masked-LM loss over the first ``n_batches`` batches (fixed masks: the same for every model)."""
    was_training = model.training
    model.eval()
    loss_fn, total = mlm_loss_fn(sparse=True), 0.0
    n = min(n_batches, batches.per_epoch)
    for i in range(n):
        batch = {k: v.to(device) for k, v in batches(i).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            total += loss_fn(model, batch).item()
    model.train(was_training)
    return total / n


class _RunFolder(Hooks):
    """The loop's hooks for a run folder: held-out losses, progress, callbacks and checkpoints."""

    def __init__(self, folder: Path, keep: int | None, model, optimizer, policy: Precision, held_out, bar, callbacks):
        self.folder, self.keep, self.model, self.optimizer, self.policy = folder, keep, model, optimizer, policy
        self.held_out, self.bar, self.callbacks = held_out, bar, list(callbacks)  # held_out() -> the held-out loss
        self.val_history, self.saved_at = [], None  # {step, seconds of training, held-out loss}; the last step saved

    def evaluate(self, info: StepInfo) -> None:
        loss = self.held_out()
        self.val_history.append({"step": info.step, "elapsed": round(info.elapsed, 3), "val_loss": round(loss, 4)})

    def step_done(self, info: StepInfo) -> None:
        for callback in self.callbacks:
            callback(info)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{info.loss:.4f}", refresh=False)

    def checkpoint(self, step: int, position: int, seconds: float) -> None:
        if step == self.saved_at:
            return  # saved already (every N steps, then the end or an interrupt)
        scaler = self.policy.scaler.state_dict() if self.policy.scaler else None
        state = dict(step=step, position=position, seconds=seconds, scaler=scaler)
        ckpt.save(self.folder, self.model, self.optimizer, state)
        if self.keep is not None:  # only once the new one is complete
            ckpt.prune(self.folder, self.keep)
        self.saved_at = step


def _check_folder(out: Path, run: PretrainRun, resume: bool) -> None:
    """A new run needs a folder without one; a resumed run must be the one saved there."""
    if not resume:
        if (out / "run.json").exists():
            raise FileExistsError(
                f"{out} already holds a run: resume it (resume=True; --resume on the command line), or use another folder"
            )
        return
    if not (out / "run.json").is_file():
        raise FileNotFoundError(f"nothing to resume: {out / 'run.json'} does not exist")
    diff = read_run(out).differences(run)
    if diff:
        lines = ", ".join(f"{k}: {a!r} (saved) vs {b!r} (now)" for k, (a, b) in diff.items())
        raise ValueError(f"cannot resume with a different recipe or run: {lines}")


def check_budget(budget_seconds: float | None, max_steps: int | None) -> None:
    """A run stops at ``budget_seconds`` of training steps, ``max_steps``, or the first of both: a clear error
    for neither, a budget that is not a positive number of seconds, or steps that are not an int >= 1."""
    if budget_seconds is None and max_steps is None:
        raise ValueError("give a budget in seconds, max_steps, or both")
    if budget_seconds is not None and not budget_seconds > 0:
        raise ValueError(f"the budget must be a positive number of seconds, got {budget_seconds}")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")


def _masking(recipe: Recipe) -> dict:
    return dict(rate=recipe.mask_rate, mask=recipe.mask_fraction, random=recipe.random_fraction)


def _adamw(model: MaskedLM, recipe: Recipe) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices, not on embeddings, norms and biases (BERT's grouping)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas, eps=1e-12)


def _summary(run: PretrainRun, model, history, start: dict, device, precision: str, wall: float, val_loss) -> dict:
    """The figures of a run, as written to ``summary.json``."""
    steps = history.steps
    tokens = sum(s.tokens for s in steps)
    seconds = sum(s.seconds for s in steps)
    return {
        "recipe": run.recipe.name,
        "device": str(device),
        "precision": precision,
        "parameters": count_parameters(model),
        "steps": steps[-1].step if steps else start["step"],
        "steps_this_run": len(steps),
        "stop_reason": history.stop_reason,
        "budget_seconds": run.budget_seconds,
        "elapsed_seconds": round(steps[-1].elapsed if steps else start["seconds"], 3),
        "wall_seconds": round(wall, 3),
        "longest_step_seconds": round(max((s.seconds for s in steps), default=0), 3),
        "tokens_this_run": tokens,
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "train_loss": round(sum(s.loss for s in steps[-10:]) / len(steps[-10:]), 4) if steps else None,
        "val_loss": round(val_loss, 4) if val_loss is not None else None,
        "flops_per_token": mlm_flops_per_token(run.recipe, model),
    }


def read_run(out: str | Path) -> PretrainRun:
    """The ``PretrainRun`` saved in a run folder's ``run.json``; a field or value it does not know is an
    error naming the file, the field or value, and the ones allowed."""
    path = Path(out) / "run.json"
    if not path.is_file():
        raise FileNotFoundError(f"{out} is not a pretraining run (no run.json)")
    try:
        return PretrainRun.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{path}: {error}") from None


def load_run(out: str | Path) -> tuple[Recipe, WordPieceTokenizer]:
    """The recipe and tokenizer of a pretraining run folder."""
    return read_run(out).recipe, WordPieceTokenizer.load(Path(out) / "tokenizer.json")


def load_pretrained(out: str | Path) -> dict[str, torch.Tensor]:
    """The encoder weights (``transformer.*`` of the MaskedLM) of a run's latest checkpoint."""
    latest = ckpt.latest(Path(out) / "checkpoints")
    if latest is None:
        raise FileNotFoundError(f"no checkpoint under {Path(out) / 'checkpoints'}")
    return encoder_weights(latest)


def encoder_weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The encoder weights (``transformer.*`` of the MaskedLM) of one checkpoint folder, read through the
    checkpoint's own checks (``train.checkpoint.read``: a damaged file is an error, not damaged weights)."""
    tensors, _ = ckpt.read(checkpoint)  # safetensors: raw numbers, nothing unpickled
    prefix = "model.transformer."
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
