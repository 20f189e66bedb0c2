"""Graders for lessons 22 (quantization) and 23 (distillation and pruning).

check_nf4_bytes(fn)            fn(n_params, block, double_quant) -> bytes of a 4-bit block-quantized tensor:
                               n/2 bytes of codes + one fp32 scale per block, or with double quantization
                               (Dettmers et al. 2023, QLoRA sec. 3) one 8-bit scale per block plus one fp32
                               scale per 256 first-level scales
check_int8_size_ratio(fn)      fn(d_out, d_in, per_channel) -> bytes of an int8 linear layer (int8 weights,
                               fp32 scale(s), fp32 bias) divided by the bytes of the fp32 layer
check_packed_bytes(fn)         fn(d_out, d_in, bits) -> bytes of a GPTQ/RTN layer as ``gptq.PackedLinear`` stores it:
                               the d_out * d_in codes packed 8 // bits to a byte (the last byte padded), one fp32
                               scale and one uint8 zero point per output row, the fp32 bias (Frantar et al. 2022)
check_two_four_mask(fn)        fn(weight (out, in)) -> bool keep-mask: in each group of 4 consecutive inputs,
                               the 2 of largest magnitude (``llmedu.compress.pruning.nm_mask``)
check_wanda_mask(fn)           fn(weight (out, in), inputs (n_tokens, in)) -> bool 2:4 keep-mask scored by Wanda's
                               criterion (Sun et al. 2023, sec. 3), the weight's size and the size of the input
                               it multiplies over the calibration tokens
check_distillation_loss(fn)    fn(student_logits, teacher_logits, T) -> T^2 KL(softmax(t/T) || softmax(s/T)),
                               averaged over the batch (Hinton et al. 2015)
check_cosine_gradient(fn)      fn(student_hidden, teacher_hidden) (B, T, d) -> d L_cos / d student_hidden of
                               L_cos = mean over the B*T tokens of 1 - cos(s, t) (DistilBERT, Sanh et al. 2019), by
                               the derivation: no autograd, and no finite difference (see the function)
check_high_temperature_limit(fn)
                               fn(student_logits, teacher_logits) (B, C) -> the limit of T^2 KL as T -> infinity,
                               averaged over the batch (Hinton et al. 2015, sec. 2.1), by the derivation: the loss
                               not evaluated at large T and extrapolated (see the function)
"""

from __future__ import annotations

import torch

from llmedu.checks._watch import EXP_OR_LOG, Calls, math_recorded, no_threads
from llmedu.checks.core import CheckResult, Grader
from llmedu.compress.distillation import hidden_state_loss, soft_target_loss
from llmedu.compress.pruning import nm_mask

__all__ = [
    "check_nf4_bytes",
    "check_int8_size_ratio",
    "check_two_four_mask",
    "check_wanda_mask",
    "check_distillation_loss",
    "check_cosine_gradient",
    "check_packed_bytes",
    "check_high_temperature_limit",
]

SECOND_LEVEL_BLOCK = 256  # first-level scales per fp32 second-level scale (QLoRA's choice)


def nf4_bytes(n_params: int, block: int, double_quant: bool) -> float:
    """The reference: 4 bits a weight, and the scales (see the module docstring)."""
    n_blocks = n_params / block
    if double_quant:
        return n_params / 2 + n_blocks * 1 + n_blocks / SECOND_LEVEL_BLOCK * 4
    return n_params / 2 + n_blocks * 4


def int8_size_ratio(d_out: int, d_in: int, per_channel: bool) -> float:
    scales = d_out if per_channel else 1
    return (d_out * d_in + 4 * scales + 4 * d_out) / (4 * d_out * d_in + 4 * d_out)


def packed_bytes(d_out: int, d_in: int, bits: int) -> int:
    """The reference: what ``PackedLinear``'s buffers hold (the tests check the two agree)."""
    per_byte = 8 // bits
    return -(-d_out * d_in // per_byte) + 4 * d_out + 1 * d_out + 4 * d_out


def check_nf4_bytes(fn) -> CheckResult:
    g = Grader("check_nf4_bytes")
    for n, block in [(64 * 256, 64), (384 * 1536, 64), (4096 * 4096, 64), (1 << 20, 128)]:
        for dq in (False, True):
            g.compare(
                f"n_params={n}, block={block}, double_quant={dq}",
                g.call(fn, n, block, dq),
                nf4_bytes(n, block, dq),
                rtol=1e-9,
            )
    return g.result()


def check_int8_size_ratio(fn) -> CheckResult:
    g = Grader("check_int8_size_ratio")
    for d_out, d_in in [(384, 384), (1536, 384), (2, 384), (4096, 11008)]:
        for per_channel in (False, True):
            g.compare(
                f"d_out={d_out}, d_in={d_in}, per_channel={per_channel}",
                g.call(fn, d_out, d_in, per_channel),
                int8_size_ratio(d_out, d_in, per_channel),
                rtol=1e-9,
            )
    return g.result()


def check_two_four_mask(fn) -> CheckResult:
    g = Grader("check_two_four_mask")
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 4), (3, 8), (8, 4), (16, 32)]:  # (8, 4): a mask along the wrong axis fails here
        w = torch.randn(shape, generator=gen)
        w[0, 0] = -5.0  # a large negative weight: keeping the largest *values* drops it
        got = g.call(fn, w.clone())
        if isinstance(got, torch.Tensor):
            got = got.bool()  # a 0/1 float mask is fine too
        g.compare(f"weight of shape {shape}", got, nm_mask(w, 2, 4))
    return g.result()


def wanda_mask(weight: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The reference: 2:4 within each row of ``weight`` (out, in), scored by |W_ij| times the l2 norm of input j
    over the calibration tokens ``inputs`` (n_tokens, in)."""
    return nm_mask(weight.abs() * inputs.norm(dim=0), 2, 4)  # (out, in) scores, all >= 0


def _wanda_cases(gen: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, weight, inputs): a few input features far larger than the rest, as in a transformer's activations,
    so that the mask by |W| alone differs; shapes where the wrong axis's norm still broadcasts."""
    cases = []
    for out_f, in_f, n_tokens in [(2, 8, 3), (4, 8, 8), (8, 8, 8), (16, 32, 5)]:
        w = torch.randn(out_f, in_f, generator=gen, dtype=torch.float64)
        x = torch.randn(n_tokens, in_f, generator=gen, dtype=torch.float64)
        x = x * torch.exp2(torch.randint(-3, 5, (in_f,), generator=gen).double())  # feature sizes 1/8 to 16
        cases.append((f"weight ({out_f}, {in_f}), inputs ({n_tokens}, {in_f})", w, x))
    w = torch.tensor([[4.0, -1.0, 2.0, 0.5]], dtype=torch.float64)
    x = torch.tensor([[0.1, 10.0, 1.0, 1.0], [0.0, 0.0, 1.0, -1.0]], dtype=torch.float64)
    cases.insert(0, ("the worked row (4, -1, 2, 0.5)", w, x))
    return cases


def check_wanda_mask(fn) -> CheckResult:
    """The mask against the reference on every case (a 0/1 float mask is accepted)."""
    g = Grader("check_wanda_mask")
    for name, w, x in _wanda_cases(torch.Generator().manual_seed(4)):
        got = g.call(fn, w.clone(), x.clone())
        if isinstance(got, torch.Tensor):
            got = got.bool()
        g.compare(name, got, wanda_mask(w, x))
    return g.result()


def check_distillation_loss(fn) -> CheckResult:
    g = Grader("check_distillation_loss")
    gen = torch.Generator().manual_seed(1)
    for B, C in [(1, 2), (4, 2), (8, 5)]:
        for T in (1.0, 2.0, 4.0):
            s, t = torch.randn(B, C, generator=gen) * 3, torch.randn(B, C, generator=gen) * 3
            got = g.call(fn, s.clone(), t.clone(), T)
            g.compare(f"logits ({B}, {C}), T={T}", got, soft_target_loss(s, t, T), atol=1e-5, rtol=1e-5)
    return g.result()


def _cosine_cases(gen: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, student (B, T, d), teacher (B, T, d)) pairs on which the usual slips give other numbers."""
    cases = []
    for B, T, d in [(1, 1, 2), (2, 3, 4), (4, 5, 16)]:
        s, t = torch.randn(B, T, d, generator=gen), torch.randn(B, T, d, generator=gen)
        # token norms from 0.25 to 8: an answer that takes |s| = 1 (or |t| = 1) is wrong here
        s = s * torch.exp2(torch.randint(-2, 4, (B, T, 1), generator=gen).float())
        t = t * torch.exp2(torch.randint(-2, 4, (B, T, 1), generator=gen).float())
        cases.append((f"hidden states ({B}, {T}, {d})", s, t))
    s = torch.randn(2, 2, 8, generator=gen)
    t = s * torch.tensor([0.5, 3.0, 1.0, 2.0]).reshape(2, 2, 1)  # every t along its s: the loss is at its minimum
    cases.append(("teacher tokens parallel to the student's (gradient zero)", s, t))
    return cases


def _same_values(x, *refs: torch.Tensor) -> bool:
    """Whether tensor ``x`` holds exactly the values of one of ``refs`` (any shape or float dtype)."""
    return isinstance(x, torch.Tensor) and any(
        x.numel() == r.numel() and torch.equal(x.detach().reshape(r.shape).double(), r.double()) for r in refs
    )


def _cosine_method(g: Grader, name: str, calls: Calls, s: torch.Tensor, t: torch.Tensor) -> bool:
    """The method checks of one call: no autograd, no numbers out of torch, every cosine at the given states."""
    used = sorted(calls.names & {"backward", "grad", "requires_grad", "enable_grad", "set_grad_enabled"})
    if not g.expect(f"{name}: by the derivation", not used, f"your function used autograd ({used}): derive it by hand"):
        return False
    left = calls.leaving_torch()
    if not g.expect(
        f"{name}: computed in torch",
        not left,
        f"your function took numbers out of torch ({left}), where the grader cannot see a finite difference: "
        "derive the gradient and write it with torch operations",
    ):
        return False
    moved = [x for x in calls.cosine_inputs if not _same_values(x, s, t)]
    return g.expect(
        f"{name}: by the derivation",
        not moved,
        f"your function evaluated a cosine (or the loss) at {len(moved)} other student states than the given ones: "
        "that is a finite difference; derive the gradient",
    )


def check_cosine_gradient(fn) -> CheckResult:
    """The gradient against autograd's through ``hidden_state_loss``. The method: no autograd, no cosine or loss
    evaluated away from the given states, no numbers out of torch, no thread started, no more torch calls at d = 64 than at d = 4 (a finite difference,
    one evaluation per coordinate, makes 16 times as many), and no tensor at d = 64 over 4 times the inputs' size
    (a finite difference of all coordinates at once, s ± h·eye(d), makes a (B, T, d, d) one)."""
    g = Grader("check_cosine_gradient")
    for name, s, t in _cosine_cases(torch.Generator().manual_seed(2)):
        leaf = s.clone().requires_grad_()
        (expected,) = torch.autograd.grad(hidden_state_loss(leaf, t), leaf)
        calls = Calls()
        with torch.no_grad(), no_threads(), calls:
            got = g.call(fn, s.clone(), t.clone())
        if not _cosine_method(g, name, calls, s, t):
            break
        # fp32 norms and dot products of O(1)-O(10) vectors: relative error a few ulps; 1e-6 absolute covers the
        # zero-gradient case, where autograd's answer is itself rounding noise of order 1e-8
        g.compare(name, got, expected, atol=1e-6, rtol=1e-4)
    gen = torch.Generator().manual_seed(5)
    counts = {}
    for d in (4, 64):
        s, t = torch.randn(2, 3, d, generator=gen), torch.randn(2, 3, d, generator=gen)
        calls = Calls()
        with torch.no_grad(), no_threads(), calls:
            g.call(fn, s, t)
        counts[d] = len(calls.raw)
    g.expect(
        "hidden size 64: no (..., d, d) tensor",
        calls.largest <= 4 * s.numel(),
        f"your function made a tensor of {calls.largest} numbers from hidden states of {s.numel()} (2, 3, 64): every "
        "coordinate perturbed at once is a finite difference; a projection (I - s s^T) t can be written without "
        "the d x d matrix",
    )
    g.expect(
        "hidden size 4 against 64: the work does not grow with d",
        counts[64] <= counts[4] + 8,
        f"your function made {counts[4]} torch calls at d = 4 and {counts[64]} at d = 64: one evaluation per "
        "coordinate is a finite difference (and a loop over the d coordinates is slow): derive the gradient and "
        "write it with whole-tensor operations",
    )
    return g.result()


def check_packed_bytes(fn) -> CheckResult:
    g = Grader("check_packed_bytes")
    # (3, 5) and (5, 7): an odd number of codes, so the last byte is half (or a quarter) empty but stored
    for d_out, d_in, bits in [(384, 384, 4), (1536, 384, 4), (384, 1536, 8), (3, 5, 4), (5, 7, 2), (4096, 4096, 4)]:
        g.compare(
            f"d_out={d_out}, d_in={d_in}, bits={bits}",
            g.call(fn, d_out, d_in, bits),
            packed_bytes(d_out, d_in, bits),
            rtol=0,
            atol=0,
        )
    return g.result()


def high_temperature_limit(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The reference: T^2 KL(softmax(t/T) || softmax(s/T)) as T -> infinity, for logits (B, C)."""
    s = student_logits - student_logits.mean(-1, keepdim=True)  # (B, C): a softmax ignores a shift of its row
    t = teacher_logits - teacher_logits.mean(-1, keepdim=True)
    return (s - t).pow(2).sum(-1).mean() / (2 * student_logits.shape[-1])


MAX_LIMIT_CALLS = (
    30  # torch calls: the closed form takes 6-12; the loss by Taylor polynomials, extrapolated, 50 and more
)


def check_high_temperature_limit(fn) -> CheckResult:
    """The value against the closed form, in torch from the logits alone: no exponential or logarithm under any
    name (``EXP_OR_LOG``, math's, a power above 4), no complex tensor (e^x is cos(ix) - i sin(ix)), at most
    ``MAX_LIMIT_CALLS`` torch calls (an exponential and logarithm written as polynomials take many more), no
    thread started, and one number at most out of torch, where the grader cannot see (the loss at large T,
    extrapolated, is close by another road)."""
    g = Grader("check_high_temperature_limit")
    gen = torch.Generator().manual_seed(3)
    cases = []
    for B, C in [(1, 2), (4, 2), (3, 5), (8, 10)]:
        cases.append((f"logits ({B}, {C})", torch.randn(B, C, generator=gen, dtype=torch.float64) * 2))
    shift = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    cases.append(("teacher rows shifted by a constant (a softmax does not see it)", shift))
    for name, s in cases:
        t = torch.randn(s.shape, generator=gen, dtype=torch.float64) * 2
        if "shifted" in name:
            t = s + 0.3 * torch.randn(s.shape, generator=gen, dtype=torch.float64) + torch.arange(4.0)[:, None] * 5
        calls, math_used = Calls(), []
        with no_threads(), calls:
            got = g.call(math_recorded(fn, math_used), s.clone(), t.clone())
        used = sorted({n for n in calls.names if EXP_OR_LOG.search(n)} | set(math_used))
        used += [f"pow(..., {e!r})" for e in calls.exponents if not (isinstance(e, (int, float)) and abs(e) <= 4)]
        used += ["complex tensors"] if calls.complex else []
        left = calls.leaving_torch()
        if (
            not g.expect(
                f"{name}: computed from the logits alone",
                not used,
                f"your function called {used}: an exponential or logarithm under another name (or a large power, or "
                "complex numbers) evaluates the loss; derive the limit, which needs only sums, differences and squares",
            )
            or not g.expect(
                f"{name}: computed in torch",
                not left,
                f"your function took numbers out of torch ({left}): work on the tensors with torch operations "
                "(one .item() of the answer is fine)",
            )
            or not g.expect(
                f"{name}: a closed form",
                len(calls.raw) <= MAX_LIMIT_CALLS,
                f"your function made {len(calls.raw)} torch calls, more than {MAX_LIMIT_CALLS}: the limit takes about "
                "10 (sums, differences and squares); an exponential or logarithm written as a polynomial evaluates "
                "the loss",
            )
        ):
            break
        g.compare(name, got, high_temperature_limit(s, t).item(), rtol=1e-6, atol=1e-9)  # a 0-d tensor or a float
    return g.result()
