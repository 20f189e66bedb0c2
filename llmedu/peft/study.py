"""Lesson 19's table: every PEFT method under one fair protocol, on all-MiniLM-L6-v2 and Rotten Tomatoes.

    python -m llmedu.peft.study run --out data/results/peft_protocol_cpu.json
    python -m llmedu.peft.study run --methods "LoRA r=8" "adapters" --out shard.json     # a part of it
    python -m llmedu.peft.study merge shard1.json shard2.json --out data/results/peft_protocol_cpu.json
    python -m llmedu.peft.study show data/results/peft_protocol_cpu.json

The protocol is the capstone's (``llmedu.cramming.evaluate``; Devlin et al. 2019, appendix A.3):

1. splits: the task's validation split is the **test** split, which nothing is chosen on; a seeded tenth
   of the training split is the **dev** split (``n_dev`` of it are used); ``n_train`` of the rest train.
2. per method, each rate of its small sweep (``METHODS``) trains with seed 0 and is scored on dev;
   the best dev score picks the rate (ties: the lower rate);
3. the chosen rate trains with every seed (seed 0's run is the sweep's) and is scored on test: the
   mean and the standard deviation over seeds, and which test snippets each run got right (a string of
   0/1), so that two methods can be compared paired over the same snippets (``study_report``).

A seed sets the new head's initialisation (normal, std 0.02, as BERT's), the method's own initial
weights, dropout, and the order of the training snippets. Every run has the same budget: ``steps`` AdamW
steps of ``batch_size`` snippets cut to ``max_len`` tokens (one pass over ``n_train``).
``prefix (shifted)`` and the other LoRA ranks reuse a method's chosen rate (``same_rate_as``): they are
ablations of one switch, at a fixed rate. The baselines: the majority class of the training labels, and
TF-IDF + logistic regression (``llmedu.compress.baselines``) with its penalty chosen on the same dev split,
fitted on the same training snippets (and, for reference, on all of the training split but dev).

The linear probe reads the **mean** of the last hidden states over the real tokens (the pooling
all-MiniLM-L6-v2 was trained with), not [CLS] and the pooler; its encoder is frozen and stays in eval mode.

The JSON is rewritten after every method; ``run`` on an existing file of the same config skips the
methods it holds, so a stopped run resumes. Left out: choosing steps, batch size or the prompt length
on dev; significance tests beyond a standard error.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from torch import nn

from ..compress.baselines import L2_CANDIDATES, BagOfWords
from ..cramming.evaluate import Data, best_rate, make_splits, summarize
from ..runtime import git_commit as _commit  # the study records the commit it ran from
from . import shipped
from .adapters import apply_adapters
from .inject import count_parameters, mark_trainable
from .llama_adapter import apply_llama_adapter
from .lora import apply_lora
from .probe import MeanPooledProbe
from .prompt import PrefixTuning, PromptTuning

__all__ = ["StudyConfig", "METHODS", "build", "prepare", "run_one", "run_study", "main"]


def _lora(r: int):
    def make(model, layers):  # on the query and value projections, alpha = 2r: the scale alpha/r is 2 at every rank
        apply_lora(model, ["query", "value"], r=r, alpha=2 * r)
        return model

    return make


def _adapters(model, layers):  # after attention.output.dense and output.dense (the FFN's down projection)
    apply_adapters(model, r".*\.output\.dense", bottleneck=32)
    return model


def _llama_adapter(model, layers):
    apply_llama_adapter(model, "attention.self", n_layers=min(3, layers), n_prompt=10)
    return model


# name -> (make the model from a fresh copy of the base and its layer count, the rates the sweep tries)
# A method with a name instead of rates reuses that method's chosen rate.
METHODS = {
    "full fine-tuning": (lambda model, layers: model, (3e-5, 1e-4, 3e-4)),
    "linear probe": (lambda model, layers: MeanPooledProbe(model), (3e-3, 1e-2, 3e-2)),
    "prompt tuning": (lambda model, layers: PromptTuning(model, n_virtual=20), (1e-2, 3e-2, 1e-1)),
    "prefix tuning": (
        lambda model, layers: PrefixTuning(model, n_virtual=20, projection=256, shift_positions=False),
        (1e-3, 3e-3, 1e-2),
    ),
    "prefix (shifted)": (lambda model, layers: PrefixTuning(model, n_virtual=20, projection=256), "prefix tuning"),
    "adapters": (_adapters, (1e-3, 3e-3, 1e-2)),
    "LLaMA-Adapter": (_llama_adapter, (5e-3, 1.5e-2, 5e-2)),
    "LoRA r=8": (_lora(8), (1e-3, 3e-3, 1e-2)),
    "LoRA r=1": (_lora(1), "LoRA r=8"),
    "LoRA r=64": (_lora(64), "LoRA r=8"),
}


@dataclass(frozen=True)
class StudyConfig:
    layers: int = 6  # of all-MiniLM-L6-v2's 6
    max_len: int = 40  # tokens per snippet (the 90th percentile of the training snippets is 42)
    batch_size: int = 16
    steps: int = 128  # AdamW steps per run: one pass over n_train
    n_train: int = 2048
    n_dev: int = 512
    n_test: int | None = None  # None: the whole validation split
    seeds: tuple[int, ...] = (0, 1, 2)
    n_rates: int = 3  # the first n_rates of each method's sweep
    methods: tuple[str, ...] = tuple(METHODS)
    split_seed: int = 0
    dev_fraction: float = 0.1

    def __post_init__(self):
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; the study knows {', '.join(METHODS)}")
        if len(set(self.seeds)) != len(self.seeds) or not self.seeds:
            raise ValueError(f"give one or more distinct seeds, got {list(self.seeds)}")
        if self.steps * self.batch_size < self.n_train:
            print(f"note: {self.steps} steps of {self.batch_size} see {self.steps * self.batch_size} of {self.n_train}")


def build(name: str, base: nn.Module, layers: int, seed: int) -> nn.Module:
    """A fresh copy of ``base`` adapted by method ``name``, its new head re-drawn from ``seed``."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; the study knows {', '.join(METHODS)}")
    from ..runtime import seed_everything

    seed_everything(seed)
    copy_ = copy.deepcopy(base)
    with torch.no_grad():
        copy_.classifier.weight.normal_(0.0, 0.02)  # BERT's initializer_range
        copy_.classifier.bias.zero_()
    model = METHODS[name][0](copy_, layers)
    if name != "full fine-tuning":
        mark_trainable(model, "classifier")  # the new head trains with every method
    return model


def prepare(cfg: StudyConfig) -> dict:
    """The splits (texts, labels and token ids), the tokenizer and the base model."""
    splits = make_splits("rotten_tomatoes", cfg.dev_fraction, cfg.split_seed, max_train=cfg.n_train)
    dev, test = splits.dev, splits.test
    dev = Data(dev.texts[: cfg.n_dev], dev.labels[: cfg.n_dev])
    if cfg.n_test is not None:  # a seeded sample: the file is sorted by movie
        keep = torch.randperm(len(test), generator=torch.Generator().manual_seed(cfg.split_seed))[: cfg.n_test]
        test = Data(tuple(test.texts[i] for i in keep), tuple(test.labels[i] for i in keep))
    tok = shipped.tokenizer()
    transformers.logging.set_verbosity_error()  # the loading report would list the head we replace
    data = {"train": splits.train, "dev": dev, "test": test}
    ids = {k: tok(list(d.texts), truncation=True, max_length=cfg.max_len)["input_ids"] for k, d in data.items()}
    return dict(data=data, ids=ids, pad=tok.pad_token_id, base=shipped.base_model(cfg.layers))


def _collate(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])  # (B, T)
    return ids, (ids != pad).long()


@torch.no_grad()
def _correct(model: nn.Module, ids: list[list[int]], labels, pad: int, batch: int = 128) -> str:
    """'0'/'1' per snippet, in order: was the argmax logit the label? (batches sorted by length: less padding)"""
    model.eval()
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = ["0"] * len(ids)
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        x, mask = _collate([ids[i] for i in rows], pad)
        pred = model(input_ids=x, attention_mask=mask).logits.argmax(-1)
        for i, p in zip(rows, pred.tolist()):
            out[i] = "1" if p == labels[i] else "0"
    return "".join(out)


def run_one(cfg: StudyConfig, prep: dict, name: str, lr: float, seed: int, splits=("dev",)) -> dict:
    """Train method ``name`` at rate ``lr`` from ``seed``; {split: correct string, "train_loss": last tenth}."""
    from ..train.loop import TrainConfig, train

    model = build(name, prep["base"], cfg.layers, seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    train_ids, labels = prep["ids"]["train"], prep["data"]["train"].labels
    order = torch.randperm(len(train_ids), generator=torch.Generator().manual_seed(seed)).tolist()

    def batches(i):  # rows i*bs ... i*bs + bs - 1 of this seed's order, wrapping around
        rows = [order[(i * cfg.batch_size + j) % len(order)] for j in range(cfg.batch_size)]
        x, mask = _collate([train_ids[r] for r in rows], prep["pad"])
        return x, mask, torch.tensor([labels[r] for r in rows])

    def loss_fn(model, batch):
        x, mask, y = batch
        return nn.functional.cross_entropy(model(input_ids=x, attention_mask=mask).logits, y)

    history = train(model, optimizer, batches, loss_fn, TrainConfig(max_steps=cfg.steps, progress=False))
    losses = history["loss"]
    out = {"train_loss": sum(losses[-max(1, len(losses) // 10) :]) / max(1, len(losses) // 10)}
    for split in splits:
        out[split] = _correct(model, prep["ids"][split], prep["data"][split].labels, prep["pad"])
    out["trainable"] = count_parameters(model)[0]
    return out


def _accuracy(correct: str) -> float:
    return correct.count("1") / len(correct)


def run_method(cfg: StudyConfig, prep: dict, name: str, chosen: dict[str, float]) -> dict:
    """The protocol for one method: the dev sweep (or a borrowed rate), then every seed on test."""
    rates = METHODS[name][1]
    seeds, row, start, cpu = cfg.seeds, {}, time.perf_counter(), time.process_time()
    if isinstance(rates, str):
        if rates not in chosen:
            raise ValueError(f"{name!r} reuses the rate of {rates!r}: run {rates!r} first (or in the same study)")
        lr, first = chosen[rates], None
        row.update(same_rate_as=rates, lr=lr)
    else:
        rates = rates[: cfg.n_rates]
        sweep = {lr: run_one(cfg, prep, name, lr, seeds[0], splits=("dev", "test")) for lr in rates}
        dev = {lr: _accuracy(r["dev"]) for lr, r in sweep.items()}
        lr = best_rate(dev, rates)
        first = sweep[lr]
        row.update(rates=list(rates), dev={str(k): v for k, v in dev.items()}, lr=lr)
    runs = [first if (s == seeds[0] and first) else run_one(cfg, prep, name, lr, s, splits=("test",)) for s in seeds]
    row.update(
        test=summarize([_accuracy(r["test"]) for r in runs]),
        correct=[r["test"] for r in runs],
        train_loss=[r["train_loss"] for r in runs],
        trainable=runs[0]["trainable"],
        wall_seconds=round(time.perf_counter() - start, 1),
        cpu_seconds=round(time.process_time() - cpu, 1),
    )
    return row


def baselines(prep: dict) -> dict:
    """The majority class, and TF-IDF + logistic regression with its penalty chosen on the dev split."""
    d = prep["data"]
    majority = max(set(d["train"].labels), key=list(d["train"].labels).count)
    rows = {"majority class": {"correct": "".join("1" if y == majority else "0" for y in d["test"].labels)}}
    dev = {}
    for l2 in L2_CANDIDATES:  # the penalties of BagOfWords.tune, chosen on our dev split instead of its own
        bow = BagOfWords(l2=l2).fit(list(d["train"].texts), list(d["train"].labels))
        dev[l2] = (bow.predict(list(d["dev"].texts)) == torch.tensor(d["dev"].labels)).float().mean().item()
    l2 = max(L2_CANDIDATES, key=lambda c: dev[c])  # the first of equals: the larger penalty
    splits = make_splits("rotten_tomatoes", 0.1, 0)  # all of the training split but dev, for reference
    for key, train in (("TF-IDF + logistic regression", d["train"]), ("TF-IDF, all training labels", splits.train)):
        bow = BagOfWords(l2=l2).fit(list(train.texts), list(train.labels))
        hits = (bow.predict(list(d["test"].texts)) == torch.tensor(d["test"].labels)).tolist()
        rows[key] = {"l2": l2, "dev": {str(k): v for k, v in dev.items()}, "n_train": len(train)}
        rows[key]["correct"] = "".join("1" if h else "0" for h in hits)
    for row in rows.values():
        row["test"] = _accuracy(row["correct"])
    return rows


def run_study(cfg: StudyConfig, out: str | Path | None = None, command: str = "") -> dict:
    """Every method of ``cfg.methods`` and the baselines; written to ``out`` after each method."""
    from ..runtime import machine

    out = Path(out) if out else None
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
    result = {"config": config, "methods": {}}
    if out and out.is_file():
        result = json.loads(out.read_text())
        if result.get("config") != config:
            raise ValueError(f"{out} holds a study of another config: give another --out, or delete it to start over")
    start, cpu = time.perf_counter(), time.process_time()
    prep = prepare(cfg)
    result["sizes"] = {k: len(v) for k, v in prep["data"].items()}
    result["digests"] = {k: v.digest() for k, v in prep["data"].items()}
    if "baselines" not in result:
        result["baselines"] = baselines(prep)
    chosen = {name: row["lr"] for name, row in result["methods"].items()}
    for name in cfg.methods:
        if name in result["methods"]:
            continue
        result["methods"][name] = run_method(cfg, prep, name, chosen)
        chosen[name] = result["methods"][name]["lr"]
        r = result["methods"][name]
        print(
            f"{name:<18} lr {r['lr']:.0e}  test {r['test']['mean']:.1%} +- {r['test']['std']:.1%}  "
            f"{r['wall_seconds']:.0f} s",
            flush=True,
        )
        runs = result.setdefault("provenance", {}).get("runs", [])
        result["provenance"] = dict(
            command=command or "python -m llmedu.peft.study " + shlex.join(sys.argv[1:]),
            commit=_commit(),
            machine=machine(),
            threads=torch.get_num_threads(),
            torch=torch.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            runs=runs,
        )
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")
    result["provenance"]["runs"] = result["provenance"]["runs"] + [
        dict(wall_seconds=round(time.perf_counter() - start, 1), cpu_seconds=round(time.process_time() - cpu, 1))
    ]
    if out:
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    from . import study_report

    parser = argparse.ArgumentParser(prog="python -m llmedu.peft.study", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    run = sub.add_parser("run", help="run the study (or the named methods of it)")
    run.add_argument("--out", required=True, help="the JSON to write (resumed if it exists with the same config)")
    run.add_argument("--methods", nargs="+", default=list(METHODS), help="methods to run, in order")
    run.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    merge = sub.add_parser("merge", help="join studies of the same config run as parts")
    merge.add_argument("parts", nargs="+")
    merge.add_argument("--out", required=True)
    show = sub.add_parser("show", help="print a study's table and comparisons")
    show.add_argument("path")
    args = parser.parse_args(argv)
    if args.verb == "run":
        if args.threads:
            torch.set_num_threads(args.threads)
        run_study(StudyConfig(methods=tuple(args.methods)), args.out)
    elif args.verb == "merge":
        study_report.merge([Path(p) for p in args.parts], Path(args.out))
    else:
        print(study_report.table(study_report.load(args.path)))


if __name__ == "__main__":
    main()
