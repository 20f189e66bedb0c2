"""Graders for lessons 06-09: the memory of training, loss scaling, accumulation, recomputation.

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

Lesson 09, understanding rather than retyping:
check_token_weights(fn)       fn(token_counts) -> for each micro-batch, the weight the mean of per-micro-batch
                              means gives one of its tokens, relative to the mean over all tokens
check_best_segment(fn)        fn(n_layers, c) -> (k, peak): the segment length k (a divisor of n_layers) whose
                              checkpointing keeps the fewest activations, L/k + c k hidden states, and that peak
check_recompute_flops(fn)     fn(policy, d_model, seq_len, d_ff, n_heads, n_kv_heads) -> a block's training-step
                              matmul FLOPs with recomputation over those without ("blocks", "attention", "core")
check_checkpoint_rng(fn)      fn(f, x) -> f(x) checkpointed, f with dropout: the same gradients as f itself, the
                              caller's random stream left where f leaves it, and only x saved for backward
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llmedu.checks.core import FAILED, CheckResult, Grader
from llmedu.memory.estimate import adamw_fp32_bytes, mixed_precision_adam_bytes
from llmedu.train.precision import LossScaler

__all__ = [
    "check_adam_state_bytes",
    "check_scale_update",
    "check_accumulate",
    "check_checkpoint",
    "check_token_accumulate",
    "check_token_weights",
    "check_best_segment",
    "check_recompute_flops",
    "check_checkpoint_rng",
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
    _expect_only_x_saved(g, saved, ref_saved, x0)
    return g.result()


def _expect_only_x_saved(g: Grader, saved: list[int], ref_saved: list[int], x0: torch.Tensor) -> None:
    """A checkpoint keeps the input (float32, with room for one more tensor of its size), not f's activations."""
    kept, plain = sum(saved), sum(ref_saved)
    g.expect(
        "saves less for backward than f itself",
        kept <= x0.numel() * 4 * 2,
        f"{kept:,} bytes were saved for backward in the forward pass (f alone saves {plain:,}); keep only x",
    )


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


# -- lesson 09: understanding --------------------------------------------------------------------------
def check_token_weights(fn) -> CheckResult:
    """``fn(token_counts)``: (1 / (k n_i)) / (1 / N) = N / (k n_i) for each micro-batch i."""
    g = Grader("check_token_weights")
    for counts in ([32, 60, 94, 119], [50, 50], [1, 99], [12, 3, 45]):
        k, total = len(counts), sum(counts)
        expected = [total / (k * n) for n in counts]
        got = g.call(fn, list(counts))
        if isinstance(got, (list, tuple)) and len(got) == k and len(set(counts)) > 1:
            if all(isinstance(w, (int, float)) and math.isclose(w, 1 / e, rel_tol=1e-9) for w, e in zip(got, expected)):
                g.expect(
                    f"token counts {counts}", False, "your weights are upside down: which tokens does 1/n_i favour?"
                )
        g.compare(f"micro-batches holding {counts} tokens", got, expected, rtol=1e-9)
    return g.result()


def check_best_segment(fn) -> CheckResult:
    """``fn(n_layers, c)``: segments of k blocks keep L/k inputs and recompute k blocks of c inputs each."""
    g = Grader("check_best_segment")
    # (L, c): the lesson's 16 blocks of c = 34.56, Chen et al.'s c = 1, a tie (3 and 4), depths where the integer
    # nearest sqrt(L / c) does not divide L, and one (26, 0.5) where stepping down from it to a divisor (k = 2:
    # 14 hidden states) misses the best (k = 13: 8.5), because the divisors of 26 are far apart
    for L, c in ((16, 34.56), (16, 1.0), (12, 1.0), (22, 1.0), (48, 3.0), (100, 0.25), (60, 2.0), (26, 0.5)):
        peaks = {k: L / k + c * k for k in range(1, L + 1) if L % k == 0}
        best = min(peaks.values())
        case = f"{L} blocks, a block's insides c = {c:g} hidden states"
        got = g.call(fn, L, c)
        if got is FAILED:
            continue
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            g.expect(case, False, f"return a pair (k, peak), got {got!r}")
            continue
        k, peak = got
        if not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= L and L % k == 0):
            g.expect(case, False, f"k = {k!r}: the segment length must be a whole number of blocks dividing {L}")
            continue
        g.expect(
            case,
            math.isclose(peaks[k], best, rel_tol=1e-9),
            f"k = {k} keeps {peaks[k]:g} hidden states at the peak; another divisor of {L} keeps fewer",
        )
        g.compare(f"{case}: the peak, in hidden states", peak, float(best), rtol=1e-9)
    return g.result()


def _block_forward_flops(d: int, s: int, d_ff: int, n_heads: int, n_kv_heads: int) -> tuple[int, int, int]:
    """Per token, forward: (the whole block, its attention sub-layer, the attention core), in matmul FLOPs."""
    kv = n_kv_heads * (d // n_heads)
    core = 4 * s * d  # QK^T and PV, every query head
    attention = 2 * (2 * d * d + 2 * d * kv) + core  # q and o are d x d, k and v d x kv
    return attention + 2 * 2 * d * d_ff, attention, core


def check_recompute_flops(fn) -> CheckResult:
    """``fn(policy, d_model, seq_len, d_ff, n_heads, n_kv_heads)``: (3F + R) / 3F for a block, R recomputed."""
    g = Grader("check_recompute_flops")
    cases = [
        ("blocks", 128, 128, 512, 4, 4),  # a small GPT: d_ff = 4d, no GQA
        ("attention", 128, 128, 512, 4, 4),
        ("core", 128, 128, 512, 4, 4),
        ("core", 12288, 2048, 49152, 96, 96),  # GPT-3 175B
        ("attention", 8192, 4096, 28672, 64, 8),  # a GQA model with a wide FFN
        ("blocks", 8192, 4096, 28672, 64, 8),
        ("core", 4096, 32768, 11008, 32, 8),  # long context
    ]
    for policy, d, s, d_ff, H, H_kv in cases:
        block, attention, core = _block_forward_flops(d, s, d_ff, H, H_kv)
        recomputed = {"blocks": block, "attention": attention, "core": core}[policy]
        expected = (3 * block + recomputed) / (3 * block)
        got = g.call(fn, policy, d, s, d_ff, H, H_kv)
        case = f"policy {policy!r}, d={d}, s={s}, d_ff={d_ff}, {H} heads, {H_kv} KV heads"
        if isinstance(got, (int, float)) and math.isclose(got, (block + recomputed) / block, rel_tol=1e-9):
            g.expect(case, False, "you compared with a forward pass only: a training step is a forward and a backward")
        g.compare(case, got, expected, rtol=1e-9)
    return g.result()


def check_checkpoint_rng(fn) -> CheckResult:
    """``fn(f, x)`` with dropout in ``f``: gradients equal to f's own, the caller's RNG untouched, only x saved."""
    g = Grader("check_checkpoint_rng")
    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 16)).train()
    x0 = torch.randn(8, 16)

    def run(use_fn: bool):
        f.zero_grad()
        x = x0.clone().requires_grad_(True)
        saved = []  # bytes of every tensor autograd saves for backward during the call
        torch.manual_seed(1)  # the dropout masks
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t
        ):
            out = g.call(fn, f, x) if use_fn else f(x)
        if isinstance(out, torch.Tensor) and out.shape == (8, 16):
            # more random layers after the segment, as in a model, then backward
            g.call(lambda: nn.functional.dropout(out, 0.3).pow(2).sum().backward())
        after = torch.rand(4)  # where the caller's random stream stands after the step
        return out, [x.grad] + [p.grad for p in f.parameters()], saved, after

    ref_out, ref_grads, ref_saved, ref_after = run(False)
    out, grads, saved, after = run(True)
    g.compare("the output f(x)", out, ref_out, atol=1e-6)
    if g.failure is None and any(not isinstance(t, torch.Tensor) for t in grads):
        g.expect("the gradients", False, "x or f's parameters got no gradient: is the graph cut?")
    if g.failure is None and not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ref_grads)):
        g.expect(
            "the gradients of x and of f's parameters",
            False,
            "they differ from f's own: the recomputed forward drew other dropout masks than the first one "
            "(replay the random state the forward started from)",
        )
    g.compare("the gradients of x and of f's parameters", grads, ref_grads, atol=1e-6)
    g.expect(
        "the caller's random stream after forward and backward",
        torch.equal(after, ref_after),
        "torch.rand draws other numbers after your backward than after f's: the recomputation moved the "
        "caller's random state (set it back afterwards, e.g. inside torch.random.fork_rng)",
    )
    _expect_only_x_saved(g, saved, ref_saved, x0)
    return g.result()
