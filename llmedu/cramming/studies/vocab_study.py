"""Vocabulary size under one budget: the paper's tokenizer experiment at our scale (Geiping & Goldstein 2022, sec. 4.4).

    results = run_vocab_study(VOCAB_SIZES, parse_budget("3m"), out="data/results/cramming_vocab_cpu.json")
    print(vocab_table(results)); print(vocab_verdict(results)); plot_vocab(results)     # from vocab_report

Cramming learns WordPiece vocabularies of several sizes on the same data and finds the downstream score
rising with the vocabulary up to 32768, the size they keep. A larger vocabulary cuts the same text into fewer
tokens, so a row of 128 tokens holds more text and a budget of tokens reads more characters; but the
embedding (tied to the decoder) grows by d_model parameters per entry, which a small model pays in speed.

The study pretrains the crammed recipe (``crammed(**base)``; the CPU shape: d_model 128, 4 layers) at each
vocabulary size, each with its own WordPiece tokenizer learnt as ``pretrain`` learns it (``prepare_data``:
the first ``tokenizer_chars`` of each corpus), on the same text, under the same budget and seed, through the
machinery of ``budget_runs.py`` (speed probe, evaluation plan, ``pretrain``, record; one JSON rewritten
after every run). MLM losses over different vocabularies are not comparable (nats per masked *token*, and a
token is a different piece of text in each vocabulary), so each run also records what is:

* ``tokens_per_char``: ordinary tokens ([UNK] included; no [CLS] or [SEP]) per character of the held-out
  documents (every character of the raw text, spaces and punctuation included): the tokenizer's compression.
* ``nats_per_char`` = held-out MLM loss x tokens/char. Masked positions are drawn uniformly among the
  ordinary tokens, so a masked token covers the average token's characters, and this is the expected loss of
  the masked text per character. It is **not** the bits per character of a language model: each masked
  token is predicted with the other ~85% of the row in view, the other pieces of its own word included. In a
  small vocabulary a word is several pieces, and a masked piece is easy to guess from its neighbours, so
  nats/char favours small vocabularies: it measures the MLM task as posed, not how well the model knows the
  text (whole-word masking would; left out).
* ``unigram_cross_entropy``: the run's own unigram line (``study.unigram_line``, its tokenization), and
  ``below_unigram``, the loss's gap below it in nats per token: how far each model got beyond the
  frequencies of its own pieces.
* ``tokens_per_s``, ``chars_per_s`` (tokens/s over tokens/char) and ``passes`` over the training tokens.
* ``probe``: the frozen encoder's linear-probe accuracy (``encoders.probe_scorer``: mean-pooled last hidden
  states, multinomial logistic regression, fixed l2) on the capstone's tasks whose text no pretraining
  corpus holds (rotten_tomatoes and bbc_news with the default corpora; tweet_sentiment is the ``tweets``
  corpus), fit on each task's train split and scored on its **dev** split (``make_splits``, seed 0: a tenth
  of train). A vocabulary is chosen from these numbers, so the test split stays unseen. ``probe_control``:
  the same probe on random weights of the same shape and tokenizer, since a random embedding of whole words
  is already a bag of words: part of what a larger vocabulary gives a probe is the tokenizer's, not the
  pretraining's. Cost on 2 CPU cores at the CPU shape, both tasks, every training label: about 25 s per
  encoder, 50 s a run with the control (``probe=False`` skips both).

Default vocabularies (``VOCAB_SIZES``): 1024 to 16384, powers of two around the CPU recipe's 4096. At d_model
128 the embedding holds 131k parameters at 1024 and 2.1M at 16384, three times the blocks' 677k. The default
tokenizer sample (400k characters of each of 6 corpora: 2.4M characters, 23.5k distinct words) takes our
WordPiece trainer (every pair scanned at every merge, 15-20 ms a merge on 2 CPU cores) about 6 s at 1024,
2-3 minutes at 8192 and, at that rate, 4-6 minutes at 16384; packing the full text takes about 40 s more
per vocabulary. All of it is cached (``data.packing``), and none of it is on a run's clock.

Left out: the paper's 32768 and above (the trainer alone would take 8-11 minutes, and the sample holds fewer
distinct words than that), whole-word masking, other tokenizers (BPE, Unigram), seeds beyond one.
"""

from __future__ import annotations

import datetime
import functools
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ... import runtime
from ...data.packing import read_documents
from ...tokenizers.basic import basic_tokenize, normalize
from ...tokenizers.wordpiece import BERT_SPECIALS
from ..data import CORPORA, held_out_chars, prepare_data
from ..evaluate import TASKS, check_no_overlap, make_splits
from ..recipe import crammed
from .budget_runs import StudyBudget, plan_runs, pretrain_recorded, run_record, study_results, write_results
from .encoders import encoder_features, probe_scorer
from .scaling_grid import parameter_counts
from .scaling_report import budget_words
from .study import unigram_line

__all__ = ["VOCAB_SIZES", "minimum_vocab", "check_vocab_sizes", "probe_tasks", "count_tokens", "run_vocab_study"]

VOCAB_SIZES = (1024, 2048, 4096, 8192, 16384)
PROBE_DEV_FRACTION = 0.1  # make_splits' dev split, seed 0: the study's probes are scored on it


@functools.lru_cache(maxsize=8)
def minimum_vocab(corpora: tuple[str, ...], tokenizer_chars: int) -> int:
    """The smallest vocabulary WordPiece can learn from the tokenizer's sample: the special tokens plus every
    character of it, word-initial and ##-continuing (the alphabet of ``WordPieceTokenizer.train``)."""
    words = set(basic_tokenize(normalize("\n\n".join(read_documents(corpora, "train", tokenizer_chars)))))
    return len(BERT_SPECIALS) + len({w[0] for w in words} | {"##" + c for w in words for c in w[1:]})


def check_vocab_sizes(vocab_sizes: Sequence[int], corpora: Sequence[str], tokenizer_chars: int) -> None:
    """A clear error for a list of vocabulary sizes the study cannot run: empty, not ints, repeated, or below
    ``minimum_vocab`` (which reads the tokenizer's sample: seconds)."""
    if not vocab_sizes:
        raise ValueError("give at least one vocabulary size")
    for v in vocab_sizes:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"a vocabulary size must be an int >= 1, got {v!r}")
    repeated = sorted({v for v in vocab_sizes if list(vocab_sizes).count(v) > 1})
    if repeated:
        raise ValueError(f"the vocabulary sizes list {', '.join(map(str, repeated))} more than once")
    least = minimum_vocab(tuple(corpora), tokenizer_chars)
    small = [v for v in vocab_sizes if v < least]
    if small:
        raise ValueError(
            f"vocabulary size {small[0]} is smaller than the special tokens plus the characters of the "
            f"tokenizer's sample ({least}): ask for at least {least}"
        )


def probe_tasks(corpora: Sequence[str]) -> tuple[str, ...]:
    """The capstone's tasks (``evaluate.TASKS``) whose text none of ``corpora`` holds."""
    return tuple(name for name, task in TASKS.items() if not set(task.overlap) & set(corpora))


def count_tokens(tokenizer, documents: Sequence[str]) -> dict[str, int]:
    """{"tokens", "chars"}: the ordinary tokens of ``documents`` ([UNK] included, no specials) and their characters."""
    tokens = sum(len(tokenizer.encode(d, add_special_tokens=False)) for d in documents)
    return {"tokens": tokens, "chars": sum(len(d) for d in documents)}


def _probe(folder, splits: dict, from_scratch: bool, seed: int) -> dict[str, float]:
    """{task: dev accuracy} of a linear probe on the run's frozen encoder (or random weights of its shape)."""
    features = encoder_features(folder, from_scratch=from_scratch, seed=seed)[0]
    return {task: round(probe_scorer(features)(s.train, s.dev, None, seed), 4) for task, s in splits.items()}


def run_vocab_study(
    vocab_sizes: Sequence[int] = VOCAB_SIZES,
    budget_seconds: float | None = 180.0,
    out=None,
    *,
    base: dict | None = None,
    max_steps: int | None = None,
    corpora: Sequence[str] = CORPORA,
    max_chars: int | None = None,
    seed: int = 0,
    evals: int = 12,
    eval_every: int | None = None,
    eval_batches: int = 20,
    tokenizer_chars: int = 400_000,
    probe: bool = True,
    tasks: Sequence[str] | None = None,
    probe_max_train: int | None = None,
    probe_max_eval: int | None = None,
    runs_dir=None,
    device=None,
    command: str | None = None,
    progress: bool = True,
    stream=None,
) -> dict:
    """Pretrain ``crammed(**base)`` at each of ``vocab_sizes`` under the same budget; write ``out``.

    ``tasks``: the probe's (default ``probe_tasks(corpora)``); ``probe_max_train``/``probe_max_eval`` cap
    their train and dev splits (quick runs). The rest as ``scaling.run_scaling``. Every check runs, and every
    tokenizer and packed text is prepared (cached), before the first run's clock starts.
    """
    stream = stream or sys.stdout
    say = (lambda *a: print(*a, file=stream, flush=True)) if progress else (lambda *a: None)
    budget = StudyBudget(
        budget_seconds, max_steps, tuple(corpora), max_chars, seed, evals, eval_every, eval_batches, tokenizer_chars
    )
    check_vocab_sizes(vocab_sizes, corpora, tokenizer_chars)
    tasks = tuple(probe_tasks(corpora) if tasks is None else tasks) if probe else ()
    check_no_overlap(tasks, corpora)
    if probe and not tasks:
        raise ValueError(f"every probe task's text is in the corpora {', '.join(corpora)}: name tasks, or probe=False")
    for name, value in (("probe_max_train", probe_max_train), ("probe_max_eval", probe_max_eval)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    base = {k: v for k, v in (base or {}).items() if k != "vocab_size"}
    recipes = {str(v): crammed(**{**base, "vocab_size": v}) for v in vocab_sizes}
    counts = {name: parameter_counts(recipe) for name, recipe in recipes.items()}
    device = device or runtime.device()
    start = datetime.datetime.now(datetime.timezone.utc)

    say(f"Preparing {len(recipes)} tokenizers and their packed text (cached after the first time); no clock runs.")
    seq_len = crammed(**base).model.max_seq_len
    documents = read_documents(corpora, "validation", held_out_chars(max_chars, seq_len))  # the held-out text
    data, held_out = {}, {}
    for name, recipe in recipes.items():
        prepared = prepare_data(recipe, corpora, max_chars, tokenizer_chars, progress=False)
        tokenizer, train_rows = prepared.tokenizer, prepared.train
        if tokenizer.vocab_size != recipe.model.vocab_size:
            raise ValueError(
                f"the tokenizer's sample ran out at {tokenizer.vocab_size} entries, short of {name}: "
                f"learn it from more text (tokenizer_chars) or ask for a smaller vocabulary"
            )
        data[name], held_out[name] = (tokenizer, train_rows), count_tokens(tokenizer, documents)
        per_char = held_out[name]["tokens"] / held_out[name]["chars"]
        say(f"  vocabulary {name:>6}: {per_char:.3f} tokens per character, {train_rows.numel():,} training tokens")
    plan = plan_runs(recipes, data, budget, device)
    del data  # the training rows of every vocabulary: pretrain reads its own from the cache
    splits = {
        t: make_splits(t, PROBE_DEV_FRACTION, 0, max_train=probe_max_train, max_eval=probe_max_eval) for t in tasks
    }

    probe_config = {
        "tasks": list(tasks),
        "split": f"dev ({PROBE_DEV_FRACTION:.0%} of train, seed 0); fit on the rest of train",
        "sizes": {t: {"train": len(s.train), "dev": len(s.dev)} for t, s in splits.items()},
        "features": "mean-pooled last hidden states of the frozen encoder, 128 tokens at most",
        "classifier": "multinomial logistic regression, standardised features, l2 1e-3, L-BFGS",
        "max_train": probe_max_train,
        "max_eval": probe_max_eval,
    }
    config = {
        **{"budget_seconds": budget_seconds, "max_steps": max_steps, "vocab_sizes": list(vocab_sizes)},
        **{"base": base, "recipe": recipes[next(iter(recipes))].name, "corpora": list(corpora)},
        **{"max_chars": max_chars, "tokenizer_chars": tokenizer_chars, "seed": seed, "evals": evals},
        **{"eval_batches": eval_batches, "probe": probe_config if probe else None},
    }
    command = command or "llmedu.cramming.studies.vocab_study.run_vocab_study (from Python)"
    results = study_results(command, device, start, config)
    with tempfile.TemporaryDirectory(prefix="cramming-vocab-") as scratch:
        folders = Path(runs_dir) if runs_dir is not None else Path(scratch)
        for i, (name, recipe) in enumerate(recipes.items(), 1):
            say(f"[{i}/{len(recipes)}] vocabulary {name}: pretraining for {budget_words(budget_seconds, max_steps)}")
            folder = folders / f"vocab-{name}"
            summary = pretrain_recorded(folder, f"vocabulary {name}", recipe, budget, plan[name], device)
            record = run_record(summary, counts[name], plan[name])
            per_char = held_out[name]["tokens"] / held_out[name]["chars"]
            unigram = unigram_line(folder)
            results["runs"][name] = run = {
                "vocab_size": recipe.model.vocab_size,
                "tokens_per_char": round(per_char, 5),
                "held_out": held_out[name],
                "nats_per_char": round(record["val_loss"] * per_char, 5),
                "unigram_cross_entropy": round(unigram, 4),
                "below_unigram": round(unigram - record["val_loss"], 4),
                "chars_per_s": round(record["tokens_per_s"] / per_char, 1),
                "probe": _probe(folder, splits, False, seed) if probe else None,
                "probe_control": _probe(folder, splits, True, seed) if probe else None,
                **record,
            }
            write_results(out, results, start)
            probed = "" if not probe else ", probe " + ", ".join(f"{t} {a:.3f}" for t, a in run["probe"].items())
            say(
                f"[{i}/{len(recipes)}] vocabulary {name}: {run['steps']:,} steps at {run['tokens_per_s']:,.0f} tokens/s "
                f"({run['chars_per_s']:,.0f} chars/s), loss {run['val_loss']:.3f} = {run['nats_per_char']:.3f} "
                f"nats/char{probed} ({run['wall_seconds']:.0f} s with the evaluations)"
            )
    return results
