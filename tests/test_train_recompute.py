"""Activation recomputation: the same gradients (dropout on), less activation memory."""

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from llmedu.memory import MemoryTracker
from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.train import POLICIES, apply_policy
from llmedu.train.recompute import checkpoint, recompute_modules, restore

CONFIG = TransformerConfig.gpt2(
    vocab_size=64, d_model=32, n_layers=4, n_heads=4, max_seq_len=64, dropout=0.1, attn_impl="math"
)


def gpt(policy: str) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(CONFIG)
    apply_policy(model, policy)
    return model


def batch() -> torch.Tensor:
    return torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))  # (B, T)


def grads_and_loss(model: CausalLM):
    torch.manual_seed(123)  # the dropout masks of the forward pass
    ids = batch()
    loss = lm_loss(model(ids), ids)
    loss.backward()
    after = torch.rand(1)  # recomputation must not disturb the caller's random stream
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, after


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "none"])
def test_recompute_gives_the_same_gradients_with_dropout(policy):
    loss0, grads0, after0 = grads_and_loss(gpt("none"))
    loss1, grads1, after1 = grads_and_loss(gpt(policy))
    assert torch.equal(loss0, loss1) and torch.equal(after0, after1)
    for name in grads0:
        # the recomputed forward runs the same ops on the same inputs with the same dropout masks;
        # only the order in which a tied weight's gradients are summed may differ: fp32 rounding
        torch.testing.assert_close(grads1[name], grads0[name], rtol=0, atol=1e-6, msg=name)


def test_the_gradient_test_can_fail_without_the_restored_rng(monkeypatch):
    """If backward did not restore the forward's RNG state, dropout would draw new masks."""
    _, grads0, _ = grads_and_loss(gpt("none"))
    monkeypatch.setattr(torch, "set_rng_state", lambda state: None)  # recompute with whatever RNG is current
    _, grads1, _ = grads_and_loss(gpt("blocks"))
    assert any(not torch.allclose(grads1[n], grads0[n], atol=1e-6) for n in grads0)


def test_checkpoint_matches_torch_utils_checkpoint():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Dropout(0.5), torch.nn.GELU(), torch.nn.Linear(32, 16)
    )
    x = torch.randn(8, 16, requires_grad=True)

    def run(fn):
        layer.zero_grad()
        x.grad = None
        torch.manual_seed(7)
        fn(layer, x).pow(2).sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    ours = run(lambda f, x: checkpoint(f, x))
    theirs = run(lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=False))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same ops, same order: bit for bit


def activation_peak(policy: str) -> tuple[int, int]:
    model = gpt(policy)
    ids = batch()
    with MemoryTracker(model) as mt:
        lm_loss(model(ids), ids).backward()
    return mt.peak_bytes, mt.peak_by_category()["activations"]


def test_recompute_lowers_the_measured_peak():
    none, none_act = activation_peak("none")
    peaks = {policy: activation_peak(policy) for policy in ("blocks", "sqrt", "attention")}
    for policy, (peak, act) in peaks.items():
        assert peak < none and act < none_act, (policy, peak, none, act, none_act)
    # keeping one input per block instead of all of its insides: the activations shrink by more than half
    assert peaks["blocks"][1] < 0.5 * none_act, (peaks, none_act)


def test_bad_use_is_an_error_and_restore_undoes_it():
    model = gpt("blocks")
    assert restore(model) == CONFIG.n_layers
    assert restore(model) == 0
    with pytest.raises(ValueError, match="unknown recomputation policy"):
        apply_policy(model, "everything")
    with pytest.raises(TypeError, match="Transformer"):
        apply_policy(torch.nn.Linear(2, 2), "blocks")
    lin = torch.nn.Linear(4, 4)
    recompute_modules([lin])
    with pytest.raises(RuntimeError, match="already"):
        recompute_modules([lin])
    with pytest.raises(ValueError, match="requires grad"):
        lin(torch.randn(2, 4))  # no input requires grad: the weights would get no gradient
    with torch.no_grad():
        assert lin(torch.randn(2, 4)).shape == (2, 4)  # inference needs no recomputation
    keys = set(gpt("none").state_dict())
    assert set(gpt("sqrt").state_dict()) == keys  # names unchanged: checkpoints still load
