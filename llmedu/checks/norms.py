"""Lesson 03's graders: DeepNorm's forward and initialisation, its encoder-decoder constants, Adam's first step.

    check_deepnorm_fix(residual, init)   residual(x, f, norm, n_layers) -> LN(alpha x + f(x));
                                         init(block, n_layers): DeepNet's Xavier gains (beta on v, o, FFN)
    check_deepnorm_constants(fn)         fn(n_encoder, n_decoder) -> ((alpha, beta) or None, (alpha, beta) or None)
    check_adam_first_update(fn)          fn(grad, weight, lr, eps) -> ||dW|| / ||W|| after Adam's first step
    check_first_update_prediction(fn)    fn(placement, n_layers, lr) -> that ratio for the last W_down, from the init

DeepNet (Wang et al. 2022, the table of DeepNorm's parameters beside its pseudocode, fig. 2): for an N-layer
encoder or an M-layer decoder alone, alpha = (2N)^(1/4), beta = (8N)^(-1/4); in an encoder-decoder model the
decoder's layers have three sublayers, alpha = (3M)^(1/4), beta = (12M)^(-1/4), and the encoder's constants
depend on both depths, alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16). (Microsoft's torchscale divides
the encoder's weights by (N^4 M)^(1/16) / 1.15, a gain of 1.15 rather than 0.87; the graders follow the paper.)

Adam (Kingma & Ba 2015, algorithm 1) divides the bias-corrected first moment by the square root of the
bias-corrected second moment. At step 1 both are the gradient itself (m_hat = g, v_hat = g^2), so every
entry moves by lr * g / (|g| + eps): about lr, whatever the size of g, unless |g| is near eps.

The weight is drawn as the lesson's training grid draws its last W_down: ``CausalLM.reset_parameters`` scales
the projections into the residual stream (``o_proj``, ``down_proj``) by 1/sqrt(2L), GPT-2's scheme, so at
L = 8 layers their standard deviation is 0.02 / sqrt(16) = 0.005, not 0.02.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ..models import CausalLM, TransformerConfig
from ..models.gpt import lm_loss
from ..nn.blocks import SerialBlock
from ..nn.norms import LayerNorm, RMSNorm
from .core import CheckResult, Grader

__all__ = ["check_adam_first_update", "adam_first_update", "GRID_DOWN_STD", "check_deepnorm_fix"]
__all__ += ["check_deepnorm_constants", "deepnet_constants", "check_first_update_prediction"]

GRID_DOWN_STD = 0.02 / math.sqrt(2 * 8)  # the 8-layer grid model's W_down: init_std / sqrt(2L)


def adam_first_update(grad: torch.Tensor, weight: torch.Tensor, lr: float, eps: float) -> float:
    """The reference: ||lr * g / (|g| + eps)|| / ||W|| (Frobenius norms), torch.optim.Adam's step 1."""
    g = grad.double()
    return (lr * g / (g.abs() + eps)).norm().item() / weight.double().norm().item()


def check_adam_first_update(fn) -> CheckResult:
    """``fn(grad, weight, lr, eps)``: the relative size of Adam's first update of ``weight``.

    The cases change the gradient's scale by 10^4 (an answer that scales with ||g||, as SGD's would, fails),
    give it entries far below ``eps`` and exact zeros (an answer of lr * sqrt(numel) / ||W||, which is
    right for most gradients, fails there).
    """
    g = Grader("check_adam_first_update")
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 256, generator=gen) * GRID_DOWN_STD  # the grid's last W_down, (d, 4d)
    direction = torch.randn(64, 256, generator=gen)
    zeros = direction * (torch.rand(64, 256, generator=gen) > 0.5)  # half the entries get no gradient
    cases = [
        ("a gradient of scale 1e-1", direction * 1e-1, 3e-3, 1e-8),
        ("the same gradient at scale 1e-5", direction * 1e-5, 3e-3, 1e-8),
        ("a gradient of scale 1e-9, below eps", direction * 1e-9, 3e-3, 1e-8),
        ("half the entries without gradient", zeros * 1e-2, 1e-3, 1e-8),
        ("a gradient of scale 1e-6 with eps = 1e-6", direction * 1e-6, 3e-3, 1e-6),
    ]
    for description, grad, lr, eps in cases:
        got = g.call(fn, grad.clone(), weight.clone(), lr, eps)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if got is not None and not isinstance(got, float | int) and g.failure is None:
            g.expect(description, False, f"expected a number, got {type(got).__name__}")
        g.compare(f"{description}, lr={lr:g}, eps={eps:g}", got, adam_first_update(grad, weight, lr, eps), rtol=1e-4)
    return g.result()


# -- exercise 1: a DeepNorm with three bugs ---------------------------------------------------------------
class _Spy:
    """A function that records the inputs it is called with (a copy of each)."""

    def __init__(self, fn):
        self.fn, self.inputs = fn, []

    def __call__(self, x):
        self.inputs.append(x.detach().clone())
        return self.fn(x)


def _xavier_std(linear: nn.Linear, gain: float) -> float:
    fan_out, fan_in = linear.weight.shape
    return gain * math.sqrt(2.0 / (fan_in + fan_out))


def _check_residual(g: Grader, residual, n_layers: int, norm_kind: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    d = 16
    x = torch.randn(2, 5, d, generator=gen) * 2 + 1  # (B, T, d)
    w = torch.randn(d, d, generator=gen) / math.sqrt(d)
    norm = LayerNorm(d) if norm_kind == "LayerNorm" else RMSNorm(d)
    with torch.no_grad():  # a learnt gain (and bias): a norm other than the one given gives another answer
        for p in norm.parameters():
            p.add_(torch.randn(p.shape, generator=gen))
    f, spy_norm = _Spy(lambda h: torch.tanh(h @ w.T)), _Spy(norm)
    alpha = (2 * n_layers) ** 0.25
    case = f"residual(x, f, norm, n_layers={n_layers}) with a {norm_kind}"
    x_in = x.clone()
    got = g.call(residual, x_in, f, spy_norm, n_layers)
    checks = [
        (lambda: torch.equal(x_in, x), "x changed in place (x *= alpha?): the caller's residual stream moved"),
        (lambda: len(f.inputs) == 1, f"f was called {len(f.inputs)} times; a sublayer runs once"),
        (lambda: torch.equal(f.inputs[0], x), "f must read x itself: DeepNorm is post-LN, x -> LN(alpha x + f(x))"),
        (lambda: len(spy_norm.inputs) == 1, "call the norm you are given, once (the model's own, with its gain)"),
    ]
    for holds, detail in checks:  # in order: each later one assumes the earlier ones
        if g.failure is not None or not g.expect(case, holds(), detail):
            return
    fx = f.fn(x)
    seen, want = spy_norm.inputs[0], alpha * x + fx
    hints = [
        (
            alpha * (x + fx),
            "the norm got alpha (x + f(x)): a norm cannot see a factor of its whole input, so this is "
            "plain post-LN; alpha must weigh x against f(x)",
        ),
        (x + alpha * fx, "the norm got x + alpha f(x): alpha up-weights the residual x, not the branch"),
        ((4 * n_layers) ** 0.25 * x + fx, "alpha = (4N)^(1/4): N counts layers (each of two sublayers), not sublayers"),
    ]
    for wrong, hint in hints:
        if seen.shape == want.shape and torch.allclose(seen, wrong, atol=1e-5) and not torch.allclose(seen, want):
            g.expect(case, False, hint)
    g.compare(f"{case}: the norm's input", seen, want, atol=1e-5)
    g.compare(f"{case}: the output", got, norm(want).detach(), atol=1e-5)


def _check_init(g: Grader, init, n_layers: int) -> None:
    block = SerialBlock(128, 4, 512, placement="deepnorm", deepnorm_alpha=(2 * n_layers) ** 0.25)  # FFN (128, 512)
    with torch.no_grad():
        for m in block.modules():  # what CausalLM.reset_parameters draws before DeepNet's initialisation
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.02)
    g.call(init, block, n_layers)
    if g.failure is not None:
        return
    beta = (8 * n_layers) ** -0.25
    attn, mlp = block.attn, block.mlp
    named = [("q_proj", attn.q_proj, 1.0), ("k_proj", attn.k_proj, 1.0), ("v_proj", attn.v_proj, beta)]
    named += [("o_proj", attn.o_proj, beta), ("up_proj", mlp.up_proj, beta), ("down_proj", mlp.down_proj, beta)]
    for name, linear, gain in named:
        std, want = linear.weight.std().item(), _xavier_std(linear, gain)
        case = f"init(block, n_layers={n_layers}): the std of {name} ({tuple(linear.weight.shape)})"
        if gain == 1.0 and abs(std / _xavier_std(linear, beta) - 1) < 0.05:
            g.expect(
                case,
                False,
                "q and k keep Xavier's gain 1: DeepNet shrinks only v, o and the FFN, the weights "
                "every value passes through; q and k only choose the attention weights",
            )
        if gain == 1.0 and abs(std / 0.02 - 1) < 0.05:
            g.expect(case, False, "q and k were left at the model's N(0, 0.02): DeepNet draws them Xavier, gain 1")
        if gain != 1.0 and abs(std / _xavier_std(linear, (16 * n_layers) ** -0.25) - 1) < 0.05:
            g.expect(case, False, "beta = (16N)^(-1/4): N counts layers (each of two sublayers), not sublayers")
        g.compare(f"{case}, Xavier normal with gain {gain:.4f}", std, want, rtol=0.05)
        g.compare(f"{case}: its mean", linear.weight.mean().item(), 0.0, atol=0.1 * want)


def check_deepnorm_fix(residual, init) -> CheckResult:
    """``residual(x, f, norm, n_layers)`` and ``init(block, n_layers)``: DeepNorm, the three bugs fixed.

    The forward is recorded, not only its output: the norm and ``f`` are spies that keep their inputs, so
    ``norm(alpha * (x + f(x)))`` fails (a norm's output does not change when its input is scaled, so it equals
    plain post-LN's), as does a norm other than the one given (a LayerNorm and an RMSNorm with learnt gains)
    or a constant alpha (n_layers = 1, 8 and 100). The init is read back from a block whose weights start as
    the model draws them, N(0, 0.02): every projection's std against Xavier's with DeepNet's gain, with an FFN
    of shape (128, 512), so a std of beta / sqrt(d_model), right for the square matrices, fails there.
    """
    g = Grader("check_deepnorm_fix")
    for seed, (n_layers, kind) in enumerate(((8, "LayerNorm"), (1, "RMSNorm"), (100, "LayerNorm"))):
        _check_residual(g, residual, n_layers, kind, seed)
    for n_layers in (8, 1, 100):
        _check_init(g, init, n_layers)
    return g.result()


# -- exercise 2: DeepNet's constants for encoder-decoder models --------------------------------------------
def deepnet_constants(n_encoder: int, n_decoder: int):
    """The reference: ((alpha, beta) of the encoder or None, (alpha, beta) of the decoder or None)."""
    N, M = n_encoder, n_decoder
    if M == 0:
        return ((2 * N) ** 0.25, (8 * N) ** -0.25), None
    if N == 0:
        return None, ((2 * M) ** 0.25, (8 * M) ** -0.25)
    return (0.81 * (N**4 * M) ** (1 / 16), 0.87 * (N**4 * M) ** (-1 / 16)), ((3 * M) ** 0.25, (12 * M) ** -0.25)


def check_deepnorm_constants(fn) -> CheckResult:
    """``fn(n_encoder, n_decoder)``: DeepNet's (alpha, beta) for each stack; 0 layers means no such stack.

    The cases include depths with N != M (a formula with N and M swapped agrees whenever N = M, as in the
    paper's 1,000-layer model) and both single-stack kinds.
    """
    g = Grader("check_deepnorm_constants")
    for N, M in ((6, 6), (12, 0), (0, 24), (6, 18), (18, 6), (100, 2), (500, 500)):
        got = g.call(fn, N, M)
        if g.failure is not None:
            break
        want = deepnet_constants(N, M)
        case = f"fn(n_encoder={N}, n_decoder={M})"
        if not (isinstance(got, tuple | list) and len(got) == 2):
            g.expect(case, False, f"return two entries, (encoder pair or None, decoder pair or None); got {got!r}")
            break
        if N and M and _close(got[1], ((2 * M) ** 0.25, (8 * M) ** -0.25)):
            g.expect(case, False, "a decoder layer of an encoder-decoder model has three sublayers, not two")
        if N != M and M and _close(got[0], deepnet_constants(M, N)[0]):
            g.expect(case, False, "the encoder's pair has N and M swapped: (N^4 M), the encoder's own depth to the 4th")
        for stack, got_pair, want_pair in zip(("encoder", "decoder"), got, want, strict=True):
            if want_pair is None or got_pair is None:
                g.expect(f"{case}, the {stack}", want_pair is got_pair, f"expected {want_pair}, got {got_pair}")
            else:
                g.compare(f"{case}, the {stack}'s (alpha, beta)", tuple(got_pair), want_pair, rtol=1e-6)
    return g.result()


def _close(pair, want) -> bool:
    try:
        return all(abs(float(a) - b) <= 1e-6 * abs(b) for a, b in zip(pair, want, strict=True))
    except (TypeError, ValueError):  # None, or not a pair of numbers
        return False


# -- exercise 3: the first step's size, predicted from the initialisation ----------------------------------
GRID_CONFIG = TransformerConfig(
    vocab_size=256, d_model=64, n_heads=4, n_layers=8, max_seq_len=64, position="rope", embedding_norm=True
)  # the lesson's grid model; n_layers and norm_placement vary


@functools.cache
def _measured_first_update(placement: str, n_layers: int, lr: float) -> float:
    """Adam's first update of the last W_down of the grid model (seed 0), relative to its initial value."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny kernels: one thread is faster, and far faster on a busy machine
    try:
        with torch.random.fork_rng():  # the learner's random state stays as it was
            torch.manual_seed(0)
            cfg = TransformerConfig(**{**GRID_CONFIG.__dict__, "n_layers": n_layers, "norm_placement": placement})
            model = CausalLM(cfg)
        ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
        lm_loss(model(ids), ids).backward()
    finally:
        torch.set_num_threads(threads)
    down = model.transformer.blocks[-1].mlp.down_proj.weight
    return adam_first_update(down.grad, down.detach(), lr, 1e-8)


def check_first_update_prediction(fn) -> CheckResult:
    """``fn(placement, n_layers, lr)``: ||dW|| / ||W|| of Adam's first step on the grid model's last W_down.

    Graded against the step itself, taken on a real gradient: the 8-layer models at lr 3e-3 first (the three
    predictions), then 2 and 24 layers at 1e-3, so a table of the three 8-layer numbers fails.
    """
    g = Grader("check_first_update_prediction")
    cases = [(p, 8, 3e-3) for p in ("post", "pre", "deepnorm")] + [
        (p, L, 1e-3) for L in (2, 24) for p in ("post", "deepnorm")
    ]
    for placement, n_layers, lr in cases:
        got = g.call(fn, placement, n_layers, lr)
        want = _measured_first_update(placement, n_layers, lr)
        case = f"fn({placement!r}, n_layers={n_layers}, lr={lr:g})"
        if isinstance(got, float | int) and abs(got / (lr / 0.02) - 1) < 0.05 and abs(want / (lr / 0.02) - 1) > 0.1:
            g.expect(
                case, False, "that is a std of 0.02; look at how reset_parameters draws W_down (and at DeepNorm's)"
            )
        g.compare(f"{case}, measured on the model", got, want, rtol=0.05)
    return g.result()
