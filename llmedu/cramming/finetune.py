"""Downstream evaluation: fine-tune the pretrained encoder on a labelled task with fixed settings.

Cramming judges a budget by what the model is good for afterwards (Geiping & Goldstein 2022, sec.
2 and 5): the pretrained encoder gets a classifier on its [CLS] state and is fine-tuned with one
fixed set of hyper-parameters for every model, at most 5 epochs, no search per task. The tasks are
those of ``llmedu.data.classification``: Rotten Tomatoes (fresh vs rotten, an SST-2-like sentiment
task) and BBC News (five topics).

The control is the same architecture from random weights, fine-tuned the same way: the difference
is what pretraining bought.

Dropout is off in crammed pretraining and on (0.1) in fine-tuning, for every model: the authors'
code builds the model with dropout 0.1 and pretrains it in eval mode (``pretrain_in_train_mode:
False`` in their ``bert-o4`` settings), so their fine-tuning, in train mode, has it.

``FIXED`` (lr 1e-4, batch 32, linear decay) is the course's setting, chosen before any comparison was
run; ``AUTHORS`` is the authors' own GLUE setting (``eval/GLUE_sane.yaml``: lr 4e-5, batch 16, cosine
decay). ``SETTINGS`` names both. ``--lr`` and ``--batch-size`` of the command line override either, to
study how the comparison depends on them (lesson 20).

Left out: GLUE's other tasks and its test server, sentence-pair tasks, and the paper's averaging
over several fine-tuning seeds.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from .. import runtime
from ..data.classification import load_classification
from ..models import SequenceClassifier
from ..tokenizers import WordPieceTokenizer
from ..train import TrainConfig, train
from ..train.schedules import warmup_cosine, warmup_linear
from .pretrain import load_pretrained, load_run

__all__ = ["FinetuneSettings", "FIXED", "AUTHORS", "SETTINGS", "encode_texts", "finetune", "duration"]


_SCHEDULES = {"linear": warmup_linear, "cosine": warmup_cosine}


@dataclass(frozen=True)
class FinetuneSettings:
    lr: float = 1e-4
    batch_size: int = 32
    epochs: int = 5  # the rules' maximum, and the authors' own GLUE setting
    warmup: float = 0.1  # fraction of the steps
    schedule: str = "linear"  # after the warm-up, "linear" or "cosine" decay to 0
    weight_decay: float = 0.01
    max_len: int = 128  # the pretraining length; longer snippets are cut
    dropout: float = 0.1  # on again for fine-tuning, whatever the pretraining recipe said (see the docstring)

    def __post_init__(self):
        if self.lr <= 0 or self.batch_size < 1:
            raise ValueError(f"lr must be positive and batch_size at least 1, got {self.lr} and {self.batch_size}")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(_SCHEDULES)}, got {self.schedule!r}")
        if not 1 <= self.epochs <= 5:
            raise ValueError(f"the rules allow 1 to 5 fine-tuning epochs, got {self.epochs}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout is a probability in [0, 1), got {self.dropout}")


FIXED = FinetuneSettings()  # the one setting every model is fine-tuned with
AUTHORS = FinetuneSettings(lr=4e-5, batch_size=16, schedule="cosine")  # Geiping & Goldstein's GLUE setting
SETTINGS = {"fixed": FIXED, "authors": AUTHORS}  # by name, for the command line


def encode_texts(tokenizer: WordPieceTokenizer, texts: list[str], max_len: int) -> list[list[int]]:
    """[CLS] text [SEP], cut to ``max_len`` tokens (the [SEP] kept)."""
    sep = tokenizer.vocab["[SEP]"]
    return [ids if len(ids) <= max_len else ids[: max_len - 1] + [sep] for ids in (tokenizer.encode(t) for t in texts)]


def _collate(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids -> (ids, attention mask), both (B, longest row), padded on the right."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return ids, (ids != pad_id).long()


@torch.no_grad()
def accuracy(
    model: SequenceClassifier, rows: list[list[int]], labels: list[int], pad_id: int, device, batch_size: int = 128
) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(rows), batch_size):
        ids, mask = _collate(rows[start : start + batch_size], pad_id)
        logits = model(ids.to(device), mask.to(device))  # (B, 2)
        correct += (logits.argmax(-1).cpu() == torch.tensor(labels[start : start + batch_size])).sum().item()
    return correct / len(rows)


MEASURED_STEPS = 5  # the optimizer steps timed for the estimate of a fine-tune's duration


def duration(seconds: float) -> str:
    """A duration a reader plans with: "40 s", "12 minutes", "2.5 hours"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} minutes" if seconds < 90 * 60 else f"{seconds / 3600:.1f} hours"


def estimate_after_steps(what: str, total: int, stream=None) -> Callable:
    """A trainer callback: after the first ``MEASURED_STEPS`` steps, print their time and the duration it implies
    for all ``total`` steps (measured on this machine, the steps only: loading and scoring come on top)."""

    def callback(info) -> None:
        if info.step == min(MEASURED_STEPS, total):
            left = info.elapsed / info.step * total
            print(f"{what}: the first {info.step} steps took {info.elapsed:.1f} s: about {duration(left)} for all "
                  f"{total} steps (measured on this machine)", file=stream or sys.stderr, flush=True)  # fmt: skip

    return callback


def _check_one_batch(n: int, settings: FinetuneSettings) -> None:
    if n < settings.batch_size:
        raise ValueError(f"{n} training examples are fewer than one batch of {settings.batch_size}")


def fit_classifier(
    model: torch.nn.Module,
    rows: list[list[int]],
    labels: list[int],
    pad: int,
    settings: FinetuneSettings,
    seed: int,
    *,
    device: torch.device | None = None,
    precision: str = "fp32",
    progress: bool = False,
    callbacks=(),
) -> dict:
    """Train ``model`` (called as model(ids, mask) -> logits) on token ``rows`` and ``labels``: AdamW,
    ``settings.epochs`` seeded shuffles cut into batches, warm-up then the settings' decay. The history."""
    _check_one_batch(len(rows), settings)
    per_epoch = len(rows) // settings.batch_size
    total = settings.epochs * per_epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)

    def batches(i: int):
        epoch, index = divmod(i, per_epoch)
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 1 + epoch)).tolist()
        pick = perm[index * settings.batch_size : (index + 1) * settings.batch_size]
        ids, mask = _collate([rows[j] for j in pick], pad)
        return ids.to(device), mask.to(device), torch.tensor([labels[j] for j in pick], device=device)

    def loss_fn(model, batch):
        ids, mask, y = batch
        return F.cross_entropy(model(ids, mask).float(), y)

    warmup = min(max(1, int(settings.warmup * total)), total - 1)  # a one-step run has none
    config = TrainConfig(
        max_steps=total,
        schedule=_SCHEDULES[settings.schedule](warmup, total),
        precision=precision,
        progress=progress,
    )
    return train(model, optimizer, batches, loss_fn, config, callbacks=callbacks)


def finetune(
    run: str | Path,
    task: str = "rotten_tomatoes",
    *,
    from_scratch: bool = False,
    settings: FinetuneSettings = FIXED,
    max_train: int | None = None,
    max_eval: int | None = None,
    device: torch.device | None = None,
    seed: int = 0,
    progress: bool = True,
    out: str | Path | None = None,
) -> dict:
    """Fine-tune the encoder of pretraining run ``run`` (or, ``from_scratch``, the same shape from
    random weights) on ``task``; return the validation accuracy and the run's figures.

    With ``out``, the fine-tuned classifier is kept there: ``model.safetensors`` (its weights) and
    ``results.json`` (what this returns). An ``out`` that already holds results is an error.
    """
    if out is not None and (Path(out) / "results.json").exists():
        raise FileExistsError(f"{out} already holds fine-tuning results: choose another folder")
    recipe, tokenizer = load_run(run)
    device = device or runtime.device()
    texts, labels = load_classification(task, "train")
    val_texts, val_labels = load_classification(task, "validation")
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()[:max_train]
    texts, labels = [texts[i] for i in order], [labels[i] for i in order]  # a random slice: the files are sorted
    order = torch.randperm(len(val_texts), generator=torch.Generator().manual_seed(0)).tolist()[:max_eval]
    val_texts, val_labels = [val_texts[i] for i in order], [val_labels[i] for i in order]  # the same for every model
    rows = encode_texts(tokenizer, texts, settings.max_len)
    val_rows = encode_texts(tokenizer, val_texts, settings.max_len)
    pad = tokenizer.vocab["[PAD]"]
    _check_one_batch(len(rows), settings)

    steps = settings.epochs * (len(rows) // settings.batch_size)
    if progress:
        print(f"finetune: {settings.epochs} epoch(s) of {len(rows) // settings.batch_size} batches of "
              f"{settings.batch_size} = {steps} optimizer steps; the duration is measured on the first "
              f"{min(MEASURED_STEPS, steps)}", file=sys.stderr, flush=True)  # fmt: skip
    runtime.seed_everything(seed)
    model = SequenceClassifier(replace(recipe.model, dropout=settings.dropout), n_classes=len(set(labels)))
    if not from_scratch:
        model.transformer.load_state_dict(load_pretrained(run))  # strict: every weight must fit
    model.to(device)
    history = fit_classifier(
        model,
        rows,
        labels,
        pad,
        settings,
        seed,
        device=device,
        precision=recipe.resolved_precision(device),
        progress=progress,
        callbacks=[estimate_after_steps("finetune", steps)] if progress else [],
    )
    result = {
        "task": task,
        "init": "random" if from_scratch else "pretrained",
        "run": str(run),
        "train_examples": len(rows),
        "eval_examples": len(val_rows),
        "steps": steps,
        "final_train_loss": round(sum(history["loss"][-10:]) / len(history["loss"][-10:]), 4),
        "accuracy": round(accuracy(model, val_rows, val_labels, pad, device), 4),
        "majority_baseline": round(max(val_labels.count(c) for c in set(val_labels)) / len(val_labels), 4),
        "settings": asdict(settings),
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
        (out / "results.json").write_text(json.dumps(result, indent=1))
        result["out"] = str(out)
    return result
