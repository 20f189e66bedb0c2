"""Where the norm sits, trained: a placement x depth grid over several seeds, with its collapses counted.

Xiong et al. (2020, "On Layer Normalization in the Transformer Architecture", sec. 3.3 and fig. 2)
train post-LN transformers with Adam from a constant learning rate and see them fail, while a linear
learning-rate warm-up rescues them and pre-LN needs none. One run of a small model is one chaotic
trajectory: another initialisation, or another thread count, can flip it. So this module trains every
cell of a (variant, depth) grid from several initialisations (the batches stay the same) and counts.

A run **collapses** when its final held-out loss is not finite, or is above ``baseline - margin``:
``baseline`` is the loss of predicting every token by its frequency in the training text, with no
context (``unigram_loss``), so a collapsed model has learnt nothing that uses context. A run is read
once, at its last step; ``Run.curve`` keeps its training losses, and ``first_step_below`` reads from them
when (if ever) the run left the baseline.
``same_state`` shows how: the mean cosine between the final hidden states of all held-out positions
is 1 when the model maps every context to one state, and so predicts one distribution everywhere.

    variants = [Variant("post"), Variant("post", warmup=150), Variant("post", lr=1e-3), Variant("pre")]
    runs = run_grid(cfg, variants, depths=[2, 8], seeds=[0, 1, 2], steps=300, lr=3e-3,
                    batches=lambda i: ..., held_out=ids)
    collapse_counts(runs, baseline)  # {(variant name, depth): (collapsed, runs)}

Left out: learning-rate sweeps, gradient clipping, and training long enough to see whether a
collapsed run ever recovers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import runtime
from ..models import CausalLM, TransformerConfig
from ..models.gpt import lm_loss
from ..train import TrainConfig, train
from ..train.schedules import warmup_linear

__all__ = ["Variant", "Run", "COLLAPSE_MARGIN", "unigram_loss", "same_state", "collapsed", "train_run", "run_grid"]
__all__ += ["collapse_counts", "first_step_below", "build_model"]

COLLAPSE_MARGIN = 0.1  # nats/token below the no-context baseline that a run must reach to count as learning


@dataclass(frozen=True)
class Variant:
    """A norm placement (``pre``, ``post``, ``deepnorm``) and how it is trained.

    ``warmup``: steps of linear warm-up (0: none). ``lr``: this variant's learning rate (None: the grid's).
    ``scaled_init=False``: ``o_proj`` and ``down_proj`` start at ``init_std`` like every other matrix, without
    GPT-2's 1/sqrt(2L) (a control for it; DeepNorm has an initialisation of its own, so it keeps it).
    """

    placement: str
    warmup: int = 0
    lr: float | None = None
    scaled_init: bool = True

    def __post_init__(self):
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"Variant({self.placement!r}): lr must be positive or None, got {self.lr}")
        if not self.scaled_init and self.placement == "deepnorm":
            raise ValueError("Variant('deepnorm', scaled_init=False): DeepNorm uses DeepNet's initialisation")

    @property
    def name(self) -> str:
        name = self.placement + (f" + warm-up {self.warmup}" if self.warmup else "")
        name += f" at lr {self.lr:g}" if self.lr is not None else ""
        return name + ("" if self.scaled_init else ", init 0.02")


@dataclass
class Run:
    """One trained model: which cell and seed, its training losses, held-out loss and state cosine."""

    variant: str
    n_layers: int
    seed: int
    valid_loss: float
    cosine: float
    curve: list[float] = field(default_factory=list, repr=False)


def unigram_loss(train_tokens: torch.Tensor, held_out: torch.Tensor, vocab_size: int) -> float:
    """Held-out loss (nats/token) of predicting every token by its add-one smoothed training frequency."""
    counts = torch.bincount(train_tokens.flatten().cpu(), minlength=vocab_size).double() + 1
    log_p = (counts / counts.sum()).log()
    return -log_p[held_out[:, 1:].flatten().cpu()].mean().item()  # the first token of a row is not predicted


@torch.no_grad()
def same_state(model: CausalLM, held_out: torch.Tensor) -> float:
    """Mean cosine between the final hidden states of all held-out positions: 1.0 is one state for all."""
    h = model.transformer(held_out).flatten(0, 1)  # (B * T, d)
    h = F.normalize(h.float(), dim=-1)
    return (h @ h.T).mean().item()


def collapsed(valid_loss: float, baseline: float, margin: float = COLLAPSE_MARGIN) -> bool:
    """True when a run ended non-finite or above ``baseline - margin`` (see the module docstring)."""
    if not math.isfinite(baseline) or margin < 0:
        raise ValueError(f"need a finite baseline and a margin >= 0, got baseline={baseline}, margin={margin}")
    return not math.isfinite(valid_loss) or valid_loss > baseline - margin


def build_model(cfg: TransformerConfig, variant: Variant) -> CausalLM:
    """``cfg`` with ``variant``'s placement, initialised as the variant says (from the current RNG state)."""
    model = CausalLM(dataclasses.replace(cfg, norm_placement=variant.placement))
    if not variant.scaled_init:  # undo GPT-2's 1/sqrt(2L) on the projections into the residual stream
        with torch.no_grad():
            for block in model.transformer.blocks:
                for proj in (block.attn.o_proj, block.mlp.down_proj):
                    proj.weight.normal_(0.0, cfg.init_std)
    return model


def train_run(
    cfg: TransformerConfig,
    variant: Variant,
    steps: int,
    lr: float,
    batches: Callable[[int], torch.Tensor],
    held_out: torch.Tensor,
    seed: int,
) -> Run:
    """Train ``cfg`` with ``variant``'s placement under Adam at ``lr`` (or the variant's), as ``variant`` says."""
    if variant.warmup >= steps:
        raise ValueError(f"{variant.name}: the warm-up ({variant.warmup} steps) must be shorter than the run ({steps})")
    runtime.seed_everything(seed)  # the seed sets the initialisation; batches(i) is the same in every run
    model = build_model(cfg, variant).to(held_out.device)
    schedule = warmup_linear(variant.warmup, steps, final=1.0) if variant.warmup else None
    config = TrainConfig(max_steps=steps, progress=False, schedule=schedule)
    optimizer = torch.optim.Adam(model.parameters(), lr=variant.lr if variant.lr is not None else lr)
    try:
        curve = train(model, optimizer, batches, lambda m, ids: lm_loss(m(ids), ids), config)["loss"]
    except FloatingPointError:  # a non-finite loss stops the trainer: the run counts as collapsed
        return Run(variant.name, cfg.n_layers, seed, float("nan"), float("nan"))
    model.eval()
    with torch.no_grad():
        valid = lm_loss(model(held_out), held_out).item()
    return Run(variant.name, cfg.n_layers, seed, valid, same_state(model, held_out), list(curve))


def run_grid(cfg, variants, depths, seeds, steps, lr, batches, held_out, on_run=None) -> list[Run]:
    """``train_run`` for every variant, depth and seed; ``on_run(run)`` after each (e.g. to print it)."""
    runs = []
    for n_layers in depths:
        for variant in variants:
            for seed in seeds:
                run = train_run(
                    dataclasses.replace(cfg, n_layers=n_layers), variant, steps, lr, batches, held_out, seed
                )
                runs.append(run)
                if on_run is not None:
                    on_run(run)
    return runs


def collapse_counts(runs: list[Run], baseline: float, margin: float = COLLAPSE_MARGIN) -> dict:
    """``{(variant name, depth): (collapsed runs, runs)}`` in the order the runs came."""
    counts: dict[tuple[str, int], tuple[int, int]] = {}
    for run in runs:
        bad, total = counts.get((run.variant, run.n_layers), (0, 0))
        counts[run.variant, run.n_layers] = (bad + collapsed(run.valid_loss, baseline, margin), total + 1)
    return counts


def first_step_below(curve: list[float], baseline: float, margin: float = COLLAPSE_MARGIN, window: int = 10):
    """The first step (1-based) whose moving average over the last ``window`` losses is ``margin`` below
    ``baseline``; None if the curve never gets there. Reads when a run left the no-context line."""
    if window < 1 or len(curve) < window:
        raise ValueError(f"need 1 <= window <= len(curve), got window={window}, {len(curve)} losses")
    losses = torch.tensor(curve, dtype=torch.float64)
    means = losses.unfold(0, window, 1).mean(-1)  # means[i]: steps i+1 .. i+window
    below = (means < baseline - margin).nonzero()
    return int(below[0, 0]) + window if len(below) else None
