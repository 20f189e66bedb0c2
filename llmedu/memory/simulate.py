"""The memory of a training step of a model too big for this machine, without allocating it.

A ``FakeTensor`` (``torch._subclasses.fake_tensor.FakeTensorMode``) has a shape, a dtype, a device
and a storage of the right size, but no data: every op computes only the metadata of its result.
Building a 7-billion-parameter model under this mode takes seconds and no memory, and a
training step on it runs every real ATen op of the real step, in the real order, with the real
lifetimes. So the same ``MemoryTracker`` that measures a real step measures the fake one, with the
same categories, and says how many bytes it *would* take.

``simulate_training_step`` builds the model, a batch and the optimizer from the factories you
give it (inside the fake mode, so nothing is allocated), runs ``warmup_steps`` untracked steps so
that the optimizer state exists as it does on every step but the first, and tracks one step:
forward, loss, backward, ``optimizer.step()``, ``optimizer.zero_grad()``.

``TinyGPT`` is a GPT in plain ``torch.nn`` (token and position embeddings, pre-LN blocks with
explicit softmax attention as in Vaswani et al. 2017, an LM head) that scales from a toy to
billions of parameters: the model the tests and the memory lesson simulate. Any ``nn.Module``
works; ``llmedu.models`` has the full-featured one.

What it leaves out: ops whose output size depends on the data (``nonzero``, boolean-mask
indexing) cannot run on fake tensors and raise; kernels' private workspaces, the CUDA allocator's
512-byte rounding (the fake tensors here live on a fake CPU) and its fragmentation and cache are
not counted. The numbers are what ``MemoryTracker`` would measure on the real step, a lower bound
for ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F

from .tracker import MemoryTracker

__all__ = ["simulate_training_step", "training_step", "TinyGPT"]


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch, loss_fn: Callable | None = None) -> None:
    """One step: ``loss_fn(model, batch).backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``.

    The default loss is next-token cross-entropy: ``batch`` is ``(inputs, targets)`` and
    ``model(inputs)`` returns logits of shape (..., vocab).
    """
    if loss_fn is None:
        inputs, targets = batch
        logits = model(inputs)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    else:
        loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def simulate_training_step(
    make_model: Callable[[], nn.Module],
    make_batch: Callable[[], object],
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = lambda params: torch.optim.AdamW(params),
    *,
    loss_fn: Callable | None = None,
    warmup_steps: int = 1,
) -> MemoryTracker:
    """Track one training step on fake tensors; returns the finished ``MemoryTracker``.

    ``make_model()`` returns an ``nn.Module``, ``make_batch()`` the batch for ``training_step``,
    ``make_optimizer(params)`` the optimizer. They are called inside ``FakeTensorMode``, so every
    tensor they create is fake, whatever its size. ``warmup_steps=0`` measures the first step, the
    one without optimizer state until ``step()``.
    """
    if isinstance(make_model, nn.Module):
        raise TypeError(
            "make_model must be a factory such as `lambda: TinyGPT(...)`, not a model: a model "
            "built outside the fake mode has already allocated its real parameters"
        )
    for name, fn in (("make_model", make_model), ("make_batch", make_batch), ("make_optimizer", make_optimizer)):
        if not callable(fn):
            raise TypeError(f"{name} must be a callable (a factory), got {type(fn).__name__}")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")

    with FakeTensorMode():
        model = make_model()
        if not isinstance(model, nn.Module):
            raise TypeError(f"make_model() must return an nn.Module, got {type(model).__name__}")
        optimizer = make_optimizer(list(model.parameters()))
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"make_optimizer(params) must return a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        for _ in range(warmup_steps):
            training_step(model, optimizer, make_batch(), loss_fn)
        batch = make_batch()
        with MemoryTracker(model, optimizer) as tracker:
            training_step(model, optimizer, batch, loss_fn)
    return tracker


class _TransformerBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, H, C // H).unbind(2)  # each (B, T, H, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        scores = q @ k.transpose(-2, -1) / math.sqrt(C // H)  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(causal, float("-inf")).softmax(-1)  # (B, H, T, T)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT in a screen of plain ``torch.nn``; about 12·L·C² + (2V + T)·C parameters.

    ``TinyGPT(vocab_size=32000, seq_len=2048, d_model=2048, n_layers=18, n_heads=16)`` has about
    1.0 billion parameters; ``(32000, 4096, 4096, 32, 32)`` about 6.7 billion (a Llama-7B-sized
    stack without its gated MLP).
    """

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int):
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("seq_len", seq_len),
            ("d_model", d_model),
            ("n_layers", n_layers),
            ("n_heads", n_heads),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_TransformerBlock(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2 or idx.shape[1] > self.seq_len:
            raise ValueError(f"expected token ids of shape (B, T<={self.seq_len}), got {tuple(idx.shape)}")
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # (B, T, V)
