"""The crammed BERT recipe and the original one, as data: every trick of Cramming is one switch.

Geiping & Goldstein (2022), "Cramming: Training a Language Model on a Single GPU in One Day",
keep BERT's shape and objective and change what makes a fixed budget go further (their sec. 4):

    architecture   pre-LN (stable at a high learning rate), no biases in linear layers and norms,
                   a gated GELU feed-forward (GEGLU), scaled sinusoidal positions, no dropout
    objective      "sparse prediction": run the output head on the masked tokens only
    training       AdamW; a triangular learning rate whose length is the *budget* (ours peaks at half),
                   since the number of steps is not known in advance; gradient clipping at 0.5;
                   a batch that grows via accumulation until 60% of the budget; bf16 where the
                   hardware has it
    implementation fused kernels for the norms and activations

A ``Recipe`` holds the encoder it trains as a ``TransformerConfig`` (``recipe.model``: BERT's preset,
``TransformerConfig.bert``, with the architecture tricks applied) and adds the objective and the
training settings. ``crammed(**overrides)`` and ``original_bert(**overrides)`` take fields of either:
``crammed(d_model=256, lr=5e-4)``.

The GEGLU width follows the authors' code (``FFNComponent`` of github.com/JonasGeiping/cramming):
BERT's first projection, 4 * d_model wide, is split into a value half and a gate half, so the gated
FFN has 3/4 of the plain FFN's weights (3 matrices of d x 2d instead of 2 of d x 4d), not more.

``original_bert`` is the baseline at the same shape: post-LN, biases, exact GELU, learned
positions, dropout 0.1, the head over every position, warm-up then linear decay (Devlin et al.
2019, appendix A.2). ``ABLATIONS`` turns one crammed trick back at a time, for the ablation table.

Left out: the paper's data filtering and sorting, ``torch.compile``, and its vocabulary of 32768
(a CPU cannot use it in minutes); sizes here are for a CPU, and the CUDA shape is BERT-base. The
authors' last settings (``bert-o4``) also mask 25% of the tokens and shape the rate as a ramp from a
quarter of its peak up to the peak at 75% of the budget; we keep BERT's 15% and a symmetric
triangle (peak at half the budget).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from .. import kernels  # noqa: F401  (registers "flash", which a saved recipe may name)
from ..models import TransformerConfig
from ..nn.activations import GATED
from ..nn.attention import ATTENTION_FUNCTIONS
from ..train.schedules import Schedule

__all__ = [
    "Recipe",
    "encoder",
    "crammed",
    "original_bert",
    "CRAMMED_ARCHITECTURE",
    "ABLATIONS",
    "TINY_SHAPE",
    "CUDA_SHAPE",
    "parse_budget",
    "BudgetClock",
    "budget_schedule",
    "budget_accumulation",
]


# -- the encoder ---------------------------------------------------------------------------------
# What both recipes' encoders share, at the CPU shape: rows of 128 tokens, one segment (packed text,
# no sentence pairs), a WordPiece vocabulary of 4096 trained on the corpora, torch's one-kernel norms
# and GELU (an implementation choice, in both recipes). Attention: "math", "sdpa" or "flash" (import
# llmedu.kernels). "math" on a CPU: torch's fused CPU kernel is no faster in fp32, and its bf16
# backward is ~6x its forward (torch 2.13); CUDA_SHAPE asks for "sdpa".
_CPU_ENCODER = dict(
    vocab_size=4096,
    d_model=128,
    n_layers=4,
    n_heads=4,
    max_seq_len=128,
    type_vocab_size=0,
    attn_impl="math",
    fused=True,
)
# Cramming's changes to BERT's architecture (the paper's sec. 4.2); dropout stays at the config's 0
CRAMMED_ARCHITECTURE = dict(norm_placement="pre", bias=False, activation="geglu", position="scaled_sinusoidal")


def encoder(**fields) -> TransformerConfig:
    """BERT's encoder (``TransformerConfig.bert``) at the CPU shape, with one segment, changed by ``fields``.

    Unless ``fields`` give ``d_ff``, the FFN is BERT's: 4 * d_model wide, split into value and gate
    halves of 2 * d_model when the activation is gated (the authors' GEGLU, see the module docstring).
    """
    config = TransformerConfig.bert(**{**_CPU_ENCODER, **fields})
    if config.activation in GATED and "d_ff" not in fields:
        config = replace(config, d_ff=config.d_ff // 2)
    return config


@dataclass(frozen=True)
class Recipe:
    name: str = "crammed"
    model: TransformerConfig = field(default_factory=lambda: encoder(**CRAMMED_ARCHITECTURE))  # what MaskedLM builds
    # objective
    sparse_prediction: bool = True  # the head decodes only the masked positions
    mask_rate: float = 0.15
    mask_fraction: float = 0.8  # of the chosen tokens: [MASK]
    random_fraction: float = 0.1  # of the chosen tokens: a random token (the rest stay)
    # optimisation
    schedule: str = "one_cycle"  # "one_cycle" (triangular, tied to the budget) or "linear" (warm-up, decay)
    lr: float = 1e-3
    warmup: float = 0.1  # linear schedule: fraction of the budget spent warming up
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    clip_grad_norm: float | None = 0.5
    micro_batch: int = 64  # sequences per forward: 64 x 128 tokens keep a 2-core CPU's small matmuls efficient
    accumulation: int = 2  # micro-batches per step at full batch: 16,384 tokens on a CPU; CUDA_SHAPE: 196,608
    batch_ramp: float = 0.6  # the batch grows linearly to full over this fraction of the budget (0: fixed)
    precision: str = "auto"  # "auto": bf16 where the device multiplies it natively (see resolved_precision)

    def __post_init__(self):
        if self.schedule not in ("one_cycle", "linear"):
            raise ValueError(f"schedule must be 'one_cycle' or 'linear', got {self.schedule!r}")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be auto, fp32, bf16 or fp16, got {self.precision!r}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup is a fraction of the budget in [0, 1), got {self.warmup}")
        if not 0 <= self.batch_ramp <= 1:
            raise ValueError(f"batch_ramp is a fraction of the budget in [0, 1], got {self.batch_ramp}")

    def resolved_precision(self, device: torch.device) -> str:
        """``precision``, with "auto" resolved: bf16 autocast where the hardware multiplies bf16 natively.

        That is a GPU with bf16 (fp16 with loss scaling on older ones), or a CPU with AVX512-BF16 or
        AMX. Elsewhere fp32, since emulated bf16 is slower than fp32.
        """
        if self.precision != "auto":
            return self.precision
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        if device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
            return "bf16"
        return "fp32"

    def settings(self) -> dict:
        """Every setting in one flat dict: the name, the model's fields, then the recipe's own."""
        values = self.to_dict()
        return {"name": values.pop("name"), **values.pop("model"), **values}

    def differences(self, other: Recipe) -> dict[str, tuple]:
        """{setting: (self's value, other's value)} for every setting that differs, the model's included."""
        a, b = self.settings(), other.settings()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}

    def to_dict(self) -> dict:
        return asdict(self)  # the model as a nested dict

    @classmethod
    def from_dict(cls, values: dict) -> Recipe:
        """The inverse of ``to_dict``; also reads the flat recipes of run folders saved before ``model``."""
        values = _unflatten(values) if "seq_len" in values else dict(values)  # seq_len: the flat layout
        _check_names("recipe fields", values, [f.name for f in fields(cls)])
        if isinstance(values.get("model"), dict):
            _check_names("model fields", values["model"], [f.name for f in fields(TransformerConfig)])
            impl = values["model"].get("attn_impl", "sdpa")
            _check_names("attention implementation", [impl], sorted(ATTENTION_FUNCTIONS))
            values["model"] = TransformerConfig(**values["model"])
        if "betas" in values:
            values["betas"] = tuple(values["betas"])  # JSON has lists only
        return cls(**values)


def _check_names(kind: str, names, allowed: list[str]) -> None:
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {kind} {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}")


def _unflatten(values: dict) -> dict:
    """A recipe saved before it held its TransformerConfig: the model's settings sat among the recipe's,
    with seq_len for max_seq_len and d_ff as the width of BERT's first projection (halved when gated)."""
    own = {f.name for f in fields(Recipe)}
    model = {k: v for k, v in values.items() if k not in own}
    model["max_seq_len"] = model.pop("seq_len")
    if model["activation"] in GATED:
        model["d_ff"] //= 2
    return {**{k: v for k, v in values.items() if k in own}, "model": encoder(**model)}


def _split(overrides: dict) -> tuple[dict, dict]:
    """``overrides`` -> (fields of the TransformerConfig, fields of the Recipe)."""
    model_fields = {f.name for f in fields(TransformerConfig)}
    model = {k: v for k, v in overrides.items() if k in model_fields}
    return model, {k: v for k, v in overrides.items() if k not in model_fields}


def crammed(**overrides) -> Recipe:
    """The crammed recipe (all tricks on) at the CPU shape; ``overrides`` set fields of the model or the recipe."""
    model, recipe = _split(overrides)
    return Recipe(**{"name": "crammed", **recipe, "model": encoder(**{**CRAMMED_ARCHITECTURE, **model})})


def original_bert(**overrides) -> Recipe:
    """BERT's own recipe at the same shape: its preset's architecture, dropout 0.1, every crammed trick off."""
    model, recipe = _split(overrides)
    settings = dict(
        name="original",
        sparse_prediction=False,
        schedule="linear",
        lr=1e-4,
        betas=(0.9, 0.999),
        clip_grad_norm=None,
        batch_ramp=0.0,
    )
    return Recipe(**{**settings, **recipe, "model": encoder(**{"dropout": 0.1, **model})})


# Shapes: overrides of the model's size and of the batch, for crammed() or original_bert().
TINY_SHAPE = dict(d_model=64, n_layers=2, n_heads=2, vocab_size=1024, micro_batch=16, accumulation=1)
CUDA_SHAPE = dict(
    d_model=768,
    n_layers=12,
    n_heads=12,
    vocab_size=32768,
    micro_batch=128,
    accumulation=12,
    attn_impl="sdpa",
)  # the fused flash kernel on a GPU


# One trick undone at a time, as overrides of crammed(); post-LN is only stable at a lower rate, so
# that row lowers it too.
ABLATIONS: dict[str, dict] = {
    "crammed": {},
    "post-LN": dict(norm_placement="post", lr=1e-4),
    "with biases": dict(bias=True),
    "GELU FFN (no gate)": dict(activation="gelu"),  # BERT's 4d-wide FFN, unsplit
    "learned positions": dict(position="learned"),
    "full prediction": dict(sparse_prediction=False),
    "dropout 0.1": dict(dropout=0.1),
    "linear schedule": dict(schedule="linear"),
    "fixed batch (no ramp)": dict(batch_ramp=0.0),
    "written-out norm and GELU": dict(fused=False),
}


# -- the budget ----------------------------------------------------------------------------------
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_budget(text: str) -> float:
    """'30s', '10m', '24h', '1.5h' or a bare number of seconds -> seconds (positive)."""
    match = re.fullmatch(r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([smhd]?)\s*", str(text))
    if not match:
        raise ValueError(f"cannot parse the budget {text!r}: write a number with a unit, e.g. 30s, 10m, 24h")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if seconds <= 0:
        raise ValueError(f"the budget must be positive, got {text!r}")
    return seconds


class BudgetClock:
    """How much of the budget is spent: the larger of elapsed/seconds and steps/max_steps.

    The trainer's schedules are functions of the step; a wall-clock budget does not say how many
    steps there will be. The clock is fed each step's elapsed time by a callback (``tick``), and
    ``budget_schedule`` reads the fraction from it: the learning rate follows the clock.
    """

    def __init__(self, seconds: float | None, max_steps: int | None = None, elapsed: float = 0.0):
        if seconds is None and max_steps is None:
            raise ValueError("a budget needs seconds, max_steps or both")
        self.seconds, self.max_steps, self.elapsed = seconds, max_steps, elapsed

    def tick(self, info) -> None:  # a trainer callback
        self.elapsed = info.elapsed

    def fraction(self, step: int) -> float:
        parts = []
        if self.seconds is not None:
            parts.append(self.elapsed / self.seconds)
        if self.max_steps is not None:
            parts.append(step / self.max_steps)
        return min(1.0, max(parts))


def budget_schedule(recipe: Recipe, clock: BudgetClock) -> Schedule:
    """step -> lr multiplier, as a function of the budget spent (``clock.fraction``).

    one_cycle: linear up from 0 to 1 over the first half, linear down to 0 over the second (ours: a
    symmetric triangle; the authors' released configs use ``budget-triangle2``, which starts at 25% of
    the peak and peaks at 75% of the budget); linear: up over ``recipe.warmup``, then down to 0 (BERT).
    """
    peak = 0.5 if recipe.schedule == "one_cycle" else recipe.warmup

    def factor(step: int) -> float:
        f = clock.fraction(step)
        if f < peak:
            return max(f / peak, 1e-3)  # never exactly 0: the first step still moves
        return max(1.0 - (f - peak) / (1.0 - peak), 0.0)

    return factor


def budget_accumulation(recipe: Recipe, clock: BudgetClock):
    """step -> micro-batches in that step: 1 at the start, growing linearly with the budget spent
    to ``recipe.accumulation`` at ``recipe.batch_ramp`` of it (the authors' bert-o4 setting: 60%).
    Rounded up to whole micro-batches, so the ramp is a staircase whose last step is reached at
    ``batch_ramp x (accumulation - 1) / accumulation``: with the CPU recipe's 2, one jump at 30%.

    Small batches early are cheap steps while the gradient is large and consistent; the larger
    batch later averages the noise that limits progress near the end (McCandlish et al. 2018).
    """
    full = recipe.accumulation
    if recipe.batch_ramp == 0 or full == 1:
        return full

    def micro_batches(step: int) -> int:
        return max(1, min(full, math.ceil(full * clock.fraction(step) / recipe.batch_ramp)))

    return micro_batches
