"""The measurement behind lesson 24's headline: does a small LM with a kNN-LM datastore reach a larger LM
without one, both trained for the same number of steps (a cap of 4,000 steps of 16 rows)?

Khandelwal et al. 2020 (kNN-LM, §4-5) add a datastore to a trained LM and compare held-out perplexity;
their datastore is the LM's own training text. This file runs that comparison at course scale on the King
James Bible read as bytes:

* two byte-level GPTs (small: d_model 64, 2 layers; large: 192, 4) train on random chunk pairs of the
  training books, each at its own learning rate, and each is scored on a dev split of the training books
  (rows no training step draws) every ``eval_every`` steps; training stops when the dev loss has not
  improved by ``min_delta`` for ``patience`` evaluations (or at ``max_steps``, the same for both), and the
  best checkpoint is kept. The dev curve and the stop reason are recorded, so the reader sees whether a
  model flattened or the two compare at equal steps (in the recorded run both reached the cap, still falling);
* a kNN-LM datastore (one key per scored byte, keys from the small LM) is built from ``datastore_rows``
  rows of the same training pool, and every row of the held-out set is scored three ways (small, large,
  small + kNN-LM at each lambda), per row, so the per-book means and the standard error of each paired
  difference can be printed;
* the text each saw is counted: distinct training rows each LM drew, against the rows in the datastore.

The algorithms live in ``llmedu.retrieval.knn_lm`` and ``llmedu.retrieval.rag``; this file only trains
and scores. Run by hand (about 25 minutes of one CPU core: the recorded run took 1,467 s):

    python -m llmedu.retrieval.study --out data/results/retrieval_knn_lm_cpu.json

Left out: seeds (one run per model: the per-row standard errors measure the evaluation's noise, not the
training's), a learning-rate schedule (constant rate, as in the lesson's sweep), approximate search.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import runtime
from ..data import load_documents
from ..models import CausalLM, TransformerConfig
from ..models.counting import count_parameters
from ..runtime import git_commit as _commit  # the study records the commit it ran from
from .datastore import chunk_pairs
from .exact import FlatIndex
from .knn_lm import KNNLM, build_datastore, interpolate
from .knowledge import search_flops
from .rag import evaluate, flops_per_predicted_token, target_loss

__all__ = [
    "DECLARED_LAMBDA",
    "RESULT",
    "StudyConfig",
    "train_until_flat",
    "row_losses",
    "run_study",
    "study_report",
    "main",
]

DECLARED_LAMBDA = 0.25  # the kNN-LM weight the verdict reads, fixed before any run (as in lesson 24)
RESULT = Path(__file__).resolve().parents[2] / "data" / "results" / "retrieval_knn_lm_cpu.json"  # what the lesson reads


@dataclass(frozen=True)
class StudyConfig:
    m: int = 32  # bytes per chunk; a row is [c_i, c_(i+1)], scored on c_(i+1)
    batch: int = 16
    sizes: dict = field(default_factory=lambda: {"small": [64, 2, 3e-3, 4000], "large": [192, 4, 1e-3, 4000]})
    # name: [d_model, n_layers, learning rate (the best of {3e-3, 1e-3, 3e-4} after 400 steps on the dev rows), max steps];
    # the same step cap for both: if neither flattens on one CPU core, the two still compare at equal steps
    eval_every: int = 200
    patience: int = 2
    min_delta: float = 0.005  # nats/byte: a smaller fall counts as no fall
    n_dev: int = 500
    n_test: int = 1000  # the lesson's held-out rows: a seeded sample of all six held-out books
    datastore_rows: int = 8192
    lams: tuple = (0.0, 0.1, 0.25, 0.5)
    k: int = 16
    books: int | None = None  # the first n training books (None: all)

    @classmethod
    def tiny(cls) -> StudyConfig:
        """A live version for fast mode: seconds, and no finding."""
        sizes = {"small": [64, 2, 3e-3, 16], "large": [192, 4, 1e-3, 8]}
        return cls(sizes=sizes, eval_every=4, n_dev=32, n_test=64, datastore_rows=256, books=4)


def _gpt(d_model: int, n_layers: int) -> CausalLM:
    torch.manual_seed(0)
    cfg = TransformerConfig.gpt2(vocab_size=256, d_model=d_model, n_layers=n_layers, n_heads=4, max_seq_len=256)
    return CausalLM(cfg)


def train_until_flat(model, pool, dev, cfg: StudyConfig, lr: float, max_steps: int, seed: int = 0) -> dict:
    """AdamW at a constant ``lr`` on random batches of ``pool`` (n, 2m); the dev loss every ``eval_every``
    steps; stop after ``patience`` evaluations without a fall of ``min_delta``; keep the best checkpoint."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    seen = torch.zeros(len(pool), dtype=torch.bool)
    curve, best, best_state, best_step, best_seen, bad, step = [], float("inf"), None, 0, 0, 0, 0
    while step < max_steps:
        model.train()
        for _ in range(min(cfg.eval_every, max_steps - step)):
            rows = torch.randint(len(pool), (cfg.batch,), generator=g)  # (B,)
            seen[rows] = True
            loss = target_loss(model, pool[rows], cfg.m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
        dev_loss = evaluate(model, dev, cfg.m)
        curve.append([step, dev_loss])
        if dev_loss < best - cfg.min_delta:
            best, best_state, best_step, bad = dev_loss, copy.deepcopy(model.state_dict()), step, 0
            best_seen = int(seen.sum())  # distinct rows drawn up to the kept checkpoint
        else:
            bad += 1
            if bad >= cfg.patience:
                break
    model.load_state_dict(best_state)
    stopped = "dev loss flat" if bad >= cfg.patience else "max_steps reached"
    return dict(dev_curve=curve, best_step=best_step, best_dev=best, stopped=stopped, distinct_rows=best_seen)


@torch.no_grad()
def row_losses(model, rows: torch.Tensor, m: int, index=None, values=None, lams=(0.0,), k: int = 16) -> torch.Tensor:
    """(len(lams), n) loss of each row's last m bytes, nats/byte; with an index, the kNN-LM at each lambda."""
    model.eval()
    out = []
    knn = KNNLM(model, index, values, k=k) if index is not None else None
    for i in range(0, len(rows), 64):
        r = rows[i : i + 64]
        target = r[:, -m:].unsqueeze(2)  # (b, m, 1)
        if knn is None:
            logp = torch.log_softmax(model(r[:, :-1])[:, -m:].float(), -1)  # (b, m, V)
            out.append(-logp.gather(2, target).squeeze(2).mean(1).unsqueeze(0))
            continue
        log_p_lm, log_p_knn = knn.lm_and_knn(r[:, :-1], last=m)  # (b, m, V) each
        mixed = [-interpolate(log_p_lm, log_p_knn, lam).gather(2, target).squeeze(2).mean(1) for lam in lams]
        out.append(torch.stack(mixed))
    return torch.cat(out, dim=1).double()


def _paired(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = a - b
    return dict(difference=d.mean().item(), standard_error=(d.std() / len(d) ** 0.5).item())


def run_study(cfg: StudyConfig, log=print) -> dict:
    start = time.perf_counter()
    train_docs, val_docs = load_documents("kjv", "train"), load_documents("kjv", "validation")
    train_docs = train_docs[: cfg.books] if cfg.books else train_docs
    rows, _ = chunk_pairs(train_docs, cfg.m)  # (N, 2m)
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
    dev, pool = rows[perm[: cfg.n_dev]], rows[perm[cfg.n_dev :]]  # dev rows: never drawn by training
    val_rows, val_doc = chunk_pairs(val_docs, cfg.m)
    keep = torch.randperm(len(val_rows), generator=torch.Generator().manual_seed(1))[: cfg.n_test].sort().values
    test, test_doc = val_rows[keep], val_doc[keep]
    models, training = {}, {}
    for name, (width, depth, lr, max_steps) in cfg.sizes.items():
        t0 = time.perf_counter()
        models[name] = _gpt(width, depth)
        training[name] = train_until_flat(models[name], pool, dev, cfg, lr, max_steps)
        training[name].update(
            lr=lr, seconds=round(time.perf_counter() - t0, 1), parameters=count_parameters(models[name])
        )
        training[name]["flops_per_byte"] = flops_per_predicted_token(models[name], 2 * cfg.m, cfg.m)
        log(
            f"{name}: best dev {training[name]['best_dev']:.4f} at step {training[name]['best_step']} "
            f"({training[name]['stopped']}), {training[name]['seconds']:.0f} s"
        )
    small = models["small"]
    store = pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(2))[: cfg.datastore_rows]]
    keys, values = build_datastore(small, store, last=cfg.m)  # (rows * m, d), (rows * m,)
    index = FlatIndex(keys.shape[1], metric="l2", block=64)
    index.add(keys)
    losses = {name: row_losses(model, test, cfg.m)[0] for name, model in models.items()}  # (n,) each
    knn = row_losses(small, test, cfg.m, index, values, cfg.lams, cfg.k)  # (lams, n)
    for lam, v in zip(cfg.lams, knn):
        losses[f"small + kNN-LM, lambda {lam:g}"] = v
    counts = torch.bincount(pool[:, cfg.m :].flatten(), minlength=256).double() + 1
    losses["unigram"] = -(counts / counts.sum()).log()[test[:, cfg.m :]].mean(1)
    books = [val_docs[int(d)].split("\n", 1)[0][:40] for d in test_doc.unique()]
    by_book = {name: [v[test_doc == d].mean().item() for d in test_doc.unique()] for name, v in losses.items()}
    large = losses["large"]
    return dict(
        provenance=[
            dict(
                command="python -m llmedu.retrieval.study " + " ".join(sys.argv[1:]),
                commit=_commit(),
                machine=runtime.machine(),
                threads=torch.get_num_threads(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__,
                wall_seconds=round(time.perf_counter() - start, 1),
            )
        ],
        config=dataclasses.asdict(cfg),
        training=training,
        text=dict(training_rows=len(pool), datastore_rows=len(store), keys=len(keys), m=cfg.m),
        datastore=dict(
            bytes=keys.numel() * 4 + values.numel() * values.element_size(),
            search_flops_per_byte=search_flops(len(keys), keys.shape[1]),
        ),
        test=dict(rows=len(test), books=books, rows_per_book=[int((test_doc == d).sum()) for d in test_doc.unique()]),
        loss={name: v.mean().item() for name, v in losses.items()},
        loss_by_book=by_book,
        against_large={name: _paired(v, large) for name, v in losses.items() if name != "large"},
    )


def study_report(study: dict) -> str:
    """The lesson's table of a result: provenance, training, text budgets, losses against the large LM, verdict."""
    out = []
    p = study["provenance"][0]
    out.append(
        f"recorded: {runtime.shown_command(p['command'])} | {p['date']} | {p['machine']} | {p['threads']} thread(s) | {p['wall_seconds']:.0f} s"
    )
    m_s, text = study["config"]["m"], study["text"]
    for name, t in study["training"].items():
        out.append(
            f"{name:5} lr {t['lr']:g}: best dev {t['best_dev']:.3f} at step {t['best_step']} ({t['stopped']}); "
            f"{t['distinct_rows']:,} distinct training rows drawn = {t['distinct_rows'] * m_s:,} scored bytes"
        )
    out.append(
        f"datastore: {text['datastore_rows']:,} rows = {text['keys']:,} keys (scored bytes), of a pool of "
        f"{text['training_rows']:,} training rows; {study['datastore']['bytes'] / 1e6:.1f} MB"
    )
    tr, search = study["training"], study["datastore"]["search_flops_per_byte"]
    out.append(
        f"\n{study['test']['rows']} held-out rows: "
        + ", ".join(f"{b} {n}" for b, n in zip(study["test"]["books"], study["test"]["rows_per_book"]))
    )
    out.append(f"{'model':30} {'params':>9} {'FLOPs/byte':>11} {'loss':>6} {'- large (+- s.e.)':>18}  per book")
    for name, loss in study["loss"].items():
        size = "large" if name == "large" else "small"
        params, flops = (
            f"{tr[size]['parameters']:,}",
            tr[size]["flops_per_byte"] + (search if "kNN" in name and not name.endswith(" 0") else 0),
        )
        if name == "unigram":
            params, flops = "", 0
        d = study["against_large"].get(name)
        diff = f"{d['difference']:+.3f} +- {d['standard_error']:.3f}" if d else ""
        out.append(
            f"{name:30} {params:>9} {flops / 1e6:9.2f} M {loss:6.3f} {diff:>18}  "
            + " ".join(f"{v:.2f}" for v in study["loss_by_book"][name])
        )
    best = f"small + kNN-LM, lambda {DECLARED_LAMBDA:g}"  # declared before the run: the verdict never picks on test
    if best not in study["against_large"]:
        raise ValueError(f"the study has no row {best!r}: its lambdas are {study['config']['lams']}")
    d = study["against_large"][best]
    verdict = (
        "below"
        if d["difference"] + 2 * d["standard_error"] < 0
        else "above"
        if d["difference"] - 2 * d["standard_error"] > 0
        else "not resolved from"
    )
    out.append(
        f"kNN-LM at the declared lambda ({best}): {verdict} the large LM ({d['difference']:+.3f} +- {d['standard_error']:.3f} nats/byte)"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m llmedu.retrieval.study", description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (small matmuls: 1 is fastest)")
    parser.add_argument("--tiny", action="store_true", help="the seconds-long version fast mode runs")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run_study(StudyConfig.tiny() if args.tiny else StudyConfig())
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
