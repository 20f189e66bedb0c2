"""Lesson 03's graders: each passes a right answer, and fails a plausible wrong value and a right value
computed the wrong way. Also the placement study's collapse rule, on which the lesson's counts rest."""

import math

import pytest
import torch
import torch.nn.functional as F

from llmedu.checks.nn import check_fixed_layernorm, check_rmsnorm_as_layernorm
from llmedu.checks.norms import (
    GRID_DOWN_STD,
    check_adam_first_update,
    check_deepnorm_constants,
    check_deepnorm_fix,
    check_first_update_prediction,
)
from llmedu.nn.norms import deepnorm_constants, deepnorm_init_
from llmedu.nn.placement_study import Run, Variant, collapse_counts, collapsed, first_step_below, unigram_loss


def _layernorm(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt((x - mean).pow(2).mean(-1, keepdim=True) + eps) * w + b


def test_fixed_layernorm():
    assert check_fixed_layernorm(_layernorm)
    # wrong value: the lesson's buggy norm, one mean and one (unbiased) variance per sequence
    assert not check_fixed_layernorm(
        lambda x, w, b, eps: (x - x.mean((1, 2), keepdim=True)) / torch.sqrt(x.var((1, 2), keepdim=True) + eps) * w + b
    )
    # right value the wrong way: statistics kept from the first call, as BatchNorm's running statistics; the
    # first call's output is exact and no other token moves when one changes
    cache = {}

    def running_statistics(x, w, b, eps):
        if x.shape not in cache:
            cache[x.shape] = (x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False))
        mean, var = cache[x.shape]
        return (x - mean) / torch.sqrt(var + eps) * w + b

    assert not check_fixed_layernorm(running_statistics)
    # right value the wrong way: the library's norm does the work the exercise asks for
    assert not check_fixed_layernorm(lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps))
    assert not check_fixed_layernorm(lambda x, w, b, eps: torch.layer_norm(x, x.shape[-1:], w, b, eps))
    # RMSNorm of the centred input is LayerNorm, but F.rms_norm decomposes into elementwise ATen ops on CPU,
    # so only the Python-level record sees that a library norm did the division
    assert not check_fixed_layernorm(
        lambda x, w, b, eps: F.rms_norm(x - x.mean(-1, keepdim=True), x.shape[-1:], w, eps) + b
    )
    assert not check_fixed_layernorm(
        lambda x, w, b, eps: torch.nn.RMSNorm(x.shape[-1], eps=eps)(x - x.mean(-1, keepdim=True)) * w + b
    )


def test_rmsnorm_as_layernorm():
    assert check_rmsnorm_as_layernorm(lambda x: x - x.mean(-1, keepdim=True))
    assert not check_rmsnorm_as_layernorm(lambda x: x / x.std(-1, keepdim=True))  # wrong value: scales, no centring
    # right value the wrong way: LayerNorm(x) is already normalised, so RMSNorm nearly keeps it, but it normalises
    # twice, and where eps is not negligible against the variance the second division moves it
    assert not check_rmsnorm_as_layernorm(lambda x: F.layer_norm(x, x.shape[-1:], eps=1e-5))


def test_adam_first_update():
    def right(grad, weight, lr, eps):
        return (lr * grad / (grad.abs() + eps)).norm().item() / weight.norm().item()

    def with_torch_adam(grad, weight, lr, eps):  # the other right way: let torch.optim.Adam take the step
        w = torch.nn.Parameter(weight.clone())
        w.grad = grad.clone()
        torch.optim.Adam([w], lr=lr, eps=eps).step()
        return ((w.detach() - weight).norm() / weight.norm()).item()

    assert check_adam_first_update(right)
    assert check_adam_first_update(with_torch_adam)
    # wrong value: SGD's step, proportional to the gradient
    assert not check_adam_first_update(lambda g, w, lr, eps: lr * g.norm().item() / w.norm().item())
    # right value the wrong way: every entry moves by lr, true for most gradients but not near eps or at zeros
    assert not check_adam_first_update(lambda g, w, lr, eps: lr * math.sqrt(g.numel()) / w.norm().item())
    assert not check_adam_first_update(lambda g, w, lr, eps: (lr * g.sign()).norm().item() / w.norm().item())


def test_adam_grader_draws_the_grid_models_init():
    # the exercise is about the 8-layer grid model, whose last W_down starts at 0.02 / sqrt(2L), not GPT-2's 0.02
    from llmedu.models import CausalLM, TransformerConfig

    torch.manual_seed(0)
    for placement in ("post", "pre"):
        cfg = TransformerConfig(
            vocab_size=256, d_model=64, n_heads=4, n_layers=8, max_seq_len=64, position="rope", norm_placement=placement
        )
        std = CausalLM(cfg).transformer.blocks[-1].mlp.down_proj.weight.std().item()
        assert std == pytest.approx(GRID_DOWN_STD, rel=0.05)


def test_collapse_rule():
    assert collapsed(3.30, baseline=3.316)  # on the line: nothing learnt that uses context
    assert collapsed(3.25, baseline=3.316)  # within the margin of 0.1
    assert not collapsed(3.20, baseline=3.316)
    assert collapsed(float("nan"), baseline=3.316) and collapsed(float("inf"), baseline=3.316)
    with pytest.raises(ValueError, match="baseline"):
        collapsed(3.0, baseline=float("nan"))
    runs = [Run("post", 8, s, v, 1.0) for s, v in enumerate((3.32, 2.4, float("nan")))] + [Run("pre", 8, 0, 2.3, 0.3)]
    assert collapse_counts(runs, 3.316) == {("post", 8): (2, 3), ("pre", 8): (0, 1)}
    assert Variant("post", warmup=60).name == "post + warm-up 60" and Variant("pre").name == "pre"


def test_unigram_loss_is_the_frequency_model():
    train = torch.tensor([0, 0, 0, 1])  # add-one counts 4 and 2 over a vocabulary of 2: p(0) = 2/3
    held_out = torch.tensor([[1, 0, 0]])  # the first token of a row is not predicted
    assert unigram_loss(train, held_out, 2) == pytest.approx(-math.log(2 / 3))


def test_train_run_small_and_its_refusals():
    from llmedu.models import TransformerConfig
    from llmedu.nn.placement_study import run_grid, train_run

    cfg = TransformerConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=1, max_seq_len=8, position="rope")
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    runs = run_grid(cfg, [Variant("post"), Variant("pre", warmup=1)], [1, 2], [0], 3, 1e-3, lambda i: ids, ids)
    assert [(r.variant, r.n_layers) for r in runs] == [
        ("post", 1),
        ("pre + warm-up 1", 1),
        ("post", 2),
        ("pre + warm-up 1", 2),
    ]
    assert all(len(r.curve) == 3 and math.isfinite(r.valid_loss) and -1 <= r.cosine <= 1 + 1e-6 for r in runs)
    with pytest.raises(ValueError, match="warm-up"):
        train_run(cfg, Variant("post", warmup=3), 3, 1e-3, lambda i: ids, ids, seed=0)
    # a run whose loss turns non-finite counts as collapsed instead of stopping the grid
    nan_ids = lambda i: ids  # noqa: E731
    run = train_run(cfg, Variant("pre"), 3, float("inf"), nan_ids, ids, seed=0)
    assert math.isnan(run.valid_loss) and collapsed(run.valid_loss, baseline=3.0)


# -- exercise 1: the DeepNorm bug hunt ----------------------------------------------------------------------
def _residual(x, f, norm, n_layers):
    return norm((2 * n_layers) ** 0.25 * x + f(x))


def _init(block, n_layers, gain_qk=1.0, n_for_beta=None):
    beta = (8 * (n_for_beta or n_layers)) ** -0.25
    for linear in (block.attn.q_proj, block.attn.k_proj):
        torch.nn.init.xavier_normal_(linear.weight, gain=gain_qk if gain_qk != "beta" else beta)
    for linear in (block.attn.v_proj, block.attn.o_proj, *block.mlp.projections()):
        torch.nn.init.xavier_normal_(linear.weight, gain=beta)


def test_deepnorm_fix_passes_right_answers():
    assert check_deepnorm_fix(_residual, _init)
    assert check_deepnorm_fix(_residual, lambda block, n: deepnorm_init_(block, deepnorm_constants(n)[1]))
    # Xavier uniform has Xavier normal's std: the fix is about the gains, not the distribution
    assert check_deepnorm_fix(
        lambda x, f, norm, n: norm(x * deepnorm_constants(n)[0] + f(x)),
        lambda block, n: [
            torch.nn.init.xavier_uniform_(
                lin.weight, gain=1.0 if lin in (block.attn.q_proj, block.attn.k_proj) else deepnorm_constants(n)[1]
            )
            for lin in (
                block.attn.q_proj,
                block.attn.k_proj,
                block.attn.v_proj,
                block.attn.o_proj,
                *block.mlp.projections(),
            )
        ],
    )


def test_deepnorm_fix_fails_each_of_the_three_bugs():
    # plausible wrong values: the lesson's buggy code with only two of its three bugs fixed
    assert not check_deepnorm_fix(lambda x, f, norm, n: norm((2 * n) ** 0.25 * (x + f(x))), _init)  # alpha on both
    assert not check_deepnorm_fix(lambda x, f, norm, n: norm((4 * n) ** 0.25 * x + f(x)), _init)  # N as sublayers
    assert not check_deepnorm_fix(_residual, lambda b, n: _init(b, n, n_for_beta=2 * n))  # N as sublayers in beta
    assert not check_deepnorm_fix(_residual, lambda b, n: _init(b, n, gain_qk="beta"))  # beta on q and k too
    assert not check_deepnorm_fix(lambda x, f, norm, n: norm(x + (2 * n) ** 0.25 * f(x)), _init)  # alpha on f(x)


def test_deepnorm_fix_fails_right_values_computed_the_wrong_way():
    # the right output, but the caller's x scaled in place
    assert not check_deepnorm_fix(lambda x, f, norm, n: norm(x.mul_((2 * n) ** 0.25) + f(x / (2 * n) ** 0.25)), _init)
    # alpha of the lesson's 8 layers, (2 * 8)^(1/4) = 2, as a constant: right at 8 layers only
    assert not check_deepnorm_fix(lambda x, f, norm, n: norm(2.0 * x + f(x)), _init)
    # a LayerNorm of its own instead of the block's norm: right for a fresh LayerNorm only
    assert not check_deepnorm_fix(lambda x, f, norm, n: F.layer_norm((2 * n) ** 0.25 * x + f(x), x.shape[-1:]), _init)

    def init_square(block, n):  # beta / sqrt(d): Xavier's std for a square matrix, not for the FFN's (d, 4d)
        beta, d = (8 * n) ** -0.25, block.attn.q_proj.weight.shape[1]
        for lin in (block.attn.q_proj, block.attn.k_proj):
            torch.nn.init.normal_(lin.weight, std=1 / math.sqrt(d))
        for lin in (block.attn.v_proj, block.attn.o_proj, *block.mlp.projections()):
            torch.nn.init.normal_(lin.weight, std=beta / math.sqrt(d))

    assert not check_deepnorm_fix(_residual, init_square)

    def init_without_qk(block, n):  # "q and k do not get beta": left at the model's N(0, 0.02)
        for lin in (block.attn.v_proj, block.attn.o_proj, *block.mlp.projections()):
            torch.nn.init.xavier_normal_(lin.weight, gain=(8 * n) ** -0.25)

    assert not check_deepnorm_fix(_residual, init_without_qk)


# -- exercise 2: DeepNet's encoder-decoder constants --------------------------------------------------------
def _constants(N, M, decoder_sublayers=3, swap=False):
    if M == 0:
        return ((2 * N) ** 0.25, (8 * N) ** -0.25), None
    if N == 0:
        return None, ((2 * M) ** 0.25, (8 * M) ** -0.25)
    K = decoder_sublayers * M
    a, b = (M, N) if swap else (N, M)
    return (0.81 * (a**4 * b) ** 0.0625, 0.87 * (a**4 * b) ** -0.0625), (K**0.25, (4 * K) ** -0.25)


def test_deepnorm_constants():
    assert check_deepnorm_constants(_constants)
    assert check_deepnorm_constants(lambda N, M: [list(p) if p else None for p in _constants(N, M)])  # lists too
    # plausible wrong value: the decoder's layers counted as two sublayers, as in a decoder-only model
    assert not check_deepnorm_constants(lambda N, M: _constants(N, M, decoder_sublayers=2))
    # right value the wrong way: N and M swapped in the encoder's (N^4 M), right whenever N = M (the paper's
    # 1,000-layer model is 500 + 500)
    assert not check_deepnorm_constants(lambda N, M: _constants(N, M, swap=True))
    # the single-stack kinds: the encoder-decoder formula with M = 0 is not the encoder-only pair
    assert not check_deepnorm_constants(lambda N, M: _constants(N, max(M, 1)))


# -- exercise 3: the first update, predicted from the initialisation ----------------------------------------
def _predicted(placement, n_layers, lr, two=2):
    if placement == "deepnorm":  # Xavier normal, gain beta, on W_down (d, 4d) = (64, 256)
        std = (8 * n_layers) ** -0.25 * math.sqrt(2 / (64 + 256))
    else:
        std = 0.02 / math.sqrt(two * n_layers)
    return lr / std


def test_first_update_prediction():
    assert check_first_update_prediction(_predicted)
    # plausible wrong value: GPT-2's 0.02, without the 1/sqrt(2L) of the projections into the residual stream
    assert not check_first_update_prediction(lambda p, L, lr: lr / 0.02)
    assert not check_first_update_prediction(lambda p, L, lr: _predicted(p, L, lr, two=1))  # 1/sqrt(L)
    # DeepNorm drawn like the others: right for post and pre, wrong for DeepNorm's Xavier * beta
    assert not check_first_update_prediction(lambda p, L, lr: _predicted("pre", L, lr))
    # right values the wrong way: the three 8-layer numbers at lr 3e-3 as a table
    table = {p: _predicted(p, 8, 3e-3) for p in ("post", "pre", "deepnorm")}
    assert not check_first_update_prediction(lambda p, L, lr: table[p])


def test_first_step_below():
    curve = [3.4] * 20 + [3.1] * 20  # the mean of steps 17-26 (4 x 3.4, 6 x 3.1) is 3.22, the first below 3.25
    assert first_step_below(curve, 3.35) == 26 and first_step_below(curve, 3.2) is None
    assert first_step_below([1.0] * 10, 3.0) == 10
    with pytest.raises(ValueError, match="window"):
        first_step_below([1.0] * 5, 3.0)


def test_variant_lr_and_unscaled_init():
    from llmedu.models import TransformerConfig
    from llmedu.nn.placement_study import train_run

    assert Variant("post", lr=1e-3).name == "post at lr 0.001"
    assert Variant("post", scaled_init=False).name == "post, init 0.02"
    with pytest.raises(ValueError, match="lr"):
        Variant("post", lr=0.0)
    with pytest.raises(ValueError, match="DeepNet"):
        Variant("deepnorm", scaled_init=False)
    cfg = TransformerConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=2, max_seq_len=8, position="rope")
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    # the variant's lr is the one used: an infinite grid lr turns the loss non-finite unless the variant's replaces it
    assert math.isfinite(train_run(cfg, Variant("pre", lr=1e-3), 2, float("inf"), lambda i: ids, ids, 0).valid_loss)


def test_unscaled_init_draws_the_residual_projections_at_init_std():
    from llmedu.models import TransformerConfig
    from llmedu.nn.placement_study import build_model

    cfg = TransformerConfig(vocab_size=32, d_model=64, n_heads=2, n_layers=8, max_seq_len=8, position="rope")
    torch.manual_seed(0)
    scaled, flat = build_model(cfg, Variant("post")), build_model(cfg, Variant("post", scaled_init=False))
    for model, std in ((scaled, 0.02 / 4), (flat, 0.02)):  # 1/sqrt(2L) = 1/4 at 8 layers
        for block in model.transformer.blocks:
            for proj in (block.attn.o_proj, block.mlp.down_proj, block.attn.q_proj):
                want = 0.02 if proj is block.attn.q_proj else std
                assert proj.weight.std().item() == pytest.approx(want, rel=0.1)


def test_published_table_rows_are_configs():
    from llmedu.models.published import LLMS, print_table

    print_table()  # raises if a row is not a valid TransformerConfig
    assert {row["model"] for row in LLMS} >= {"GPT-3", "LLaMA", "Falcon", "GLM-130B"}
    with pytest.raises(ValueError):
        print_table([{**LLMS[0], "norm_placement": "middle"}])
