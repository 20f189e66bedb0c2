"""The measurement of the mixture-of-experts lesson (21): does a top-1 MoE beat a dense model at equal FLOPs?

Switch Transformer (Fedus et al. 2022, JMLR, sec. 3 and fig. 4) compares a top-1 MoE of E experts, each
the size of the dense FFN, with the dense model of the same FLOPs per token, and finds the MoE reaching a
lower loss in the same number of steps. This file runs that comparison at course scale: a byte-level GPT
on Shakespeare, small enough (d_model 64, 2 layers) that the dense model is limited by its parameters, not
by its data (one pass over about 4 million bytes). Dense and MoE share the attention, the tokens (the same
batches in the same order for one seed), the steps and the schedule; each is trained from several seeds
and scored on the same held-out bytes; ``summarise`` gives mean +- std and the difference with its
two-sample standard error, ``paired_difference`` the per-seed differences (dense and MoE of one seed read
the same batches) with Student's t on n - 1 degrees of freedom.

The lesson's live runs: ``train_live`` trains one model for a few hundred steps and records, each step,
every layer's share of tokens per expert, the dropped share, layer 0's mean gate and ``common_direction``
of what layer 0's router reads (the mean cosine between each token's router input and the batch's mean
input: 1, every token the same direction; near 0, no shared component); ``imbalance`` summarises the shares.

The algorithm lives in ``llmedu.nn.moe``; this file only trains and scores it. Run by hand:

    python -m llmedu.train.moe_study run --seeds 0 1 2 --out data/results/moe_vs_dense_cpu.json

Left out: wall-clock time (the runs record their seconds, but three shared a 2-core machine),
expert parallelism, and any tuning: both models use one learning rate and one schedule, chosen in advance.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import runtime
from ..data.corpora import load_corpus
from ..models import CausalLM, TransformerConfig
from ..models.config import MoEConfig
from ..models.counting import count_parameters, matmul_parameters
from ..models.gpt import lm_loss
from ..runtime import git_commit as _commit  # the study records the commit it ran from
from .loop import TrainConfig, train
from .schedules import warmup_cosine

__all__ = [
    "RESULT",
    "StudyConfig",
    "as_bytes",
    "model_config",
    "train_one",
    "summarise",
    "paired_difference",
    "common_direction",
    "train_live",
    "imbalance",
    "run_study",
]

RESULT = Path(__file__).resolve().parents[2] / "data" / "results" / "moe_vs_dense_cpu.json"  # what the lesson reads


@dataclass(frozen=True)
class StudyConfig:
    corpus: str = "shakespeare"
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 64
    batch: int = 32
    steps: int = 1200
    lr: float = 3e-3
    warmup: int = 100
    n_experts: int = 8
    capacity_factor: float | None = 1.25
    aux_loss_coef: float = 0.01  # Switch's
    z_loss_coef: float = 0.001  # ST-MoE's
    eval_sequences: int = 256  # held-out sequences of seq_len bytes, evenly spaced over the validation split

    def __post_init__(self):
        for name in ("d_model", "n_heads", "n_layers", "seq_len", "batch", "steps", "n_experts", "eval_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"StudyConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"StudyConfig.warmup must be in 0..steps-1 (steps={self.steps}), got {self.warmup}")


def as_bytes(text: str) -> torch.Tensor:
    """UTF-8 bytes as token ids (vocabulary 256): (len,) int64."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def model_config(cfg: StudyConfig, moe: bool) -> TransformerConfig:
    """The dense model, or the same model with a Switch-style top-1 MoE of ``n_experts`` in every FFN slot."""
    base = TransformerConfig(
        vocab_size=256,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        max_seq_len=cfg.seq_len,
        position="rope",
    )
    if not moe:
        return base
    switch = MoEConfig(
        cfg.n_experts,
        1,
        cfg.capacity_factor,
        renormalize=False,
        aux_loss_coef=cfg.aux_loss_coef,
        z_loss_coef=cfg.z_loss_coef,
    )
    return dataclasses.replace(base, moe=switch)


def _data(cfg: StudyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    train_bytes = as_bytes(load_corpus(cfg.corpus, "train"))
    valid = as_bytes(load_corpus(cfg.corpus, "validation"))
    starts = torch.linspace(0, len(valid) - cfg.seq_len - 1, cfg.eval_sequences).long()
    held_out = torch.stack([valid[s : s + cfg.seq_len] for s in starts])  # (eval_sequences, seq_len)
    return train_bytes, held_out


@torch.no_grad()
def held_out_loss(model: CausalLM, held_out: torch.Tensor, chunk: int = 64) -> float:
    """Mean next-byte loss (nats/byte) over every held-out sequence."""
    model.eval()
    losses = [lm_loss(model(ids), ids).item() * len(ids) for ids in held_out.split(chunk)]
    model.train()
    return sum(losses) / len(held_out)


def train_one(cfg: StudyConfig, moe: bool, seed: int, data=None, log_every: int = 0) -> dict:
    """Train one model from ``seed`` (its init and its batches); its held-out loss and what it cost."""
    train_bytes, held_out = data if data is not None else _data(cfg)
    runtime.seed_everything(seed)
    model = CausalLM(model_config(cfg, moe))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    order = torch.Generator().manual_seed(1000 + seed)  # the same batches for dense and MoE of one seed

    def batches(_step):
        starts = torch.randint(0, len(train_bytes) - cfg.seq_len, (cfg.batch,), generator=order)
        return torch.stack([train_bytes[s : s + cfg.seq_len] for s in starts])  # (batch, seq_len)

    curve, calls = [], [0]

    def loss_fn(m, ids):
        loss = lm_loss(m(ids), ids) + m.transformer.moe_loss()  # before any held-out pass replaces the stats
        if log_every and calls[0] % log_every == 0:
            curve.append((calls[0], held_out_loss(m, held_out)))
        calls[0] += 1
        return loss

    schedule = warmup_cosine(cfg.warmup, cfg.steps, final=0.1)
    start = time.perf_counter()
    train(model, opt, batches, loss_fn, TrainConfig(max_steps=cfg.steps, schedule=schedule, progress=False))
    seconds = time.perf_counter() - start
    return dict(
        model="moe" if moe else "dense",
        seed=seed,
        held_out=held_out_loss(model, held_out),
        curve=curve,
        seconds=seconds,
        parameters=count_parameters(model),
        active_matmul=matmul_parameters(model, active=True),
        tokens=cfg.steps * cfg.batch * cfg.seq_len,
    )


def summarise(runs: list[dict]) -> dict:
    """Mean and std (n - 1) of the held-out loss per model, and MoE - dense with its two-sample standard error."""
    by = {name: [r["held_out"] for r in runs if r["model"] == name] for name in ("dense", "moe")}
    if min(len(v) for v in by.values()) < 2:
        counts = {k: len(v) for k, v in by.items()}
        raise ValueError(f"summarise needs at least 2 seeds of each model, got {counts}: run more seeds")
    out = {name: dict(mean=statistics.mean(v), std=statistics.stdev(v), n=len(v)) for name, v in by.items()}
    d, m = out["dense"], out["moe"]
    out["difference"] = m["mean"] - d["mean"]  # negative: the MoE is better
    out["standard_error"] = math.sqrt(d["std"] ** 2 / d["n"] + m["std"] ** 2 / m["n"])
    return out


def t_two_sided_p(t: float, dof: int) -> float:
    """P(|T| >= |t|) for Student's t with ``dof`` degrees of freedom (Abramowitz & Stegun 26.7.3-4)."""
    if dof < 1:
        raise ValueError(f"Student's t needs dof >= 1, got {dof}")
    theta = math.atan(abs(t) / math.sqrt(dof))
    c2, total = math.cos(theta) ** 2, 1.0 if dof % 2 == 0 else math.cos(theta)
    term = total
    for j in range(2 if dof % 2 == 0 else 3, dof, 2):
        term *= (j - 1) / j * c2
        total += term
    inside = math.sin(theta) * total if dof % 2 == 0 else 2 / math.pi * (theta + math.sin(theta) * total * (dof > 1))
    return 1.0 - inside


def paired_difference(runs: list[dict]) -> dict:
    """MoE - dense per seed (both read the same batches): the mean, its standard error std/sqrt(n), t on n - 1
    degrees of freedom and the two-sided p (a normal model of the per-seed differences)."""
    held = {(r["model"], r["seed"]): r["held_out"] for r in runs}
    seeds = sorted(s for m, s in held if m == "moe" and ("dense", s) in held)
    if len(seeds) < 2:
        raise ValueError(f"paired_difference needs both models from at least 2 seeds, got seeds {seeds}")
    diffs = [held["moe", s] - held["dense", s] for s in seeds]
    mean, se = statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
    t = mean / se if se > 0 else math.copysign(math.inf, mean)
    return dict(
        differences=diffs, mean=mean, standard_error=se, t=t, dof=len(diffs) - 1, p=t_two_sided_p(t, len(diffs) - 1)
    )


def common_direction(x: torch.Tensor) -> float:
    """Mean over rows of cos(x_t, mean of the rows): how much of ``x`` (N, d) is one direction shared by all."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    return torch.nn.functional.cosine_similarity(x, x.mean(0, keepdim=True), dim=-1).mean().item()


def train_live(cfg: TransformerConfig, steps: int, batches, held_out: torch.Tensor, device, lr: float = 3e-3) -> dict:
    """One seed (0) at a constant learning rate, recording every step: ``lm`` loss, ``loads`` (steps, layers, E)
    shares of tokens per expert, ``dropped`` share (all layers), layer 0's mean kept ``gate`` and the ``cos``
    of what its router reads; then the ``valid`` loss on ``held_out``."""
    runtime.seed_everything(0)
    model = CausalLM(cfg).to(device)
    rec = dict(lm=[], loads=[], dropped=[], gate=[], cos=[])
    hooks = []
    if cfg.moe:
        router = model.transformer.blocks[0].mlp.router
        hooks.append(router.register_forward_pre_hook(lambda _, args: rec["cos"].append(common_direction(args[0]))))
        hooks.append(router.register_forward_hook(lambda _, a, out: rec["gate"].append(out[0].gate.mean().item())))

    def loss_fn(m, ids):
        main = lm_loss(m(ids), ids)
        rec["lm"].append(main.item())
        if stats := m.transformer.moe_stats():
            rec["loads"].append([(s.tokens_per_expert / s.tokens_per_expert.sum()).tolist() for s in stats])
            rec["dropped"].append(sum(s.dropped for s in stats) / sum(int(s.tokens_per_expert.sum()) for s in stats))
        return main + m.transformer.moe_loss()

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    train(model, opt, batches, loss_fn, TrainConfig(max_steps=steps, progress=False))
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        rec["valid"] = lm_loss(model.eval()(held_out), held_out).item()
    return dict(rec, model=model, loads=torch.tensor(rec["loads"]))  # loads: (steps, layers, E)


def imbalance(loads: torch.Tensor, last: int = 100) -> list[dict]:
    """Per layer, over the ``last`` steps of ``loads`` (steps, layers, E): each expert's mean share, their
    coefficient of variation (std / mean, 0 when balanced) and how many experts got under half of 1/E."""
    share = loads[-last:].mean(0)  # (layers, E)
    n_experts = share.shape[-1]
    return [
        dict(busiest=s.max().item(), idlest=s.min().item(), cv=(s.std() / s.mean()).item(),
             starved=int((s < 0.5 / n_experts).sum()))
        for s in share
    ]  # fmt: skip


def run_study(cfg: StudyConfig, seeds: list[int], log_every: int = 0) -> dict:
    """Dense and MoE from every seed; the runs, their summary (when >= 2 seeds) and the provenance."""
    data, runs, start, commit = _data(cfg), [], time.perf_counter(), _commit()  # the code that runs: HEAD now
    for seed in seeds:
        for moe in (False, True):
            runs.append(train_one(cfg, moe, seed, data, log_every))
            r = runs[-1]
            print(
                f"seed {seed} {r['model']:>5}: held-out {r['held_out']:.4f} nats/byte, {r['seconds']:.0f} s", flush=True
            )
    provenance = dict(
        command="python -m llmedu.train.moe_study " + " ".join(sys.argv[1:]),
        commit=commit,
        machine=runtime.machine(),
        threads=torch.get_num_threads(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__,
        wall_seconds=round(time.perf_counter() - start, 1),
    )
    result = dict(provenance=[provenance], config=dataclasses.asdict(cfg), runs=runs)
    if len(seeds) >= 2:
        result["summary"] = summarise(runs)
    return result


def merge(paths: list[str]) -> dict:
    """Several runs of one config (e.g. one seed per process) as one result."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    configs = {json.dumps(p["config"], sort_keys=True) for p in parts}
    if len(configs) != 1:
        raise ValueError(f"the files {paths} were run with different configs; merge only runs of one config")
    runs = [r for p in parts for r in p["runs"]]
    seen = [(r["model"], r["seed"]) for r in runs]
    if len(set(seen)) != len(seen):
        raise ValueError(f"the files {paths} repeat a (model, seed) pair: {sorted(seen)}")
    return dict(
        provenance=[q for p in parts for q in p["provenance"]],
        config=parts[0]["config"],
        runs=runs,
        summary=summarise(runs),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m llmedu.train.moe_study", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train dense and MoE from each seed and write the result as JSON")
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    run.add_argument("--steps", type=int, default=StudyConfig.steps)
    run.add_argument("--log-every", type=int, default=0, help="also score the held-out bytes every N steps")
    run.add_argument("--threads", type=int, default=1, help="torch threads (small matmuls: 1 is fastest)")
    run.add_argument("--out", required=True)
    both = sub.add_parser("merge", help="join result files of one config (e.g. one seed each) into one")
    both.add_argument("parts", nargs="+")
    both.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "run":
        torch.set_num_threads(args.threads)
        result = run_study(StudyConfig(steps=args.steps), args.seeds, args.log_every)
    else:
        result = merge(args.parts)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if "summary" in result:
        s = result["summary"]
        print(f"MoE - dense = {s['difference']:+.4f} +- {s['standard_error']:.4f} nats/byte -> {args.out}")


if __name__ == "__main__":
    main()
