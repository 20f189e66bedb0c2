"""Graders for lessons 06-08: the memory of training, loss scaling, accumulation, recomputation.

check_adam_state_bytes(fn)    fn(n_params, mixed) -> {parameters, gradients, optimizer} bytes with Adam:
                              4/4/8 per parameter in fp32, 2/2/12 in mixed precision (ZeRO sec. 3.1)
check_scale_update(fn)        fn(scale, clean_steps, found_inf, growth_interval) -> (scale, clean_steps),
                              the dynamic loss scaler's rule (x0.5 on overflow, x2 after a clean streak)
check_accumulate(fn)          fn(model, loss_fn, micro_batches) leaves in .grad the gradient of the mean
                              loss over all micro-batches (= one big batch)
check_checkpoint(fn)          fn(f, x) -> f(x) with the same gradients, but saving only x for backward
check_token_accumulate(fn)    fn(model, token_losses, micro_batches) leaves in .grad the gradient of the mean
                              loss over every real token of every micro-batch, when the micro-batches hold
                              different numbers of tokens (padding)
"""

from __future__ import annotations

import torch
from torch import nn

from llmedu.checks.core import CheckResult, Grader
from llmedu.memory.estimate import adamw_fp32_bytes, mixed_precision_adam_bytes
from llmedu.train.precision import LossScaler

__all__ = [
    "check_adam_state_bytes",
    "check_scale_update",
    "check_accumulate",
    "check_checkpoint",
    "check_token_accumulate",
]


def check_adam_state_bytes(fn) -> CheckResult:
    """Grade ``fn(n_params, mixed)`` against ``llmedu.memory.estimate``'s formulas."""
    g = Grader("check_adam_state_bytes")
    for n_params in (1_000, 124_439_808, 100_000_000_000):
        for mixed in (False, True):
            expected = (mixed_precision_adam_bytes if mixed else adamw_fp32_bytes)(n_params)
            got = g.call(fn, n_params, mixed)
            g.compare(f"{n_params:,} parameters, {'mixed precision' if mixed else 'fp32'}", got, expected)
    return g.result()


def check_scale_update(fn) -> CheckResult:
    """Replay a sequence of overflows and clean steps through ``fn`` and through ``LossScaler``."""
    g = Grader("check_scale_update")
    overflows = [False, False, True, False, False, False, False, True, True, False, False, False]
    for interval in (1, 3):
        ours = LossScaler(init_scale=1024.0, growth_interval=interval)
        scale, clean = 1024.0, 0
        for i, found_inf in enumerate(overflows):
            ours._found_inf = found_inf  # the verdict unscale_() would have reached
            ours.update()
            got = g.call(fn, scale, clean, found_inf, interval)
            if not g.compare(
                f"growth_interval={interval}, step {i} (overflow={found_inf})",
                got,
                (ours.scale_value, ours.clean_steps),
            ):
                break
            scale, clean = got
    return g.result()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def check_accumulate(fn) -> CheckResult:
    """``fn(model, loss_fn, micro_batches)`` must leave the big batch's gradient in ``.grad``."""
    g = Grader("check_accumulate")
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 6, generator=gen), torch.randn(24, 2, generator=gen)
    for k in (1, 3, 4):
        reference = _model()
        _mse(reference, (x, y)).backward()
        model = _model()
        micro = list(zip(x.chunk(k), y.chunk(k)))  # k equal micro-batches
        g.call(fn, model, _mse, micro)
        # the same per-sample gradients summed in another order: fp32 rounding only
        got = [p.grad if p.grad is not None else torch.full_like(p, float("nan")) for p in model.parameters()]
        g.compare(f"{k} micro-batches of {24 // k}", got, [p.grad for p in reference.parameters()], atol=1e-6)
    return g.result()


def check_checkpoint(fn) -> CheckResult:
    """``fn(f, x)`` must compute ``f(x)``, give the same gradients, and save only its input."""
    g = Grader("check_checkpoint")
    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 32))
    x0 = torch.randn(64, 32)

    def run(use_fn: bool):
        f.zero_grad()
        x = x0.clone().requires_grad_(True)
        saved = []  # bytes of every tensor autograd saves for backward during the forward pass
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t
        ):
            out = g.call(fn, f, x) if use_fn else f(x)
        if isinstance(out, torch.Tensor):
            g.call(lambda: out.pow(2).sum().backward())  # a learner's graph may be broken: report it
        return out, [x.grad] + [p.grad for p in f.parameters()], saved

    ref_out, ref_grads, ref_saved = run(False)
    out, grads, saved = run(True)
    g.compare("the output f(x)", out, ref_out, atol=1e-6)
    g.compare("the gradients of x and of f's parameters", grads, ref_grads, atol=1e-6)
    kept, plain = sum(saved), sum(ref_saved)
    g.expect(
        "saves less for backward than f itself",
        kept <= x0.numel() * 4 * 2,
        f"{kept:,} bytes were saved for backward in the forward pass (f alone saves {plain:,}); keep only x",
    )
    return g.result()


def _token_losses(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses (B, T) of a tiny sequence model and the mask (B, T) of real (not padding) tokens."""
    x, y, mask = batch  # (B, T, 6), (B, T, 2), (B, T)
    return ((model(x) - y) ** 2).mean(-1), mask


def check_token_accumulate(fn) -> CheckResult:
    """``fn(model, token_losses, micro_batches)``: ``.grad`` must hold the gradient of the mean over all tokens.

    ``token_losses(model, batch) -> (losses (B, T), mask (B, T))``, mask 1.0 for a real token and 0.0 for
    padding. The micro-batches hold very different numbers of real tokens, so the mean of the
    per-micro-batch means (each micro-batch's mean divided by k) is wrong by up to tens of per cent.
    """
    g = Grader("check_token_accumulate")
    gen = torch.Generator().manual_seed(2)
    B, T = 12, 10
    x, y = torch.randn(B, T, 6, generator=gen), torch.randn(B, T, 2, generator=gen)
    lengths = torch.tensor([10, 9, 10, 8, 1, 2, 1, 3, 6, 5, 7, 2])  # real tokens per sequence, then padding
    mask = (torch.arange(T) < lengths[:, None]).float()  # (B, T)
    for k in (2, 3, 4):
        reference = _model()
        losses, m = _token_losses(reference, (x, y, mask))
        ((losses * m).sum() / m.sum()).backward()
        model = _model()
        micro = list(zip(x.chunk(k), y.chunk(k), mask.chunk(k)))
        tokens = [int(mb[2].sum()) for mb in micro]
        g.call(fn, model, _token_losses, micro)
        got = [p.grad if p.grad is not None else torch.full_like(p, float("nan")) for p in model.parameters()]
        # the same per-token gradients summed in another order: fp32 rounding only
        g.compare(
            f"{k} micro-batches holding {tokens} real tokens", got, [p.grad for p in reference.parameters()], atol=1e-6
        )
    return g.result()
