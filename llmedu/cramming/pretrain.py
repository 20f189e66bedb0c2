"""Masked-LM pretraining from scratch under a wall-clock budget (Geiping & Goldstein 2022, sec. 2-4).

    summary = pretrain("runs/crammed", crammed(), budget="10m")

The rules of the game (the paper's sec. 2): a model trained from random weights on raw text, on one
device, for a fixed number of seconds; the data preparation (tokenizer, packing) happens before the
clock starts. The clock here is the trainer's: the sum of the optimizer steps' times, which leaves
out checkpoint writing and the evaluation at the end.

The run folder holds ``run.json`` (the recipe, corpora, budget and seed: what a resume must match),
``tokenizer.json``, ``checkpoints/step-NNNNNN`` (the trainer's, resumable exactly) and
``summary.json`` (the figures printed at the end).

Sparse prediction (the paper's sec. 4.3): the MLM head is a dense layer, a norm and a (T, vocab)
matmul per position, but only the ~15% masked positions carry a loss. Running the head on those
rows alone gives the same loss and gradients, and skips about 85% of the largest matmul.

Left out: the paper's evaluation of the MLM loss on held-out data during training (we evaluate once,
at the end), and multi-GPU runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .. import runtime
from ..data.packing import MLMBatches, packed_rows, train_tokenizer
from ..models import MaskedLM
from ..models.counting import count_parameters, flops_per_token, matmul_parameters
from ..tokenizers import WordPieceTokenizer
from ..train import TrainConfig, train
from ..train import checkpoint as ckpt
from .recipe import BudgetClock, Recipe, budget_accumulation, budget_schedule, parse_budget

__all__ = [
    "CORPORA",
    "prepare_data",
    "mlm_loss_fn",
    "mlm_flops_per_token",
    "pretrain",
    "evaluate_mlm",
    "load_run",
    "load_pretrained",
]

CORPORA = ("wikipedia", "shakespeare", "kjv", "speeches", "tweets", "vader")


def prepare_data(
    recipe: Recipe,
    corpora: Sequence[str] = CORPORA,
    max_chars: int | None = None,
    tokenizer_chars: int = 400_000,
    progress: bool = True,
):
    """(tokenizer, train rows, validation rows), all cached: the work done before the clock starts."""
    tokenizer = train_tokenizer(corpora, recipe.vocab_size, sample_chars=tokenizer_chars)
    train_rows = packed_rows(tokenizer, corpora, "train", recipe.seq_len, max_chars, progress=progress)
    val_chars = None if max_chars is None else max(max_chars // 10, 20 * recipe.seq_len)
    val_rows = packed_rows(tokenizer, corpora, "validation", recipe.seq_len, val_chars, progress=progress)
    return tokenizer, train_rows, val_rows


def mlm_loss_fn(sparse: bool) -> Callable:
    """loss_fn(model, batch) for the trainer: cross-entropy over the masked positions."""

    def loss_fn(model: MaskedLM, batch: dict) -> torch.Tensor:
        h = model.transformer(batch["input_ids"])  # (B, T, d)
        labels = batch["labels"]  # (B, T), -100 where nothing is predicted
        if sparse:
            picked = labels != -100  # (B, T)
            logits = model.mlm_head(h[picked])  # (M, vocab): the masked rows only
            return F.cross_entropy(logits.float(), labels[picked])
        logits = model.mlm_head(h)  # (B, T, vocab): every position
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    return loss_fn


def mlm_flops_per_token(recipe: Recipe, model: MaskedLM) -> float:
    """Training FLOPs per token, 6N + 12LTd (``llmedu.models.counting``), counting only what runs.

    With sparse prediction the head's matmuls (dense and the d x vocab decoder) run on the masked
    positions alone, so their N counts at ``mask_rate`` of the tokens; MFU computed from the full
    count would credit the model with the ~85% of the decoder's work that it skips.
    """
    head = matmul_parameters(model.mlm_head)
    body = matmul_parameters(model) - head
    share = recipe.mask_rate if recipe.sparse_prediction else 1.0
    return flops_per_token(recipe.model_config(), body + share * head, recipe.seq_len)


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


def _run_spec(recipe, corpora, max_chars, budget_seconds, max_steps, seed) -> dict:
    return {
        "recipe": recipe.to_dict(),
        "corpora": list(corpora),
        "max_chars": max_chars,
        "budget_seconds": budget_seconds,
        "max_steps": max_steps,
        "seed": seed,
    }


def _check_resume(saved: dict, spec: dict) -> None:
    saved_recipe = Recipe.from_dict(saved["recipe"])
    diff = saved_recipe.differences(Recipe.from_dict(spec["recipe"]))
    diff.update({k: (saved[k], spec[k]) for k in spec if k != "recipe" and saved.get(k) != spec[k]})
    if diff:
        lines = ", ".join(f"{k}: {a!r} (saved) vs {b!r} (now)" for k, (a, b) in diff.items())
        raise ValueError(f"cannot resume with a different recipe or run: {lines}")


def pretrain(
    out: str | Path,
    recipe: Recipe,
    budget: str | float | None = "30s",
    *,
    max_steps: int | None = None,
    corpora: Sequence[str] = CORPORA,
    max_chars: int | None = None,
    tokenizer_chars: int = 400_000,
    resume: bool = False,
    device: torch.device | None = None,
    checkpoint_every: int = 100,
    eval_batches: int = 20,
    seed: int = 0,
    progress: bool = True,
    callbacks: Iterable[Callable] = (),
) -> dict:
    """Pretrain ``recipe`` until the budget (seconds, or '10m'-style text) or ``max_steps`` is spent.

    Returns the summary (also written to ``out/summary.json``). ``resume=True`` continues an
    interrupted run from its latest checkpoint; the run's settings must be the saved ones.
    """
    out = Path(out)
    budget_seconds = parse_budget(budget) if isinstance(budget, str) else budget
    if budget_seconds is None and max_steps is None:
        raise ValueError("give a budget in seconds, max_steps, or both")
    spec = _run_spec(recipe, corpora, max_chars, budget_seconds, max_steps, seed)
    if resume:
        if not (out / "run.json").is_file():
            raise FileNotFoundError(f"nothing to resume: {out / 'run.json'} does not exist")
        _check_resume(json.loads((out / "run.json").read_text()), spec)
    elif (out / "run.json").exists():
        raise FileExistsError(f"{out} already holds a run: pass resume=True, or use another folder")

    device = device or runtime.device()
    tokenizer, train_rows, val_rows = prepare_data(recipe, corpora, max_chars, tokenizer_chars, progress)
    if tokenizer.vocab_size != recipe.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} entries, the recipe asks for {recipe.vocab_size}")
    mask = dict(rate=recipe.mask_rate, mask=recipe.mask_fraction, random=recipe.random_fraction)
    data = MLMBatches(train_rows, recipe.micro_batch, tokenizer, seed=seed, **mask)  # raises if too small
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        (out / "run.json").write_text(json.dumps(spec, indent=1))
        tokenizer.save(out / "tokenizer.json")

    runtime.seed_everything(seed)
    model = MaskedLM(recipe.model_config()).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=recipe.betas,
        eps=1e-12,
    )
    checkpoints = out / "checkpoints"
    saved = ckpt.latest(checkpoints) if resume else None
    start = json.loads((saved / ckpt.STATE).read_text()) if saved else {"step": 0, "seconds": 0.0}
    clock = BudgetClock(budget_seconds, max_steps, elapsed=start["seconds"])
    precision = recipe.resolved_precision(device)
    config = TrainConfig(
        max_steps=max_steps,
        max_seconds=budget_seconds,
        precision=precision,
        accumulation=budget_accumulation(recipe, clock),
        schedule=budget_schedule(recipe, clock),
        clip_grad_norm=recipe.clip_grad_norm,
        checkpoint_dir=checkpoints,
        checkpoint_every=checkpoint_every,
        progress=progress,
    )
    on_device = lambda i: {k: v.to(device, non_blocking=True) for k, v in data(i).items()}  # noqa: E731
    wall = time.perf_counter()
    history = train(
        model,
        optimizer,
        on_device,
        mlm_loss_fn(recipe.sparse_prediction),
        config,
        callbacks=[clock.tick, *callbacks],
        resume=saved is not None,
    )
    wall = time.perf_counter() - wall

    enough = len(val_rows) >= recipe.micro_batch
    val = MLMBatches(val_rows, recipe.micro_batch, tokenizer, seed=12345, **mask) if enough else None
    steps = history.steps
    tokens = sum(s.tokens for s in steps)
    seconds = sum(s.seconds for s in steps)
    summary = {
        "recipe": recipe.name,
        "device": str(device),
        "precision": precision,
        "parameters": count_parameters(model),
        "steps": steps[-1].step if steps else start["step"],
        "steps_this_run": len(steps),
        "stop_reason": history.stop_reason,
        "budget_seconds": budget_seconds,
        "elapsed_seconds": round(steps[-1].elapsed if steps else start["seconds"], 3),
        "wall_seconds": round(wall, 3),
        "longest_step_seconds": round(max((s.seconds for s in steps), default=0), 3),
        "tokens_this_run": tokens,
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "train_loss": round(sum(s.loss for s in steps[-10:]) / len(steps[-10:]), 4) if steps else None,
        "val_loss": round(evaluate_mlm(model, val, eval_batches, precision, device), 4) if val else None,
        "flops_per_token": mlm_flops_per_token(recipe, model),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["history"] = history  # for notebooks: every step; not written to the JSON file
    return summary


def load_run(out: str | Path) -> tuple[Recipe, WordPieceTokenizer]:
    """The recipe and tokenizer of a pretraining run folder."""
    out = Path(out)
    if not (out / "run.json").is_file():
        raise FileNotFoundError(f"{out} is not a pretraining run (no run.json)")
    spec = json.loads((out / "run.json").read_text())
    return Recipe.from_dict(spec["recipe"]), WordPieceTokenizer.load(out / "tokenizer.json")


def load_pretrained(out: str | Path) -> dict[str, torch.Tensor]:
    """The encoder weights (``transformer.*`` of the MaskedLM) of a run's latest checkpoint."""
    latest = ckpt.latest(Path(out) / "checkpoints")
    if latest is None:
        raise FileNotFoundError(f"no checkpoint under {Path(out) / 'checkpoints'}")
    tensors = load_file(str(latest / ckpt.TENSORS))
    prefix = "model.transformer."
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
