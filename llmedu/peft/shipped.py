"""The LoRA adapters that ship with the course: all-MiniLM-L6-v2 fine-tuned on Rotten Tomatoes.

Lesson 19's fast mode cannot train a method to a useful accuracy in a minute on 2 CPU cores, so it
loads an adapter that was trained once with the lesson's own full-mode recipe (``RECIPE``: LoRA,
Hu et al. 2021, eq. 3, on the query and value projections of all 6 layers, r=8, alpha=16, plus the new
2-way classifier head; AdamW, two epochs of the training split) and evaluates it. Two adapters:

``rotten_tomatoes_lora``           trained on the labels (fresh = 1, rotten = 0)
``rotten_tomatoes_lora_inverted``  the same recipe on inverted labels, for half an epoch
                                   (``INVERTED_EPOCHS``): the second adapter of the lesson's multi-LoRA
                                   serving demo, which only has to disagree with the first

Each is two files in ``data/adapters/`` (committed to git, unlike ``data/cache/``):

``NAME.safetensors``  the trainable tensors, written by ``llmedu.peft.save_adapter``: safetensors is a
                      header and raw bytes, so loading it runs no code (no pickle)
``NAME.json``         the recipe, the file's size and sha256, the base model's fingerprint
                      (``llmedu.peft.inject.base_fingerprint``) and the accuracy measured after training

``load_shipped`` checks the file against the JSON (size, sha256) before reading a byte of it as tensors,
then ``load_adapter`` checks tensor names, shapes and the base fingerprint. ``python -m
llmedu.peft.shipped`` retrains both adapters and rewrites the four files (the wall time each took is
``train_seconds`` in its record).

Left out: adapters for other models or tasks, and a registry of them; bit-exact retraining across
machines (float summation order differs between CPUs and thread counts, so a retrained adapter is
close to the shipped one, not equal: its accuracy is recorded beside it).
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from pathlib import Path

import torch
from torch import nn

from .inject import base_fingerprint, count_parameters, load_adapter, mark_trainable, save_adapter
from .lora import apply_lora

__all__ = [
    "ADAPTER_DIR",
    "RECIPE",
    "INVERTED_EPOCHS",
    "NAMES",
    "load_splits",
    "base_model",
    "lora_model",
    "accuracy",
    "load_shipped",
]

ADAPTER_DIR = Path(__file__).resolve().parents[2] / "data" / "adapters"
NAMES = ("rotten_tomatoes_lora", "rotten_tomatoes_lora_inverted")

RECIPE = {  # lesson 19's full mode, the "LoRA r=8" row of its table
    "base": "all-minilm-l6-v2",  # llmedu.data.reference_files name; BertForSequenceClassification on top
    "layers": 6,
    "task": "rotten_tomatoes",
    "targets": ["query", "value"],
    "r": 8,
    "alpha": 16,
    "also_trained": ["classifier"],
    "optimizer": "AdamW(lr=1e-3), torch defaults otherwise (betas 0.9/0.999, weight_decay 0.01)",
    "lr": 1e-3,
    "batch_size": 32,
    "max_len": 64,
    "epochs": 2,
    "seed": 0,
}


INVERTED_EPOCHS = 0.5  # the inverted adapter's budget: 180 steps instead of 720


def recipe(name: str) -> dict:
    """The recipe the adapter ``name`` was trained with."""
    if name not in NAMES:
        raise ValueError(f"unknown shipped adapter {name!r}; the course ships {', '.join(NAMES)}")
    return {**RECIPE, "epochs": INVERTED_EPOCHS} if name.endswith("_inverted") else dict(RECIPE)


def load_splits() -> tuple[list[str], list[int], list[str], list[int]]:
    """Train and validation (texts, labels), shuffled as lesson 19 does (the files are sorted by movie)."""
    from llmedu.data import load_classification

    train_texts, train_labels = load_classification(RECIPE["task"], "train")
    val_texts, val_labels = load_classification(RECIPE["task"], "validation")
    g = torch.Generator().manual_seed(RECIPE["seed"])
    order = torch.randperm(len(train_texts), generator=g).tolist()
    train_texts, train_labels = [train_texts[i] for i in order], [train_labels[i] for i in order]
    order = torch.randperm(len(val_texts), generator=g).tolist()
    return train_texts, train_labels, [val_texts[i] for i in order], [val_labels[i] for i in order]


def base_model(layers: int = RECIPE["layers"]) -> nn.Module:
    """all-MiniLM-L6-v2 under a new 2-way head, read offline; the head's init is seeded as in the lesson."""
    from transformers import BertForSequenceClassification

    from llmedu.data import reference_files
    from llmedu.runtime import seed_everything

    folder = reference_files(RECIPE["base"])["config.json"].parent
    seed_everything(RECIPE["seed"])
    model = BertForSequenceClassification.from_pretrained(folder, num_labels=2, num_hidden_layers=layers)
    model.config.problem_type = "single_label_classification"
    return model


def tokenizer():
    from transformers import BertTokenizerFast

    from llmedu.data import reference_files

    return BertTokenizerFast.from_pretrained(reference_files(RECIPE["base"])["config.json"].parent)


def lora_model(base: nn.Module) -> nn.Module:
    """A copy of ``base`` with the recipe's LoRA applied and its head opened: what the files fit."""
    model = copy.deepcopy(base)
    apply_lora(model, RECIPE["targets"], r=RECIPE["r"], alpha=RECIPE["alpha"])
    mark_trainable(model, RECIPE["also_trained"])
    return model


@torch.no_grad()
def accuracy(model: nn.Module, tok, texts: list[str], labels: list[int], batch: int = 64) -> float:
    """Share of ``texts`` whose argmax logit is the label; batches of ``batch``, padded per batch."""
    if len(texts) != len(labels) or not texts:
        raise ValueError(f"need as many labels as texts, and at least one: got {len(texts)} and {len(labels)}")
    model.eval()
    dev = next(model.parameters()).device
    correct = 0
    for i in range(0, len(texts), batch):
        enc = tok(
            texts[i : i + batch], padding=True, truncation=True, max_length=RECIPE["max_len"], return_tensors="pt"
        )
        logits = model(input_ids=enc["input_ids"].to(dev), attention_mask=enc["attention_mask"].to(dev)).logits
        correct += (logits.argmax(-1).cpu() == torch.tensor(labels[i : i + batch])).sum().item()
    return correct / len(texts)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_record(path: Path) -> dict:
    """The JSON record beside an adapter, or an error naming the file: not UTF-8, cut short, or lacking a key."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not an adapter record: byte {err.start} is not UTF-8 ({err.reason})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not an adapter record: invalid JSON, cut short or not JSON ({err})") from None
    missing = [k for k in ("bytes", "sha256") if not isinstance(record, dict) or k not in record]
    if missing:
        raise ValueError(f"{path} is not an adapter record: it has no {' or '.join(missing)} of the adapter file")
    return record


def load_shipped(model: nn.Module, name: str = NAMES[0], folder: str | Path | None = None) -> dict:
    """Load the shipped adapter ``name`` into ``model`` (made by ``lora_model``); return its JSON record.

    The file must have the size and sha256 that the record holds, or nothing is loaded.
    """
    if name not in NAMES:
        raise ValueError(f"unknown shipped adapter {name!r}; the course ships {', '.join(NAMES)}")
    folder = ADAPTER_DIR if folder is None else Path(folder)
    record_path, path = folder / f"{name}.json", folder / f"{name}.safetensors"
    for p in (record_path, path):
        if not p.is_file():
            raise FileNotFoundError(f"no {p.name} in {folder}: the shipped adapters live in data/adapters/")
    record = _read_record(record_path)
    size = path.stat().st_size
    if size != record["bytes"]:
        raise ValueError(f"{path.name} holds {size} bytes, its record says {record['bytes']}: the file was changed")
    digest = _sha256(path)
    if digest != record["sha256"]:
        raise ValueError(f"{path.name} has sha256 {digest}, its record says {record['sha256']}: the file was changed")
    load_adapter(model, path)  # names, shapes and the base model's fingerprint
    return record


def _train(flip: bool, epochs: float) -> tuple[nn.Module, dict]:
    from llmedu.runtime import seed_everything
    from llmedu.train.loop import TrainConfig, train

    train_texts, train_labels, val_texts, val_labels = load_splits()
    if flip:
        train_labels, val_labels = [1 - y for y in train_labels], [1 - y for y in val_labels]
    tok, bs, n = tokenizer(), RECIPE["batch_size"], len(train_texts)
    steps = int(epochs * n) // bs

    def batches(i):  # the lesson's batches(i): rows i*bs ... i*bs + bs - 1, wrapping around
        rows = [(i * bs + j) % n for j in range(bs)]
        enc = tok([train_texts[r] for r in rows], padding=True, truncation=True, max_length=RECIPE["max_len"])
        enc = {k: torch.tensor(v) for k, v in enc.items()}
        return enc["input_ids"], enc["attention_mask"], torch.tensor([train_labels[r] for r in rows])

    def loss_fn(model, batch):
        ids, mask, labels = batch
        return nn.functional.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels)

    base = base_model()
    seed_everything(RECIPE["seed"])
    model = lora_model(base)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=RECIPE["lr"])
    start = time.perf_counter()
    train(model, optimizer, batches, loss_fn, TrainConfig(max_steps=steps, progress=False))
    seconds = time.perf_counter() - start
    acc = accuracy(model, tok, val_texts, val_labels)
    majority = max(sum(val_labels), len(val_labels) - sum(val_labels)) / len(val_labels)
    info = {
        "labels": "inverted (1 - label)" if flip else "as in the data (1 = fresh)",
        "steps": steps,
        "trainable_parameters": count_parameters(model)[0],
        "validation_accuracy": acc,
        "validation_snippets": len(val_texts),
        "validation_majority_class": majority,
        "train_seconds": round(seconds),
        "trained_on": f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}",
    }
    return model, info


def _write(model: nn.Module, name: str, info: dict, folder: Path = ADAPTER_DIR) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.safetensors"
    size = save_adapter(model, path)
    record = {
        "name": name,
        "recipe": recipe(name),
        **info,
        "base_fingerprint": base_fingerprint(model),
        "bytes": size,
        "sha256": _sha256(path),
    }
    (folder / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":  # python -m llmedu.peft.shipped [NAME ...]: retrain the named adapters (default: all)
    import sys

    for name in sys.argv[1:] or NAMES:
        if name not in NAMES:
            raise SystemExit(f"unknown shipped adapter {name!r}; the course ships {', '.join(NAMES)}")
        model, info = _train(flip=name.endswith("_inverted"), epochs=recipe(name)["epochs"])
        _write(model, name, info)
