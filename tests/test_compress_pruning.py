"""Pruning masks have the stated sparsity and pattern; head gates and head removal agree with an oracle.

Models are the tiny random BERT of tests/conftest.py, so the file runs in seconds.
"""

import copy
import itertools

import pytest
import torch

from llmedu.compress.pruning import (
    HeadGates,
    apply_masks,
    head_importance,
    heads_to_prune,
    is_nm_sparse,
    linear_weights,
    magnitude_masks,
    nm_mask,
    nm_masks,
    remove_heads,
    sparsity,
)

IDS = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(0))
MASK = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 3 + [0] * 4])  # padded rows too
LABELS = torch.tensor([0, 1, 1])


def logits(model, ids=IDS, mask=MASK):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5, 0.9])
def test_global_magnitude_masks_prune_exactly_the_smallest(ratio, tiny_bert):
    weights = linear_weights(tiny_bert)
    masks = magnitude_masks(weights, ratio, scope="global")
    n = sum(w.numel() for w in weights.values())
    assert sum((~m).sum().item() for m in masks.values()) == round(ratio * n)  # the stated sparsity, exactly
    if ratio:
        kept = torch.cat([w.abs()[m] for w, m in zip(weights.values(), masks.values())])
        pruned = torch.cat([w.abs()[~m] for w, m in zip(weights.values(), masks.values())])
        assert pruned.max() <= kept.min()  # one threshold over all layers


def test_layer_magnitude_masks_give_each_tensor_the_ratio(tiny_bert):
    weights = linear_weights(tiny_bert)
    masks = magnitude_masks(weights, 0.5, scope="layer")
    for name, w in weights.items():
        assert (~masks[name]).sum().item() == round(0.5 * w.numel())
        assert w.abs()[~masks[name]].max() <= w.abs()[masks[name]].min()


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, True, "0.5", float("nan")])
def test_ratio_outside_zero_one_is_a_clear_error(bad, tiny_bert):
    with pytest.raises(ValueError, match=r"pruning ratio .* \[0, 1\)"):
        magnitude_masks(linear_weights(tiny_bert), bad)
    with pytest.raises(ValueError, match=r"pruning ratio"):
        heads_to_prune(torch.rand(2, 4), bad)


def test_unknown_scope_is_an_error(tiny_bert):
    with pytest.raises(ValueError, match="scope"):
        magnitude_masks(linear_weights(tiny_bert), 0.5, scope="row")


def test_two_four_mask_keeps_the_two_largest_of_each_group_of_four():
    w = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    mask = nm_mask(w)
    for row, group in itertools.product(range(6), range(4)):  # oracle: sort each group by hand
        block = w[row, 4 * group : 4 * group + 4].abs().tolist()
        largest = sorted(range(4), key=lambda i: -block[i])[:2]
        assert mask[row, 4 * group : 4 * group + 4].nonzero().flatten().tolist() == sorted(largest)
    assert sparsity({"w": mask}) == 0.5


def test_two_four_masks_on_a_model_give_the_pattern_and_half_the_weights(tiny_bert):
    model = copy.deepcopy(tiny_bert)
    weights = linear_weights(model)
    apply_masks(weights, nm_masks(weights))
    assert all(is_nm_sparse(w, 2, 4) for w in weights.values())
    assert sparsity(weights) == 0.5  # random weights have no exact zeros of their own
    assert not is_nm_sparse(linear_weights(tiny_bert)["bert.encoder.layer.0.output.dense.weight"])  # the original


def test_nm_mask_errors():
    with pytest.raises(ValueError, match="not divisible by the group size"):
        nm_mask(torch.randn(4, 10))
    with pytest.raises(ValueError, match="matrices"):
        nm_mask(torch.randn(8))
    with pytest.raises(ValueError, match="0 < n < m"):
        nm_mask(torch.randn(4, 8), n=4, m=4)
    with pytest.raises(ValueError, match="has shape"):
        apply_masks({"w": torch.randn(4, 8)}, {"w": torch.ones(8, 4, dtype=torch.bool)})


def test_masks_survive_fine_tuning_when_reapplied(tiny_bert):
    from llmedu.train.loop import TrainConfig, train

    model = copy.deepcopy(tiny_bert).train()
    weights = linear_weights(model)
    masks = magnitude_masks(weights, 0.5)
    apply_masks(weights, masks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(**batch).logits, LABELS)

    train(
        model,
        optimizer,
        lambda i: {"input_ids": IDS, "attention_mask": MASK},
        loss_fn,
        TrainConfig(max_steps=3, progress=False),
        callbacks=[lambda info: apply_masks(weights, masks)],
    )
    assert sparsity(weights) == 0.5  # Adam's momentum would otherwise regrow the pruned weights
    assert not torch.equal(logits(model), logits(tiny_bert))  # and the rest did train


def test_gates_at_one_change_nothing_and_a_zero_gate_silences_exactly_that_head(tiny_bert):
    with HeadGates(tiny_bert) as gates:
        assert torch.equal(logits(tiny_bert), logits(copy.deepcopy(tiny_bert)))
        gates.gates[1, 2] = 0.0
        gated = logits(tiny_bert)
    # oracle: zero head 2's value projection in layer 1; its attention then averages zero vectors
    oracle = copy.deepcopy(tiny_bert)
    value = oracle.bert.encoder.layer[1].attention.self.value
    with torch.no_grad():
        value.weight[2 * 8 : 3 * 8] = 0  # head_dim = 32 / 4 = 8
        value.bias[2 * 8 : 3 * 8] = 0
    torch.testing.assert_close(gated, logits(oracle), atol=1e-6, rtol=1e-5)  # fp32, a few ulps of O(1) logits
    assert torch.equal(logits(tiny_bert), logits(copy.deepcopy(tiny_bert)))  # hooks removed on exit


def test_head_importance_is_the_sum_of_per_example_absolute_gradients(tiny_bert):
    class Data:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return {"input_ids": IDS, "attention_mask": MASK, "labels": LABELS}

    ours = head_importance(tiny_bert, Data(), normalize=False)
    oracle = torch.zeros(2, 4)  # one example at a time, one gate for all positions
    for b in range(3):
        gates = HeadGates(tiny_bert)
        gates.gates = torch.ones(2, 4, requires_grad=True)
        with gates:
            out = tiny_bert(input_ids=IDS[b : b + 1], attention_mask=MASK[b : b + 1]).logits
            loss = torch.nn.functional.cross_entropy(out, LABELS[b : b + 1])
            oracle += torch.autograd.grad(loss, gates.gates)[0].abs()
    torch.testing.assert_close(ours, oracle, atol=1e-6, rtol=1e-5)  # fp32 sums of three gradients
    normalized = head_importance(tiny_bert, Data())
    torch.testing.assert_close(normalized.norm(dim=1), torch.ones(2))


def test_heads_to_prune_drops_the_least_important():
    importance = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.8, 0.2, 0.7, 0.6]])
    keep = heads_to_prune(importance, 0.25)
    assert keep.tolist() == [[False, True, True, True], [True, False, True, True]]
    assert heads_to_prune(importance, 0.0).all()


def test_removing_heads_equals_gating_them_to_zero(tiny_bert):
    keep = torch.tensor([[True, False, True, False], [False, True, True, True]])
    with HeadGates(tiny_bert) as gates:
        gates.gates = keep.float()
        gated = logits(tiny_bert)
    removed = copy.deepcopy(tiny_bert)
    remove_heads(removed, keep)
    torch.testing.assert_close(logits(removed), gated, atol=1e-6, rtol=1e-5)  # fp32, same sums reordered
    assert removed.bert.encoder.layer[0].attention.self.query.weight.shape == (16, 32)  # 2 heads of 8 kept
    assert removed.bert.encoder.layer[0].attention.output.dense.weight.shape == (32, 16)
    n_before = sum(p.numel() for p in tiny_bert.parameters())
    n_after = sum(p.numel() for p in removed.parameters())
    assert n_before - n_after == 3 * (4 * 8 * 32 + 3 * 8)  # 3 heads: q, k, v rows + biases, o columns


def test_remove_heads_errors(tiny_bert):
    model = copy.deepcopy(tiny_bert)
    with pytest.raises(ValueError, match="at least one head"):
        remove_heads(model, torch.tensor([[False] * 4, [True] * 4]))
    with pytest.raises(ValueError, match="must be"):
        remove_heads(model, torch.ones(3, 4, dtype=torch.bool))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the claim is about the CPU")
def test_torch_packs_two_four_matrices_only_on_cuda():
    """The lesson says a CPU runs a 2:4 matrix dense: torch's packed format refuses CPU tensors."""
    w = torch.randn(64, 64)
    w = w * nm_mask(w)
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.sparse.to_sparse_semi_structured(w)
