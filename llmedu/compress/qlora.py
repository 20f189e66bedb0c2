"""QLoRA: LoRA adapters trained on top of a frozen base whose linear layers are stored in 4-bit NF4.

Dettmers, Pagnoni, Holtzman & Zettlemoyer 2023, "QLoRA: Efficient Finetuning of Quantized LLMs",
eq. 5:

    Y = X dequant(W_NF4) + s X A^T B^T        W_NF4 frozen (4.127 bits per weight), A, B trained

The base weight is never stored in 16 or 32 bits: each call dequantizes it (``nf4.py``) into the
compute dtype (bf16 in the paper), multiplies, and drops it. The backward pass needs W again for
dX = dY W; a plain ``F.linear`` would keep the dequantized W alive from forward to backward, so
``_NF4Matmul`` saves nothing but a reference to the 4-bit layer and dequantizes a second time in
backward. Gradients reach A and B (and flow through to earlier layers); W gets none.

``apply_qlora`` quantizes every ``nn.Linear`` of the model except the ones named in ``skip`` (a new
classifier head must stay trainable) and puts a LoRA adapter on the ``targets``. The adapter layer
follows ``llmedu.peft.lora.LoRALinear`` (same A/B names, initialisation and scaling), and marks
itself ``peft_method = "lora"`` so that ``llmedu.peft``'s ``freeze_base``, ``count_parameters`` and
``save_adapter`` treat it as a LoRA layer.

``compare_on_rotten_tomatoes`` is the lesson's experiment: all-MiniLM-L6-v2 fine-tuned on Rotten
Tomatoes with LoRA on a bf16 base and with QLoRA on an NF4 base, the same steps and seeds; it
returns accuracy, bytes of the base weights, peak memory of a training step and time per step, and the
two methods' step times *paired* (``paired_step_times``: one step of each, back to back, order alternating,
the ratio taken within each pair), so that the host's drift between the two trainings stays out of the ratio.

Left out: paged optimizers (optimizer state paged to CPU memory on spikes), 4-bit storage of
embeddings and LayerNorms (QLoRA also leaves them in 16 bits), merging the adapter back into NF4.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from ..peft.inject import ensure_not_applied, find_modules, freeze_base, mark_trainable, replace_module
from .nf4 import NF4Tensor, dequantize_nf4, quantize_nf4

__all__ = ["NF4Linear", "QLoRALinear", "apply_qlora", "weight_bytes", "paired_step_times", "compare_on_rotten_tomatoes"]


class _NF4Matmul(torch.autograd.Function):
    """x @ dequant(W)^T, keeping only the 4-bit W between forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: NF4Linear) -> torch.Tensor:  # (N, d_in) -> (N, d_out)
        ctx.layer = layer
        return x @ layer.dequantized_weight().t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # (N, d_out) -> (N, d_in)
        return grad @ ctx.layer.dequantized_weight(), None  # W dequantized again: no copy was kept


class NF4Linear(nn.Module):
    """A frozen ``nn.Linear`` stored as NF4 codes (+ double-quantized block scales), computed in
    ``compute_dtype``. Everything it holds is a buffer: nothing here trains."""

    def __init__(
        self,
        linear: nn.Linear,
        block_size: int = 64,
        double_quant: bool = True,
        compute_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"NF4Linear quantizes an nn.Linear, got {type(linear).__name__}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype
        t = quantize_nf4(linear.weight, block_size, double_quant)
        self.block_size, self.dq_block_size = t.block_size, t.dq_block_size
        self.register_buffer("packed", t.packed)  # (d_out * d_in / 2,) uint8
        self.register_buffer("absmax", t.absmax)  # (n_blocks,) fp32, or None with double quantization
        self.register_buffer("absmax_codes", t.absmax_codes)  # (n_blocks,) uint8, or None
        self.register_buffer("absmax_scales", t.absmax_scales)  # (n_blocks / 256,) fp32, or None
        # the mean the double-quantized scales were stored around: a buffer (a 0-d fp32 tensor), not a
        # Python float, so that it moves with .to() and is saved in the state dict like the codes it belongs to
        offset = torch.tensor(t.absmax_offset, dtype=torch.float32) if t.double_quant else None
        self.register_buffer("absmax_offset", offset)  # () fp32, or None without double quantization
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(compute_dtype).clone())

    def nf4(self) -> NF4Tensor:
        return NF4Tensor(
            self.packed,
            torch.Size([self.out_features, self.in_features]),
            self.block_size,
            self.absmax,
            self.absmax_codes,
            self.absmax_scales,
            0.0 if self.absmax_offset is None else self.absmax_offset,
            self.dq_block_size,
        )

    def dequantized_weight(self) -> torch.Tensor:
        """(d_out, d_in) in the compute dtype, made anew at each call."""
        return dequantize_nf4(self.nf4(), self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d_out) in x's dtype
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs with {self.in_features} features, got shape {tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)  # (N, d_in)
        y = _NF4Matmul.apply(x2, self)  # (N, d_out)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        dq = ", double-quantized scales" if self.absmax_codes is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, NF4 blocks of {self.block_size}{dq}"


class QLoRALinear(nn.Module):
    """``base(x) + (alpha / r) * dropout(x) A^T B^T`` around a frozen ``NF4Linear`` (LoRALinear's recipe)."""

    peft_method = "lora"

    def __init__(self, base: NF4Linear, r: int, alpha: float = 1.0, dropout: float = 0.0, dtype=torch.float32):
        super().__init__()
        if not isinstance(base, NF4Linear):
            raise TypeError(f"QLoRALinear wraps an NF4Linear, got {type(base).__name__}")
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise ValueError(f"the LoRA rank r must be a positive int, got {r!r}")
        if r > min(base.in_features, base.out_features):
            raise ValueError(f"rank r={r} exceeds min(d_in, d_out) = {min(base.in_features, base.out_features)}")
        self.base, self.r, self.alpha, self.scaling = base, r, alpha, alpha / r
        device = base.packed.device
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=device, dtype=dtype))  # (r, d_in)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=device, dtype=dtype))  # (d_out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout)
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d_out)
        y = self.base(x)
        if not self.enabled:
            return y
        low = F.linear(self.dropout(x).to(self.lora_A.dtype), self.lora_A)  # (..., r)
        return y + (self.scaling * F.linear(low, self.lora_B)).to(y.dtype)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}"


def apply_qlora(
    model: nn.Module,
    targets: str | Iterable[str],
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    skip: Iterable[str] = (),
    block_size: int = 64,
    double_quant: bool = True,
    compute_dtype: torch.dtype = torch.bfloat16,
    adapter_dtype: torch.dtype = torch.float32,
) -> list[str]:
    """NF4 for every ``nn.Linear`` not in a module named in ``skip``; LoRA on those matching ``targets``;
    freeze the rest. Returns the adapted names. ``targets`` and ``skip`` follow ``llmedu.peft.find_modules``."""
    ensure_not_applied(model, "lora")
    skip = list(skip)
    skipped = [name for name, _ in find_modules(model, skip)] if skip else []  # modules, and all inside them

    def is_skipped(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") for s in skipped)

    adapted = [name for name, _ in find_modules(model, targets, kind=nn.Linear)]
    if clash := [name for name in adapted if is_skipped(name)]:
        raise ValueError(f"{clash} are both LoRA targets and skipped from quantization")
    linears = [name for name, m in model.named_modules() if name and isinstance(m, nn.Linear) and not is_skipped(name)]
    for name in linears:
        nf4 = NF4Linear(model.get_submodule(name), block_size, double_quant, compute_dtype)
        replace_module(model, name, QLoRALinear(nf4, r, alpha, dropout, adapter_dtype) if name in adapted else nf4)
    freeze_base(model)
    return adapted


def weight_bytes(model: nn.Module, within: str = "") -> int:
    """Bytes of the parameters and buffers of the submodule ``within`` (the whole model by default)."""
    module = model.get_submodule(within) if within else model
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def paired_step_times(
    runs: list[tuple[nn.Module, torch.optim.Optimizer]],
    batch: dict,
    loss_fn: Callable,
    repeats: int = 7,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, object]:
    """Time one training step (forward, backward, optimizer step) of two (model, optimizer) runs on ``batch``,
    in ``repeats`` pairs after one untimed warm-up step each: pair i steps the first run then the second when
    i is even, the reverse when odd. Returns {"ratio": median over pairs of second / first, "ratio_lo",
    "ratio_hi": the smallest and largest pair ratio, "median_s": (first's, second's) median step time, "ratios"}.
    The steps change the models: time them after they are evaluated."""
    if len(runs) != 2:
        raise ValueError(f"paired_step_times compares two (model, optimizer) runs, got {len(runs)}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")

    def step(model, optimizer) -> float:
        start = clock()
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return clock() - start

    for run in runs:  # warm-up: first-call allocations, optimizer state
        step(*run)
    times = ([], [])  # (first's, second's)
    for i in range(repeats):
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            times[k].append(step(*runs[k]))
    ratios = [b / a for a, b in zip(*times)]
    return {
        "ratio": statistics.median(ratios),
        "ratio_lo": min(ratios),
        "ratio_hi": max(ratios),
        "median_s": tuple(statistics.median(t) for t in times),
        "ratios": ratios,
    }


def compare_on_rotten_tomatoes(
    steps: int = 720,
    batch_size: int = 32,
    max_len: int = 64,
    layers: int = 6,
    r: int = 8,
    lr: float = 1e-3,
    n_val: int | None = None,
    targets: Iterable[str] = ("query", "value"),
    methods: Iterable[str] = ("LoRA bf16", "QLoRA NF4"),
    seed: int = 0,
    timing_repeats: int = 7,
) -> dict[str, dict[str, float]]:
    """Fine-tune all-MiniLM-L6-v2 on Rotten Tomatoes with LoRA on a bf16 base and QLoRA on an NF4 base.

    Both: the model in bf16 (embeddings, norms, head, adapters), LoRA r on ``targets`` with alpha = 2r,
    a new 2-way head that trains, AdamW at ``lr``, the same batches. QLoRA also stores every
    encoder linear in NF4. Returns method -> {accuracy, encoder_linear_mib (the base linear weights),
    model_mib, peak_step_mib (one measured training step), step_s, trainable, final_loss}, plus
    "majority class" -> {accuracy}, and "paired step" -> ``paired_step_times`` of the first two methods
    (``timing_repeats`` pairs on the first training batch, after evaluation; the second method's time over the
    first's). 720 steps of 32 = two epochs. ``methods`` may also hold "LoRA fp32" (lesson 19's setting:
    everything in fp32).
    """
    from ..memory.tracker import MemoryTracker
    from ..peft.inject import count_parameters
    from ..train.loop import TrainConfig, train
    from .finetuned import accuracy, new_classifier, rotten_tomatoes

    methods = list(methods)
    unknown = set(methods) - {"LoRA bf16", "QLoRA NF4", "LoRA fp32"}
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from 'LoRA fp32', 'LoRA bf16', 'QLoRA NF4'")
    train_data = rotten_tomatoes("train", batch_size, max_len, seed=seed)
    val_data = rotten_tomatoes("validation", 64, max_len, limit=n_val, seed=seed)
    torch.manual_seed(seed)
    base = new_classifier(layers).eval()
    encoder_linears = [n for n, m in base.named_modules() if isinstance(m, nn.Linear) and n.startswith("bert.encoder")]

    def loss_fn(model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits.float(), batch["labels"])

    results: dict[str, dict[str, float]] = {}
    runs = []  # (model, optimizer) of each method, kept for the paired timing
    for method in methods:
        torch.manual_seed(seed)
        model = copy.deepcopy(base)
        if method != "LoRA fp32":
            model = model.to(torch.bfloat16)
        if method == "QLoRA NF4":
            dtype = torch.bfloat16  # the same adapter dtype as LoRA's on the bf16 base
            apply_qlora(model, list(targets), r=r, alpha=2 * r, skip=["classifier", "pooler"], adapter_dtype=dtype)
        else:
            from ..peft.lora import apply_lora

            apply_lora(model, list(targets), r=r, alpha=2 * r)  # adapters in the base's dtype
        mark_trainable(model, "classifier")
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        history = train(model, optimizer, train_data.__getitem__, loss_fn, TrainConfig(max_steps=steps, progress=False))
        with MemoryTracker(model, optimizer) as tracker:  # one more step, measured
            loss_fn(model, train_data[0]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        bases = [model.get_submodule(n) for n in encoder_linears]
        linear_bytes = sum(weight_bytes(getattr(m, "base", m)) for m in bases)  # without the adapters
        results[method] = {
            "accuracy": accuracy(model, val_data),
            "encoder_linear_mib": linear_bytes / 2**20,
            "model_mib": weight_bytes(model) / 2**20,
            "peak_step_mib": tracker.peak_bytes / 2**20,
            "step_s": sum(history["seconds"][1:]) / max(1, steps - 1),
            "trainable": count_parameters(model)[0],
            "final_loss": sum(history["loss"][-20:]) / len(history["loss"][-20:]),
        }
        runs.append((model.train(), optimizer))
    if len(runs) >= 2:
        results["paired step"] = paired_step_times(runs[:2], train_data[0], loss_fn, timing_repeats)
    ones = sum(val_data.labels)
    results["majority class"] = {"accuracy": max(ones, len(val_data.labels) - ones) / len(val_data.labels)}
    return results
