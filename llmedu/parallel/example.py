"""One small GPT trained data-parallel: the same script under our launcher and under ``torchrun``.

    python -m llmedu.parallel.example --layout zero2 --ranks 2          # our launcher starts 2 processes
    torchrun --nproc-per-node 2 -m llmedu.parallel.example --layout zero2
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m llmedu.parallel.example --layout 3d --tp 4 --pp 2

Every rank trains the same byte-level GPT on Shakespeare with its own slice of each batch, in one
of the layouts of lessons 11-15: ``ddp`` (our DDP and AdamW), ``zero1``/``zero2``/``zero3`` (our ZeRO),
or ``3d`` (DP x TP x PP from ``mesh.train_3d``). ``launch`` sees ``torchrun``'s environment and runs
the worker in place; without it, it starts ``--ranks`` processes itself. The backend is gloo on
CPUs and takes in NCCL when every rank has a GPU (then each rank trains on ``cuda:LOCAL_RANK``, except in the
``3d`` layout, whose ``mesh.train_3d`` keeps its tensors on the CPU: gloo carries it there too). Rank 0
prints the loss of every step and, last, one line of JSON with the losses.

Left out: checkpoints, a data loader that streams a corpus (every rank draws the same random
windows from the same text, then keeps its own rows), and mixed precision.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from ..data import load_corpus
from ..models.config import TransformerConfig
from ..models.gpt import CausalLM, lm_loss
from .data_parallel import DDP
from .launch import launch
from .mesh import byte_batches, train_3d
from .zero import ZeRO

__all__ = ["LAYOUTS", "train", "layout_problem", "main"]

LAYOUTS = ("ddp", "zero1", "zero2", "zero3", "3d")


def _config(d_model: int, layers: int) -> TransformerConfig:
    return TransformerConfig.gpt2(vocab_size=256, d_model=d_model, n_layers=layers, n_heads=4)  # tied embeddings


def train(
    layout: str,
    steps: int = 20,
    batch: int = 8,
    seq_len: int = 64,
    d_model: int = 64,
    layers: int = 2,
    lr: float = 3e-3,
    tp: int = 1,
    pp: int = 1,
) -> list[float]:
    """The worker: train in ``layout`` for ``steps`` steps; the mean loss over all ranks at each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    config = _config(d_model, layers)
    batches = byte_batches(load_corpus("shakespeare"), batch, seq_len, steps, seed=0)  # the same on every rank
    if layout == "3d":
        if world % (tp * pp):
            raise ValueError(f"tp x pp = {tp * pp} does not divide the world size {world}")
        return train_3d(config, batches, dp=world // (tp * pp), tp=tp, pp=pp, lr=lr, optimizer="adamw")
    if batch % world:
        raise ValueError(f"the batch of {batch} rows does not split evenly over {world} ranks")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if "nccl" in dist.get_backend() else None
    torch.manual_seed(0)  # the same initial weights on every rank (DDP and ZeRO also broadcast or shard them)
    model = CausalLM(config).to(device)
    if layout == "ddp":
        wrapped, optimizer = DDP(model), torch.optim.AdamW(model.parameters(), lr=lr)
    else:
        wrapped = optimizer = ZeRO(model, int(layout[-1]), lr=lr)
    losses = []
    for step, rows in enumerate(batches):
        mine = rows.chunk(world)[rank].to(device)  # (batch / world, seq_len): this rank's rows
        loss = lm_loss(wrapped(mine), mine)
        loss.backward()
        if layout == "ddp":
            wrapped.finish_gradient_sync()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def layout_problem(args: argparse.Namespace, world: int) -> str | None:
    """What is wrong with this layout on ``world`` ranks, in one line (None if nothing): checked before launching."""
    for name in ("batch", "seq_len", "d_model", "layers", "tp", "pp"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    heads, longest = 4, 1024  # the example's GPT (_config): 4 heads, positions up to 1024
    if args.d_model % heads:
        return f"--d-model {args.d_model} must be a multiple of the model's {heads} heads"
    if args.seq_len > longest:
        return f"--seq-len {args.seq_len} is longer than the model's {longest} learned positions"
    if args.layout != "3d":
        if (args.tp, args.pp) != (1, 1):
            return f"--tp and --pp apply to the 3d layout only; --layout {args.layout} splits the batch alone"
        if args.batch % world:
            return f"--batch {args.batch} does not split evenly over {world} ranks: make it a multiple of {world}"
        return None
    if world % (args.tp * args.pp):
        return f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp} does not divide the world size {world}"
    dp = world // (args.tp * args.pp)
    if args.batch % dp:
        return f"--batch {args.batch} does not split over {dp} data-parallel replicas (world {world} / tp x pp)"
    if heads % args.tp:
        return f"--tp {args.tp} must divide the model's {heads} heads"
    if args.layers % args.pp:
        return f"--pp {args.pp} must divide --layers {args.layers} (each stage holds as many layers)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmedu.parallel.example", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=LAYOUTS, default="ddp")
    parser.add_argument("--ranks", type=int, default=2, help="processes to start (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="rows per step, over all data-parallel ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (layout 3d)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (layout 3d)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.steps < 1:
        parser.error("--ranks and --steps must be at least 1")
    world = int(os.environ.get("WORLD_SIZE", args.ranks))
    problem = layout_problem(args, world)
    if problem:  # before any process starts: one line, not a traceback from every rank
        parser.error(problem)
    settings = dict(
        layout=args.layout,
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        d_model=args.d_model,
        layers=args.layers,
        lr=args.lr,
        tp=args.tp,
        pp=args.pp,
    )
    results = launch(train, world, timeout=args.timeout, **settings)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps({"layout": args.layout, "world_size": world, "losses": [round(x, 5) for x in results[0]]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
