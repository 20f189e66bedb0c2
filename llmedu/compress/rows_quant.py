"""Lesson 22's whole-model quantization rows beyond plain int8 and NF4: LLM.int8, SmoothQuant, GPTQ and RTN.

``compare.py`` builds the table's other rows; the methods here need more than a model: a threshold, or
calibration text. Each builder returns a new model (the base is left alone) made of the layers that
``llm_int8.py``, ``smoothquant.py``, ``int8.py`` and ``gptq.py`` define, so that ``compare.measure`` can
write its state dict (real int8 or packed 4-bit codes, not fake-quantized fp32) and time it.

* ``llm_int8_linears``: every encoder linear as ``LLMInt8Linear`` (Dettmers et al. 2022, eq. 7): int8
  weights per output row; per call, the input columns with some |x| >= threshold in floating point, the
  rest in vector-wise int8. ``vectorwise_int8_linears``: the same layers with no decomposition (threshold
  infinite: every column in vector-wise int8, per-token activation scales, per-output-row weight scales),
  so that LLM.int8's row minus this row is what its float columns buy.
* ``w8a8_linears``: plain W8A8 with ``int8.QuantLinear`` (per-channel int8 weights, per-tensor dynamic
  activations) on every nn.Linear, pooler and classifier included, or on the encoder's alone
  (``encoder_only``), optionally keeping some kinds of encoder linear in fp32 (``fp32``, e.g. the FFN
  down-projection): the controls that separate one cause of W8A8's error from the others.
* ``smooth_linears`` / ``smoothquant_int8``: SmoothQuant's migration (Xiao et al. 2023, eq. 4) where a
  LayerNorm feeds linears, then ``w8a8_linears`` on the result, the same layers as the plain W8A8 row
  (every nn.Linear by default), so the smoothing is the only difference.
  In HF's post-LN ``BertLayer`` (``layernorm_fed_linears``): query, key and value read the block's
  input, which is the previous block's output LayerNorm (``layer[i-1].output.LayerNorm``; the
  embeddings' LayerNorm for block 0); the FFN up-projection (``intermediate.dense``) reads the attention
  output LayerNorm of its own block (``attention.output.LayerNorm``); ``attention.output.dense`` (the
  attention context) and ``output.dense`` (after GELU) read no LayerNorm and are quantized unsmoothed.
  Post-LN, those LayerNorm outputs are also the residual stream, so 1/s is not folded into them: a
  ``SmoothedLinear`` divides its own input.
* ``gptq_linears`` / ``rtn_linears``: every encoder linear stored as ``gptq.PackedLinear`` (4-bit codes
  two to a byte, a fp32 scale and a uint8 zero point per output row), its codes from GPTQ (Frantar et
  al. 2022, Algorithm 1) or round-to-nearest on the same grid. GPTQ runs block by block: each block's
  linears are calibrated on inputs computed by the blocks before it, already quantized (the paper's
  sequential order; inside a block every linear sees the fp32 block's inputs).

Calibration text is the training split's (``calibration_batches``), never the validation snippets the
table scores; activations at padded positions are left out of every statistic.

Left out: the pooler and the classifier stay fp32 in the LLM.int8, vector-wise, GPTQ and RTN rows (0.6 MB;
the W8A8 and SmoothQuant rows quantize them unless ``encoder_only``); static activation scales; GPTQ's grouping and act-order; fused kernels: every layer here runs as
separate torch operations (LLM.int8 splits, quantizes and multiplies per call; ``PackedLinear``
dequantizes its whole weight per call), so their latency is that of this code, not of bitsandbytes or
of a GPTQ int4 kernel.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import torch
from torch import nn

from ..peft.inject import replace_module
from .gptq import PackedLinear, _check_packed_bits, layer_error
from .int8 import QuantLinear
from .llm_int8 import LLMInt8Linear
from .smoothquant import SmoothedLinear, smoothing_scales

__all__ = [
    "calibration_batches",
    "encoder_linears",
    "layernorm_fed_linears",
    "outlier_tracked_inputs",
    "linear_inputs",
    "llm_int8_linears",
    "vectorwise_int8_linears",
    "w8a8_linears",
    "smooth_linears",
    "smoothquant_int8",
    "rtn_linears",
    "gptq_linears",
    "layer_errors",
    "w8a8_layer_errors",
    "logit_errors",
    "logit_error",
]


def calibration_batches(n_snippets: int = 256, batch_size: int = 32, max_len: int = 64, seed: int = 4) -> list[dict]:
    """The first ``n_snippets`` of the Rotten Tomatoes *training* split (shuffled by ``seed``), as padded
    batches of ``input_ids``/``attention_mask``/``labels``: calibration never reads validation text."""
    from .finetuned import rotten_tomatoes

    if n_snippets < 1:
        raise ValueError(f"n_snippets must be >= 1, got {n_snippets}")
    data = rotten_tomatoes("train", batch_size, max_len, limit=n_snippets, seed=seed)
    return [data[i] for i in range(len(data))]


def _batches(calibration_batches: Iterable[dict] | None, who: str) -> list[dict]:
    batches = list(calibration_batches or [])
    if not batches:
        raise ValueError(f"{who} needs calibration batches (from the training split: calibration_batches()), got none")
    return batches


def encoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """name -> nn.Linear for every linear layer of ``model.bert.encoder`` (6 per block)."""
    if not hasattr(model, "bert"):
        raise TypeError(f"expected a transformers BERT model with a .bert attribute, got {type(model).__name__}")
    found = {f"bert.encoder.{n}": m for n, m in model.bert.encoder.named_modules() if isinstance(m, nn.Linear)}
    if not found:
        raise ValueError(f"{type(model).__name__} has no nn.Linear in its encoder")
    return found


def layernorm_fed_linears(model: nn.Module) -> list[tuple[str, list[str]]]:
    """(LayerNorm name, names of the linears that read its output), for HF's post-LN ``BertLayer``."""
    groups = []
    for i in range(len(model.bert.encoder.layer)):
        block = f"bert.encoder.layer.{i}"
        previous = "bert.embeddings.LayerNorm" if i == 0 else f"bert.encoder.layer.{i - 1}.output.LayerNorm"
        groups.append((previous, [f"{block}.attention.self.{p}" for p in ("query", "key", "value")]))
        groups.append((f"{block}.attention.output.LayerNorm", [f"{block}.intermediate.dense"]))
    return groups


def outlier_tracked_inputs(model: nn.Module) -> tuple[list[str], list[int]]:
    """(names, layers): the linears whose inputs are the hidden states LLM.int8's outlier criterion tracks in
    HF's ``BertLayer`` (Dettmers et al. 2022, Section 4.1: the attention projections and the FFN expansion,
    not the FFN contraction), three a block: ``query`` (query, key and value read one tensor: counted once),
    ``attention.output.dense`` and ``intermediate.dense``; ``layers`` gives each one's block."""
    if not hasattr(model, "bert"):
        raise TypeError(f"expected a transformers BERT model with a .bert attribute, got {type(model).__name__}")
    kinds = ("attention.self.query", "attention.output.dense", "intermediate.dense")
    blocks = range(len(model.bert.encoder.layer))
    return [f"bert.encoder.layer.{i}.{k}" for i in blocks for k in kinds], [i for i in blocks for _ in kinds]


class _Stop(Exception):
    """Raised by a hook to end a forward pass once everything asked for has been seen."""


@torch.no_grad()
def linear_inputs(
    model: nn.Module, batches: list[dict], names: Iterable[str], stop_after: str | None = None
) -> dict[str, torch.Tensor]:
    """name -> (N, d_in): the inputs the named modules receive on ``batches``, at real (unpadded) tokens.
    ``stop_after``: a module after which each forward pass is cut short (nothing later is needed)."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    mask = {}

    def record(name):
        def hook(module, args):
            seen[name].append(args[0][mask["m"]].float())  # (B, T, d) -> (real tokens, d)

        return hook

    def stop(module, args, output):
        raise _Stop

    handles = [model.get_submodule(n).register_forward_pre_hook(record(n)) for n in seen]
    if stop_after is not None:
        handles.append(model.get_submodule(stop_after).register_forward_hook(stop))
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            mask["m"] = batch["attention_mask"].bool()  # (B, T)
            try:
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {name: torch.cat(xs) for name, xs in seen.items()}


def llm_int8_linears(model: nn.Module, threshold: float = 6.0) -> nn.Module:
    """A copy with every encoder linear an ``LLMInt8Linear`` (outlier columns at |x| >= threshold in fp32)."""
    if not threshold > 0:
        raise ValueError(f"the outlier threshold must be positive, got {threshold}")
    model = copy.deepcopy(model)
    for name, linear in encoder_linears(model).items():
        replace_module(model, name, LLMInt8Linear(linear, threshold))
    return model.eval()


def vectorwise_int8_linears(model: nn.Module) -> nn.Module:
    """A copy with every encoder linear an ``LLMInt8Linear`` without outlier columns (threshold infinite):
    vector-wise int8, the int8 half of LLM.int8 alone."""
    return llm_int8_linears(model, threshold=math.inf)


def w8a8_linears(model: nn.Module, encoder_only: bool = False, fp32: Iterable[str] = ()) -> nn.Module:
    """A copy with nn.Linear layers as ``QuantLinear`` (per-channel weights): every one (the pooler and the
    classifier too), or only the encoder's; ``fp32`` names kinds of encoder linear left unquantized, by their
    name inside a block (``"output.dense"`` is the FFN down-projection, not ``"attention.output.dense"``)."""
    model = copy.deepcopy(model).eval()
    kinds = set(fp32)
    block_kinds = {n.split(".", 4)[-1] for n in encoder_linears(model)}
    if unknown := kinds - block_kinds:
        raise ValueError(
            f"fp32 names {sorted(unknown)}, not a kind of encoder linear: choose from {sorted(block_kinds)}"
        )
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or (encoder_only and not name.startswith("bert.encoder.")):
            continue
        kind = name.removesuffix(".linear").split(".", 4)[-1]  # a SmoothedLinear's inner layer counts as its own
        if name.startswith("bert.encoder.") and kind in kinds:
            continue
        replace_module(model, name, QuantLinear.from_linear(module, per_channel=True))
    return model


def smooth_linears(model: nn.Module, calibration_batches: Iterable[dict], alpha: float = 0.5) -> nn.Module:
    """A copy with SmoothQuant's migration and no quantization: every linear that reads a LayerNorm becomes
    a ``SmoothedLinear`` with s from the maxima of its input on the calibration batches (one s per
    LayerNorm, shared by the linears that read it). Equal to ``model`` up to float rounding."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"the migration strength alpha must lie in [0, 1], got {alpha}")
    batches = _batches(calibration_batches, "smooth_linears")
    model = copy.deepcopy(model).eval()
    groups = layernorm_fed_linears(model)
    inputs = linear_inputs(model, batches, [linears[0] for _, linears in groups])  # one reader per LayerNorm
    for _, linears in groups:
        act_absmax = inputs[linears[0]].abs().amax(dim=0)  # (d_in,) over every real calibration token
        modules = [model.get_submodule(n) for n in linears]
        s = smoothing_scales(act_absmax, [m.weight for m in modules], alpha)  # (d_in,)
        for name, module in zip(linears, modules):
            replace_module(model, name, SmoothedLinear(module, s))
    return model


def smoothquant_int8(
    model: nn.Module,
    calibration_batches: Iterable[dict],
    alpha: float = 0.5,
    encoder_only: bool = False,
    fp32: Iterable[str] = (),
) -> nn.Module:
    """``smooth_linears``, then ``w8a8_linears`` (every nn.Linear, smoothed or not, pooler and classifier
    included unless ``encoder_only``): the plain W8A8 model with the migration added."""
    return w8a8_linears(smooth_linears(model, calibration_batches, alpha), encoder_only, fp32)


def rtn_linears(model: nn.Module, bits: int = 4) -> nn.Module:
    """A copy with every encoder linear rounded to nearest and stored as ``PackedLinear`` codes."""
    _check_packed_bits(bits)
    model = copy.deepcopy(model)
    for name, linear in encoder_linears(model).items():
        replace_module(model, name, PackedLinear.rtn(linear, bits))
    return model.eval()


def gptq_linears(
    model: nn.Module, calibration_batches: Iterable[dict], bits: int = 4, damp: float = 0.01, block_size: int = 128
) -> nn.Module:
    """A copy with every encoder linear quantized by GPTQ and stored as ``PackedLinear`` codes, block by
    block: block i's linears are calibrated on what blocks 0..i-1, already quantized, give them."""
    _check_packed_bits(bits)
    batches = _batches(calibration_batches, "gptq_linears")
    model = copy.deepcopy(model).eval()
    linears = encoder_linears(model)
    for i in range(len(model.bert.encoder.layer)):
        names = [n for n in linears if n.startswith(f"bert.encoder.layer.{i}.")]
        # one pass through blocks 0..i (the earlier ones already quantized), stopped after block i
        inputs = linear_inputs(model, batches, names, stop_after=f"bert.encoder.layer.{i}")
        for name in names:
            replace_module(
                model, name, PackedLinear.gptq(linears[name], inputs[name], bits, damp=damp, block_size=block_size)
            )
    return model


def layer_errors(reference: nn.Module, quantized: nn.Module, batches: list[dict]) -> dict[str, float]:
    """name -> ``gptq.layer_error`` of each encoder ``PackedLinear`` of ``quantized`` against the same
    layer of ``reference``, on the inputs the fp32 ``reference`` gives that layer on ``batches``."""
    names = [n for n, m in quantized.named_modules() if isinstance(m, PackedLinear)]
    inputs = linear_inputs(reference, batches, names)
    return {
        n: layer_error(reference.get_submodule(n).weight, quantized.get_submodule(n).dequantized_weight(), inputs[n])
        for n in names
    }


@torch.no_grad()
def w8a8_layer_errors(model: nn.Module, smoothed: nn.Module, batches: list[dict]) -> dict[str, tuple[float, float]]:
    """name -> (plain, smoothed): for every LayerNorm-fed linear, ||Y_q - Y|| / ||Y|| of its W8A8 output
    (``QuantLinear``, per-channel weights) on the fp32 model's inputs, without and with the migration
    that ``smoothed`` (from ``smooth_linears``) holds for it: what SmoothQuant changes, layer by layer."""
    names = [n for _, linears in layernorm_fed_linears(model) for n in linears]
    inputs = linear_inputs(model, batches, names)
    errors = {}
    for name in names:
        x, linear, wrapped = inputs[name], model.get_submodule(name), smoothed.get_submodule(name)  # x (N, d_in)
        exact = linear(x)  # (N, d_out)
        plain = QuantLinear.from_linear(linear, per_channel=True)(x)
        smooth = QuantLinear.from_linear(wrapped.linear, per_channel=True)(x * wrapped.inverse_scale)
        errors[name] = (float((plain - exact).norm() / exact.norm()), float((smooth - exact).norm() / exact.norm()))
    return errors


@torch.no_grad()
def logit_errors(reference: nn.Module, models: dict[str, nn.Module], batches: list[dict]) -> dict[str, float]:
    """name -> ||z - z_ref|| / ||z_ref|| over the logits of every snippet of ``batches``: how far each quantized
    model's outputs move, finer than accuracy, which only sees the argmax. The reference runs once."""
    batches = list(batches)

    def logits(model):
        return torch.cat(
            [model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float() for b in batches]
        )

    ref = logits(reference)  # (N, classes)
    return {name: float((logits(m) - ref).norm() / ref.norm()) for name, m in models.items()}


def logit_error(reference: nn.Module, model: nn.Module, batches: list[dict]) -> float:
    """``logit_errors`` for one model."""
    return logit_errors(reference, {"model": model}, batches)["model"]
