"""Lesson 03's graders: each passes a right answer, and fails a plausible wrong value and a right value
computed the wrong way. Also the placement study's collapse rule, on which the lesson's counts rest."""

import math

import pytest
import torch
import torch.nn.functional as F

from llmedu.checks.nn import check_fixed_layernorm, check_rmsnorm_as_layernorm
from llmedu.checks.norms import GRID_DOWN_STD, check_adam_first_update
from llmedu.nn.placement_study import Run, Variant, collapse_counts, collapsed, unigram_loss


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
