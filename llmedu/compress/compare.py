"""One table for lesson 22: every compression method applied to the same fine-tuned model, measured alike.

Each row is a model made from the fine-tuned base (``finetuned.py``) and measured three ways:

* **bytes on disk**: the length of its state dict written as one safetensors file. torch.ao's
  quantized modules keep their weights in packed C++ objects that safetensors cannot hold; for those
  the bytes of ``torch.save`` are reported instead (the row says so).
* **CPU latency per batch**: one fixed batch, a warm-up call, then the median (and minimum) of
  ``repeats`` timed forward passes under ``torch.no_grad``, at the thread count the caller set.
* **latency against a reference, paired** (``paired_latency``, what ``measure`` does when given
  ``reference=``, the fp32 base): the model and the reference are called alternately on the same batch,
  ``repeats`` pairs (the order flips from one pair to the next, so a host that slows down during a pair
  does not always penalise the same side), and the ratio is taken *within* each pair. A shared machine's
  speed drifts (this one by up to 2x in a day); rows timed alone at different moments carry that drift
  into "x fp32", pairs carry only what changes within one pair. The row keeps the median of the pair
  ratios and their smallest and largest, beside the model's own median and minimum time.
* **accuracy** on the validation split, with its binomial standard error ``accuracy_se``
  (sqrt(p(1 - p) / n) over n snippets: the sampling noise of one accuracy, not of a difference). The row
  keeps its per-snippet predictions: every row scores the same snippets, so a difference from the
  reference is paired, and ``report.paired_difference`` gives its standard error from the snippets that flip
  (McNemar's test), usually several times smaller than the sqrt(2) * se of two independent samples.

The builders: ``to_bf16``, ``int8_embeddings`` (the word-embedding table as int8 rows with an fp32
scale each: half of MiniLM's parameters are that table, and a model quantized only in its linear
layers keeps two thirds of its bytes), ``torch_ao_int8`` (``torch.ao.quantization.quantize_dynamic``,
torch's own int8 kernels), ``nf4_linears`` (the NF4 of ``qlora.py``, double-quantized, block 64), ``magnitude_pruned``, ``nm_pruned``, ``heads_pruned`` (really removed),
``student`` (distilled or on labels alone), and ``finetune`` (the same few steps for every
"+ fine-tuning" row, masks re-applied after each step).

Left out: GPU latency, sparse storage formats (a pruned matrix is stored dense: same bytes), and any
statistics beyond the spread of the pair ratios (no confidence interval of the median ratio, no test of
whether two rows differ in speed).
"""

from __future__ import annotations

import copy
import io
import math
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from . import pruning
from .distillation import DistillationLoss, make_student
from .finetuned import Batches, classification_loss
from .int8 import Int8Embedding

__all__ = [
    "Row",
    "file_bytes",
    "latency",
    "PairedTiming",
    "paired_latency",
    "accuracy_se",
    "predictions",
    "measure",
    "to_bf16",
    "Int8Embedding",
    "int8_embeddings",
    "nf4_linears",
    "torch_ao_int8",
    "finetune",
    "magnitude_pruned",
    "nm_pruned",
    "heads_pruned",
    "student",
    "pareto_front",
]


@dataclass
class Row:
    method: str
    detail: str  # bits or sparsity
    bytes: int
    latency_s: float  # median per batch
    latency_min_s: float
    accuracy: float
    note: str = ""
    ratio: float | None = None  # median of the per-pair ratios to the reference's time (None: not paired)
    ratio_lo: float | None = None  # the smallest pair ratio
    ratio_hi: float | None = None  # the largest
    predictions: torch.Tensor | None = None  # (n,) the predicted class of each validation snippet, in order


def file_bytes(model: nn.Module) -> tuple[int, str]:
    """(bytes, format): safetensors when every state entry is a tensor, else torch.save."""
    from safetensors.torch import save

    state = model.state_dict()
    if all(isinstance(v, torch.Tensor) and not v.is_quantized for v in state.values()):
        return len(save({k: v.contiguous() for k, v in state.items()})), "safetensors"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getbuffer().nbytes, "torch.save"


def _check_repeats(repeats) -> None:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")


def _timed_call(model: nn.Module, batch: dict, clock) -> float:
    start = clock()
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return clock() - start


@torch.no_grad()
def latency(model: nn.Module, batch: dict, repeats: int = 7, clock=time.perf_counter) -> tuple[float, float]:
    """(median, min) seconds of one forward pass over ``batch``, after one warm-up pass: absolute times,
    which carry the host's speed at the moment they are taken. ``clock``: seconds now (tests inject one)."""
    _check_repeats(repeats)
    model.eval()
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    times = [_timed_call(model, batch, clock) for _ in range(repeats)]
    return statistics.median(times), min(times)


@dataclass
class PairedTiming:
    median_s: float  # the model's own median and minimum time over the pairs
    min_s: float
    reference_median_s: float  # the reference's median over the same pairs
    ratio: float  # median over pairs of (model's time / reference's time in the same pair)
    ratio_lo: float  # smallest and largest pair ratio: their spread
    ratio_hi: float
    ratios: list[float]  # every pair's ratio, in the order timed


@torch.no_grad()
def paired_latency(
    model: nn.Module, reference: nn.Module, batch: dict, repeats: int = 7, clock=time.perf_counter
) -> PairedTiming:
    """Time ``model`` against ``reference`` in ``repeats`` pairs of calls on the same ``batch``.

    One warm-up call each (reference first), then pair i calls the reference and the model back to back,
    the reference first in even pairs and second in odd ones; the pair's ratio is model time / reference
    time. Drift of the host between pairs cancels in each ratio; drift within a pair does not, and the
    alternating order makes it show as spread (``ratio_lo`` .. ``ratio_hi``) instead of a constant bias.
    ``model`` may be ``reference`` itself: the spread of its ratios around 1 is the noise of the method.
    """
    _check_repeats(repeats)
    model.eval()
    reference.eval()
    for m in (reference, model):  # warm-up: first-call allocations and caches, untimed
        m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    own, ref = [], []
    for i in range(repeats):
        if i % 2 == 0:
            r = _timed_call(reference, batch, clock)
            t = _timed_call(model, batch, clock)
        else:
            t = _timed_call(model, batch, clock)
            r = _timed_call(reference, batch, clock)
        if r <= 0:
            raise ValueError(f"the reference took {r} s in pair {i}: too fast for this clock to time a ratio")
        own.append(t)
        ref.append(r)
    ratios = [t / r for t, r in zip(own, ref)]
    return PairedTiming(
        statistics.median(own),
        min(own),
        statistics.median(ref),
        statistics.median(ratios),
        min(ratios),
        max(ratios),
        ratios,
    )


def accuracy_se(p: float, n: int) -> float:
    """The binomial standard error sqrt(p (1 - p) / n) of an accuracy p measured on n examples."""
    if not 0 <= p <= 1 or isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"an accuracy in [0, 1] over n >= 1 examples, got p={p!r}, n={n!r}")
    return math.sqrt(p * (1 - p) / n)


@torch.no_grad()
def predictions(model: nn.Module, data: Batches) -> torch.Tensor:
    """(n,) int64: the argmax class of every snippet of ``data``, in order (one pass, eval mode)."""
    was_training = model.training
    model.eval()
    out = []
    for i in range(len(data)):
        b = data[i]
        out.append(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.argmax(-1))  # (B,)
    model.train(was_training)
    return torch.cat(out)[: len(data.texts)]


def measure(
    method: str,
    detail: str,
    model: nn.Module,
    data: Batches,
    batch: dict,
    repeats: int = 7,
    reference: nn.Module | None = None,
) -> Row:
    """One row: bytes, latency and accuracy of ``model``. With ``reference`` (the fp32 base), latency is
    ``paired_latency`` against it and the row holds the pair ratios; without, ``latency`` alone."""
    size, fmt = file_bytes(model)
    if reference is None:
        median, fastest = latency(model, batch, repeats)
        paired = {}
    else:
        timing = paired_latency(model, reference, batch, repeats)
        median, fastest = timing.median_s, timing.min_s
        paired = dict(ratio=timing.ratio, ratio_lo=timing.ratio_lo, ratio_hi=timing.ratio_hi)
    note = "" if fmt == "safetensors" else fmt
    predicted = predictions(model, data)  # (n,)
    correct = float((predicted == torch.tensor(data.labels)).float().mean())
    return Row(method, detail, size, median, fastest, correct, note, predictions=predicted, **paired)


def to_bf16(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).to(torch.bfloat16)


def int8_embeddings(model: nn.Module) -> nn.Module:
    """``model`` (in place) with its word-embedding table stored as ``Int8Embedding``."""
    model.bert.embeddings.word_embeddings = Int8Embedding(model.bert.embeddings.word_embeddings)
    return model


def nf4_linears(model: nn.Module, block_size: int = 64) -> nn.Module:
    """A copy with every nn.Linear stored in NF4 with double quantization (``llmedu.compress.qlora.NF4Linear``,
    computed in fp32: the weight is dequantized at each call, so NF4 saves bytes, not time, on a CPU)."""
    from .qlora import NF4Linear

    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, NF4Linear(module, block_size, True, torch.float32))
    return model.eval()


def torch_ao_int8(model: nn.Module) -> nn.Module:
    """torch's dynamic int8 quantization of every nn.Linear (fbgemm/oneDNN kernels on x86)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao announces its move to torchao
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)


def finetune(
    model: nn.Module, data: Batches, steps: int, lr: float = 5e-5, keep: tuple | None = None, seed: int = 0
) -> nn.Module:
    """``steps`` of AdamW on the labels; ``keep = (weights, masks)`` re-applies pruning masks after each.

    Seeded (dropout draws from the global generator), so that a row of the table is the same model
    whichever cell builds it.
    """
    from ..runtime import seed_everything
    from ..train.loop import TrainConfig, train

    if steps:
        seed_everything(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        callbacks = [lambda info: pruning.apply_masks(*keep)] if keep else []
        train(
            model,
            optimizer,
            data.__getitem__,
            classification_loss,
            TrainConfig(max_steps=steps, progress=False),
            callbacks=callbacks,
        )
    return model.eval()


def magnitude_pruned(
    model: nn.Module, ratio: float, scope: str = "global", data: Batches | None = None, steps: int = 0
):
    """A copy with the fraction ``ratio`` of its encoder's linear weights zeroed by magnitude."""
    model = copy.deepcopy(model)
    weights = pruning.linear_weights(model)
    masks = pruning.magnitude_masks(weights, ratio, scope)
    pruning.apply_masks(weights, masks)
    return finetune(model, data, steps, keep=(weights, masks)) if steps else model.eval()


def nm_pruned(model: nn.Module, n: int = 2, m: int = 4, data: Batches | None = None, steps: int = 0):
    model = copy.deepcopy(model)
    weights = pruning.linear_weights(model)
    masks = pruning.nm_masks(weights, n, m)
    pruning.apply_masks(weights, masks)
    return finetune(model, data, steps, keep=(weights, masks)) if steps else model.eval()


def heads_pruned(model: nn.Module, importance: torch.Tensor, ratio: float, data: Batches | None = None, steps: int = 0):
    """A copy without the fraction ``ratio`` of least important heads (at least one kept per layer)."""
    keep = pruning.heads_to_prune(importance, ratio)
    for layer in range(keep.shape[0]):  # a layer that lost every head keeps its most important one
        if not keep[layer].any():
            keep[layer, importance[layer].argmax()] = True
    model = copy.deepcopy(model)
    pruning.remove_heads(model, keep)
    return finetune(model, data, steps) if steps else model.eval()


def student(
    teacher: nn.Module,
    data: Batches,
    steps: int,
    distill: bool,
    lr: float = 1e-4,
    T: float = 2.0,
    callbacks=(),
    seed: int = 0,
    **alphas,
):
    """A student of every other teacher layer, trained ``steps`` steps by distillation or on labels
    (the same seed, data order and steps either way; ``seed`` draws the dropout masks)."""
    from ..train.loop import TrainConfig, train

    torch.manual_seed(seed)
    model = make_student(teacher).train()
    loss_fn = DistillationLoss(teacher, T=T, **alphas) if distill else classification_loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    config = TrainConfig(max_steps=steps, progress=False)
    history = train(model, optimizer, data.__getitem__, loss_fn, config, callbacks=callbacks)
    teacher.eval()
    return model.eval(), history


def pareto_front(rows: list[Row]) -> list[Row]:
    """Rows that no other row beats on both size (smaller) and accuracy (higher)."""
    return [
        r
        for r in rows
        if not any(
            o.bytes <= r.bytes and o.accuracy >= r.accuracy and (o.bytes, o.accuracy) != (r.bytes, r.accuracy)
            for o in rows
        )
    ]
