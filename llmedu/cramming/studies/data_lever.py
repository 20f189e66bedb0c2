"""The data lever: Cramming's dataset optimisations at course scale (Geiping & Goldstein 2022, sec. 4.4).

    results = run_data_lever(out="data/results/cramming_data_lever_cpu.json")   # 4 rows x 3 seeds
Having found that architecture changes hit the scaling law's wall, the paper turns to "better tokens" (sec. 4.4):

* **deduplication** (exact substrings, Lee et al. 2022): "not to help in downstream performance in our case";
* **filtering** with the tokenizer itself: drop every entry whose number of tokens is larger than t times its
  number of characters ("e.g. t = 0.3"): text the tokenizer compresses badly (HTML, markdown) goes;
* **sorting** the tokenized sequences by their average unigram token prevalence, "so that likely sequences occur
  first", which "can be strengthened slightly by drawing from a larger corpus, as the unlikely sequences never
  get reached". The released code also orders by other keys (its final C4 config counts full stops); we follow
  the text. The key is the prevalence of a row's tokens, not its compression rate.

Each row of the table adds one treatment to the row before, on the training text only:

    baseline            the text as ``prepare_data`` reads it
    dedup               ``data.deduplicate`` (exact documents and repeated lines, over all corpora together)
    dedup+filter        less the documents of highest tokens/characters: a threshold t chosen so that
                        ``drop_share`` of the characters go (``threshold_for_share``); dropped: rate >= t
    dedup+filter+sort   the same rows, read from the most prevalent down (no shuffle), as the paper's
                        single pass does: rows a run does not reach are never read

Fair comparison. Every run trains the same model for the SAME NUMBER OF OPTIMIZER STEPS, so every row reads the
same tokens and spends the same FLOPs; not the same seconds, which a shared machine's load would decide. The
learning rate and the batch ramp follow the steps (``BudgetClock`` without seconds). The default text (600,000
characters of each corpus) holds more rows than 400 steps read in every row, as the paper prepares "enough tokens
for our single pass": no run reads a row twice, and the sorted run never reaches its least prevalent rows. One
WordPiece tokenizer, learnt from the baseline text (the first ``tokenizer_chars`` of each corpus), serves every
row, so the losses are in the same units; its 1024 pieces (the tiny shape) cut text finer than the paper's 32768,
so the paper's t = 0.3 would drop most of ours: t is set by the share it drops. Every run is scored on the SAME
held-out rows: the validation split of every corpus, neither deduplicated nor filtered, less any document or long
line that the baseline's training text holds (``remove_seen``); each treatment only removes training text, so
no row is scored on text it trained on. The seed draws the initial weights, the masks and (unsorted rows) the
order; the held-out masks are fixed (``EVAL_SEED``). Seed s starts every row from the same weights, so a row's gap
to the baseline is paired by seed (``final.paired``): the mean of the per-seed differences, error s_d / sqrt(n).

Left out: near-duplicate and substring deduplication (Lee et al.'s suffix arrays), swapping the data source
(the paper's other pathway), the end-of-training batch increase, downstream tasks (the held-out MLM loss only).
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ... import runtime
from ...data.packing import MLMBatches, mask_tokens, pack, read_documents, train_tokenizer
from ...models import MaskedLM
from ...train import TrainConfig, train
from ..data import CORPORA, MIN_LINE_CHARS, deduplicate, held_out_chars
from ..evaluate import summarize
from ..pretrain import _adamw, evaluate_mlm, mlm_loss_fn
from ..recipe import TINY_SHAPE, BudgetClock, budget_accumulation, budget_schedule, crammed
from .budget_runs import study_results, write_results
from .final import paired

__all__ = ["TREATMENTS", "compression_rates", "threshold_for_share", "filter_by_compression", "prevalence_scores"]
__all__ += ["prevalence_order", "remove_seen", "InOrderBatches", "check_settings", "run_data_lever"]

TREATMENTS = ("baseline", "dedup", "dedup+filter", "dedup+filter+sort")
SHAPES = {"tiny": TINY_SHAPE, "cpu": {}}
EVAL_SEED = 12345  # the held-out masks and row order: the same for every run


# -- the three treatments, on documents and rows ---------------------------------------------------
def compression_rates(ids: Sequence[Sequence[int]], documents: Sequence[str]) -> np.ndarray:
    """Tokens per character of each document (its ordinary tokens, no [CLS]/[SEP]): high = compresses badly."""
    return np.array([len(i) / max(len(d), 1) for i, d in zip(ids, documents, strict=True)])


def threshold_for_share(rates: np.ndarray, chars: np.ndarray, share: float) -> float:
    """The lowest rate t such that the documents with rate >= t hold at least ``share`` of the characters."""
    if not 0 < share < 1:
        raise ValueError(f"the share of characters to drop must be in (0, 1), got {share}")
    order = np.argsort(-rates, kind="stable")  # worst compressed first
    dropped = np.cumsum(chars[order]) / chars.sum()
    return float(rates[order][np.searchsorted(dropped, share)])


def filter_by_compression(rates: np.ndarray, threshold: float) -> list[int]:
    """Indices of the documents kept: rate < threshold (the authors' ``len(tokens) < t * len(text)``)."""
    return [i for i, rate in enumerate(rates) if rate < threshold]


def prevalence_scores(rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(n_rows,) mean log2 unigram probability of each row's tokens, the unigram counted over all ``rows`` with
    add-one smoothing (the authors' ``_sort_tokenized_dataset_by_unigram``): high = made of common tokens."""
    counts = torch.bincount(rows.flatten(), minlength=vocab_size).double()  # (vocab,)
    log2p = torch.log2((counts + 1) / (counts.sum() + vocab_size))  # (vocab,)
    return log2p[rows].mean(dim=1)  # (n_rows,)


def prevalence_order(rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(n_rows,) indices of ``rows`` from the most prevalent (likely) to the least; ties keep their order."""
    return torch.argsort(prevalence_scores(rows, vocab_size), descending=True, stable=True)


def remove_seen(documents: Sequence[str], seen: Sequence[str], min_line_chars: int = MIN_LINE_CHARS):
    """(documents, counts): ``documents`` less each one equal to a ``seen`` document (white space squeezed) and
    each line of at least ``min_line_chars`` (stripped) that a ``seen`` document holds. Repeats within
    ``documents`` stay: they are not text the model trained on. A document left empty is dropped."""
    seen_docs = {" ".join(d.split()) for d in seen}
    seen_lines = {s for d in seen for line in d.splitlines() if len(s := line.strip()) >= min_line_chars}
    kept, counts = [], Counter(documents=len(documents), chars_before=sum(map(len, documents)))
    for doc in documents:
        if " ".join(doc.split()) in seen_docs:
            counts["seen_documents"] += 1
            continue
        lines = [x for x in doc.splitlines() if len(x.strip()) < min_line_chars or x.strip() not in seen_lines]
        counts["seen_lines"] += len(doc.splitlines()) - len(lines)
        if any(line.strip() for line in lines):
            kept.append("\n".join(lines))
    counts["chars_after"] = sum(map(len, kept))
    return kept, {"seen_documents": 0, "seen_lines": 0, **counts}


class InOrderBatches(MLMBatches):
    """``MLMBatches`` that read the rows in their given order, the same every epoch (a curriculum), and mask
    them exactly as ``MLMBatches`` does for the same seed and index."""

    def __call__(self, i: int) -> dict[str, torch.Tensor]:
        start = (i % self.per_epoch) * self.batch_size
        ids = self.rows[start : start + self.batch_size]  # (B, T)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * i + 1)
        mask_id, vocab_size = self.tokenizer.vocab["[MASK]"], self.tokenizer.vocab_size
        inputs, labels = mask_tokens(ids, self.rate, mask_id, vocab_size, self.special_ids, g, self.mask, self.random)
        return {"input_ids": inputs, "labels": labels}


# -- the text of each row ----------------------------------------------------------------------------
def _deduplicated(by_corpus: dict[str, list[str]]) -> tuple[dict[str, list[str]], dict]:
    """``deduplicate`` over all corpora together, kept by corpus: each corpus against every earlier one."""
    kept, counts, earlier = {}, Counter(), []
    for name, docs in by_corpus.items():
        kept[name], c = deduplicate(docs, against=earlier)
        counts.update(c)
        earlier += docs
    return kept, dict(counts)


def _packed(by_corpus: dict[str, list[str]], encode, seq_len: int, tokenizer) -> tuple[torch.Tensor, dict, list]:
    """(rows, figures, corpus of each row): the documents packed as ``pack`` does, with how many documents,
    characters, tokens and rows they hold (a row counts for the corpus of its middle token)."""
    docs = [d for ds in by_corpus.values() for d in ds]
    names = [n for n, ds in by_corpus.items() for _ in ds]
    ids = [encode(d) for d in docs]
    rows = pack(ids, seq_len, tokenizer.vocab["[CLS]"], tokenizer.vocab["[SEP]"])  # (n_rows, seq_len)
    ends = np.cumsum([len(i) + 1 for i in ids])  # stream position after each document's [SEP]
    middles = np.arange(len(rows)) * (seq_len - 1) + (seq_len - 1) // 2
    row_names = [names[j] for j in np.searchsorted(ends, middles, side="right")]
    figures = {"documents": len(docs), "chars": sum(map(len, docs)), "tokens": sum(map(len, ids)), "rows": len(rows)}
    return rows, figures | {"rows_by_corpus": dict(Counter(row_names))}, row_names


def _treated_rows(train_docs: dict, tokenizer, seq_len: int, drop_share: float, say) -> tuple[dict, dict]:
    """{treatment: (rows, figures, corpus of each row)} and the filter's record, all from the baseline's documents."""
    cache = {}

    def encode(doc: str) -> np.ndarray:  # a document that deduplication left whole is encoded once
        if doc not in cache:
            cache[doc] = np.array(tokenizer.encode(doc, add_special_tokens=False), dtype=np.int32)
        return cache[doc]

    out = {"baseline": _packed(train_docs, encode, seq_len, tokenizer)}
    deduped, removed = _deduplicated(train_docs)
    out["dedup"] = _packed(deduped, encode, seq_len, tokenizer)
    out["dedup"][1]["removed"] = removed
    share = 1 - removed["chars_after"] / removed["chars_before"]
    say(f"  dedup: {removed['duplicate_documents']} documents, {removed['repeated_lines']} lines ({share:.2%})")

    docs = [d for ds in deduped.values() for d in ds]
    names = [n for n, ds in deduped.items() for _ in ds]
    rates = compression_rates([encode(d) for d in docs], docs)
    chars = np.array([len(d) for d in docs])
    threshold = threshold_for_share(rates, chars, drop_share)
    keep = set(filter_by_compression(rates, threshold))
    dropped = Counter(dict.fromkeys(deduped, 0))
    for i in set(range(len(docs))) - keep:
        dropped[names[i]] += len(docs[i])
    record = {
        "threshold": round(threshold, 4),
        "target_share": drop_share,
        "dropped_char_share": round(float(sum(dropped.values()) / chars.sum()), 4),
        "dropped_documents": len(docs) - len(keep),
        "dropped_chars_by_corpus": dict(dropped),
        "mean_rate_by_corpus": {n: round(float(rates[[m == n for m in names]].mean()), 4) for n in deduped},
    }
    say(f"  filter: t = {threshold:.4f} tokens per character drops {record['dropped_char_share']:.2%} of the "
        f"characters, {record['dropped_documents']} documents (by corpus: {dict(dropped)})")  # fmt: skip
    filtered = {n: [d for i, d in enumerate(docs) if i in keep and names[i] == n] for n in deduped}
    out["dedup+filter"] = rows, figures, row_names = _packed(filtered, encode, seq_len, tokenizer)
    order = prevalence_order(rows, tokenizer.vocab_size)
    out["dedup+filter+sort"] = (rows[order], dict(figures), [row_names[j] for j in order])
    return out, record


def _held_out(corpora, max_chars, train_docs: dict, tokenizer, seq_len: int) -> tuple[torch.Tensor, dict]:
    """The rows every run is scored on: the validation split less what the baseline's training text holds."""
    docs = read_documents(corpora, "validation", held_out_chars(max_chars, seq_len))
    docs, counts = remove_seen(docs, [d for ds in train_docs.values() for d in ds])
    ids = [tokenizer.encode(d, add_special_tokens=False) for d in docs]
    return pack(ids, seq_len, tokenizer.vocab["[CLS]"], tokenizer.vocab["[SEP]"]), counts


# -- one run, and the study ------------------------------------------------------------------------
def train_run(recipe, batches, steps: int, seed: int, score, evals: int, device) -> dict:
    """A fresh model (seeded) trained on ``batches`` for ``steps`` optimizer steps, with the recipe's schedule,
    batch ramp and clipping over the steps (``pretrain``'s step, without its run folder); ``score(model,
    precision)``, the held-out loss, at ``evals`` evenly spaced steps, the last one at the end."""
    runtime.seed_everything(seed)
    model = MaskedLM(recipe.model).to(device)
    clock = BudgetClock(None, steps)  # the budget is the steps: the same schedule on any machine
    precision = recipe.resolved_precision(device)
    ramp = dict(accumulation=budget_accumulation(recipe, clock), schedule=budget_schedule(recipe, clock))
    config = TrainConfig(
        max_steps=steps, precision=precision, clip_grad_norm=recipe.clip_grad_norm, progress=False, **ramp
    )
    at, history = {round(steps * k / evals) for k in range(1, evals + 1)}, []

    def held_out(info) -> None:
        if info.step in at:
            history.append({"step": info.step, "val_loss": round(score(model, precision), 4)})

    on_device = lambda i: {k: v.to(device) for k, v in batches(i).items()}  # noqa: E731
    start, loss_fn = time.perf_counter(), mlm_loss_fn(recipe.sparse_prediction)
    done = train(model, _adamw(model, recipe), on_device, loss_fn, config, callbacks=[clock.tick, held_out]).steps
    return {
        "val_loss": history[-1]["val_loss"],
        "val_history": history,
        "train_tokens": sum(s.tokens for s in done),
        "train_loss_last_10": round(float(np.mean([s.loss for s in done[-10:]])), 4),
        "wall_seconds": round(time.perf_counter() - start, 1),
    }


def gap(row: dict, baseline: dict) -> dict:
    """The row's held-out loss minus the baseline's, paired by seed (seed s starts both from the same weights)."""
    losses = [{r["seed"]: r["val_loss"] for r in x["runs"]} for x in (row, baseline)]
    g = paired(*losses)
    return {"diff": round(g["diff"], 4), "se": round(g["se"], 4), "t": round(g["t"], 2), "n": g["n"]}


def _git() -> dict:
    """The commit the study ran from, and whether the library had uncommitted changes then."""
    here = Path(__file__).resolve().parents[2]  # llmedu/
    run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=here).stdout.strip()  # noqa: E731
    try:
        return {"git_commit": run("rev-parse", "HEAD") or None, "library_changed": bool(run("status", "-s", "."))}
    except OSError:  # no git
        return {"git_commit": None, "library_changed": None}


def _config(recipe, tokenizer, **settings) -> dict:
    keys = ("d_model", "n_layers", "n_heads", "vocab_size", "max_seq_len", "micro_batch", "accumulation", "lr")
    return {
        "comparison": "equal optimizer steps: the same tokens and, with the same model, the same FLOPs in every "
        "row; not equal seconds, which the load of a shared machine would decide",
        **settings,
        "recipe": {k: v for k, v in recipe.settings().items() if k in keys + ("schedule", "batch_ramp")},
        "tokenizer": f"one WordPiece vocabulary of {tokenizer.vocab_size} for every row, learnt from the baseline "
        f"text (the first {settings['tokenizer_chars']} characters of each corpus's train split)",
        "held_out": "the validation split of every corpus, neither deduplicated nor filtered, less the documents "
        "and lines that the baseline's training text holds (every treatment trains on a part of that text)",
    }


def check_settings(shape: str, steps: int, seeds: Sequence[int], drop_share: float, evals: int) -> None:
    """A clear error for a setting no study could use, before any text is read."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    if not isinstance(steps, int) or not isinstance(evals, int) or not 1 <= evals <= steps:
        raise ValueError(f"need whole numbers with 1 <= evals <= steps, got steps={steps!r}, evals={evals!r}")
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise ValueError(f"give at least two different seeds (a spread needs two), got {list(seeds)}")
    if not 0 < drop_share < 1:
        raise ValueError(f"the share of characters the filter drops must be in (0, 1), got {drop_share}")


def run_data_lever(
    out=None,
    *,
    shape: str = "tiny",
    steps: int = 400,
    seeds: Sequence[int] = (0, 1, 2),
    drop_share: float = 0.1,
    max_chars: int | None = 600_000,
    corpora: Sequence[str] = CORPORA,
    tokenizer_chars: int = 400_000,
    evals: int = 4,
    eval_batch: int = 64,
    device=None,
    command: str | None = None,
    stream=None,
) -> dict:
    """Every treatment with every seed, ``steps`` optimizer steps each; ``out`` (JSON) rewritten after every run.
    A line per run goes to ``stream`` (default stderr)."""
    say = lambda *a: print(*a, file=stream or sys.stderr, flush=True)  # noqa: E731
    check_settings(shape, steps, seeds, drop_share, evals)
    recipe, device = crammed(**SHAPES[shape]), device or runtime.device()
    start, prep, seq_len = datetime.datetime.now(datetime.timezone.utc), time.perf_counter(), recipe.model.max_seq_len
    say("Preparing the text of every row (no run is timed); one tokenizer, learnt from the baseline text")
    tokenizer = train_tokenizer(corpora, recipe.model.vocab_size, sample_chars=tokenizer_chars)
    train_docs = {name: read_documents([name], "train", max_chars) for name in corpora}
    rows, filter_record = _treated_rows(train_docs, tokenizer, seq_len, drop_share, say)
    say(f"  rows of {seq_len} tokens: { ({name: figures['rows'] for name, (_, figures, _) in rows.items()}) }")
    val_rows, seen = _held_out(corpora, max_chars, train_docs, tokenizer, seq_len)
    masking = dict(rate=recipe.mask_rate, mask=recipe.mask_fraction, random=recipe.random_fraction)
    val = MLMBatches(val_rows, min(eval_batch, len(val_rows)), tokenizer, seed=EVAL_SEED, **masking)
    score = lambda model, precision: evaluate_mlm(model, val, val.per_epoch, precision, device)  # noqa: E731
    scored = val.per_epoch * val.batch_size
    say(f"  held out: {scored} of {len(val_rows)} rows scored by every run; {seen['seen_documents']} documents "
        f"and {seen['seen_lines']} lines that the training text holds left out")  # fmt: skip

    settings = dict(shape=shape, steps=steps, seeds=list(seeds), drop_share=drop_share, max_chars=max_chars)
    settings |= dict(corpora=list(corpora), tokenizer_chars=tokenizer_chars, evals=evals, eval_seed=EVAL_SEED)
    config = _config(recipe, tokenizer, **settings)
    results = study_results(command or "run_data_lever (from Python)", device, start, config)
    del results["runs"]
    results["provenance"] |= _git() | {"data_seconds": round(time.perf_counter() - prep, 1)}
    results |= {"held_out": seen | {"rows": len(val_rows), "rows_scored": scored}, "filter": filter_record}
    results["rows"] = {name: {**figures, "losses": [], "runs": []} for name, (_, figures, _) in rows.items()}
    for seed in seeds:  # seed after seed: a stopped study holds every row, with fewer seeds
        for name, (treated, _, row_names) in rows.items():
            batches = (InOrderBatches if name.endswith("sort") else MLMBatches)(
                treated, recipe.micro_batch, tokenizer, seed=seed, **masking
            )
            run = train_run(recipe, batches, steps, seed, score, evals, device)
            record, read = results["rows"][name], run["train_tokens"] // seq_len  # rows read
            record["runs"].append({"seed": seed, **run})
            record["losses"].append(run["val_loss"])
            summary = summarize(record["losses"])
            record |= {"mean": round(summary["mean"], 4), "std": round(summary["std"], 4), "n": len(record["losses"])}
            record["passes"] = round(read / len(treated), 3)
            if name.endswith("sort"):  # which rows a sorted run reaches
                record["read_by_corpus"] = dict(Counter(row_names[:read]))
            if record["n"] > 1 and name != "baseline":  # the baseline ran first with this seed
                record["vs_baseline"] = gap(record, results["rows"]["baseline"])
            write_results(out, results, start)
            tokens, seconds = f"{run['train_tokens']:,} tokens", f"{run['wall_seconds']:.0f} s"
            say(f"[seed {seed}] {name:<18} held-out loss {run['val_loss']:.4f} after {steps} steps ({tokens}, "
                f"{record['passes']:.2f} passes; {seconds})")  # fmt: skip
    return results
