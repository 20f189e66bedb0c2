"""Pruning: unstructured magnitude masks, 2:4 semi-structured masks, and attention heads by importance.

* **Magnitude pruning** (Han et al. 2015, "Learning both Weights and Connections"): zero the fraction
  ``sparsity`` of weights with the smallest |w|. ``scope="global"`` ranks all given weights together
  (one threshold, so layers lose different fractions); ``scope="layer"`` prunes each tensor to the same
  fraction. Exactly ``round(sparsity * n)`` weights are zeroed, ties broken by position.
* **N:M semi-structured sparsity** (2:4: Mishra et al. 2021, "Accelerating Sparse Deep Neural
  Networks"): in every group of M consecutive *input* weights of a row of ``W`` (out, in), keep the N of
  largest magnitude. NVIDIA's sparse tensor cores (Ampere and later) skip the zeros: the matrix is
  stored as its N/M kept values plus a 2-bit index each. A CPU has no such unit: torch's
  semi-structured kernels (``torch.sparse.to_sparse_semi_structured``) are CUDA-only, so on a CPU a
  2:4-pruned matrix is a dense matrix with zeros in it, as large and as fast as before.
* **Head pruning** (Michel et al. 2019, "Are Sixteen Heads Really Better than One?", sec. 4): a gate
  xi_h multiplies each head's output; the importance of a head is E_x |dL(x)/d xi_h| at xi = 1, summed
  over a dev set. The gates here are per example, so the absolute value is taken per example as the
  paper's expectation says (a batch gradient would let examples cancel). Scores are normalised per
  layer by their l2 norm (the paper's sec. 4.1). ``remove_heads`` then cuts the pruned heads out of the
  query/key/value and output matrices, so the model really shrinks.

Fine-tuning after pruning: ``apply_masks`` again after every optimizer step (a callback of
``llmedu.train.loop.train``), so that the optimizer's momentum cannot regrow a pruned weight.

Left out: iterative pruning schedules (gradual magnitude pruning, Zhu & Gupta 2017), movement pruning,
and storing unstructured masks in a sparse format (CSR would only pay off above ~50-70% sparsity).
Works on ``transformers``' BERT modules (``attention.self`` returns ``(output, weights)``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "linear_weights",
    "magnitude_masks",
    "nm_mask",
    "nm_masks",
    "apply_masks",
    "sparsity",
    "is_nm_sparse",
    "HeadGates",
    "head_importance",
    "heads_to_prune",
    "remove_heads",
]


def _check_ratio(ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise ValueError(f"pruning ratio (sparsity) must be a number in [0, 1), got {ratio!r}")
    return float(ratio)


def linear_weights(model: nn.Module, within: str = "encoder.") -> dict[str, nn.Parameter]:
    """The weight matrices of the ``nn.Linear`` layers whose name contains ``within`` (default: the
    transformer blocks, not the embeddings, pooler or classifier head)."""
    found = {
        f"{name}.weight": m.weight for name, m in model.named_modules() if isinstance(m, nn.Linear) and within in name
    }
    if not found:
        raise ValueError(f"no nn.Linear layer with {within!r} in its name")
    return found


def magnitude_masks(weights: dict[str, torch.Tensor], ratio: float, scope: str = "global") -> dict[str, torch.Tensor]:
    """Boolean keep-masks (True = keep) that zero the fraction ``ratio`` of smallest |w|."""
    ratio = _check_ratio(ratio)
    if scope not in ("global", "layer"):
        raise ValueError(f"scope must be 'global' or 'layer', got {scope!r}")
    if scope == "layer":
        return {name: magnitude_masks({name: w}, ratio)[name] for name, w in weights.items()}
    flat = torch.cat([w.detach().abs().flatten() for w in weights.values()])  # (N,)
    keep = torch.ones_like(flat, dtype=torch.bool)
    n_prune = round(ratio * flat.numel())
    if n_prune:
        keep[flat.topk(n_prune, largest=False).indices] = False  # exactly n_prune, whatever the ties
    masks, start = {}, 0
    for name, w in weights.items():
        masks[name] = keep[start : start + w.numel()].view(w.shape)
        start += w.numel()
    return masks


def nm_mask(weight: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """Keep-mask of ``weight`` (out, in): in each group of ``m`` consecutive inputs, the ``n`` largest |w|."""
    if weight.dim() != 2:
        raise ValueError(f"N:M masks are for matrices (out, in), got a tensor of shape {tuple(weight.shape)}")
    if not 0 < n < m:
        raise ValueError(f"need 0 < n < m, got n={n}, m={m}")
    out_features, in_features = weight.shape
    if in_features % m:
        raise ValueError(f"in_features={in_features} is not divisible by the group size m={m}")
    groups = weight.detach().abs().reshape(out_features, in_features // m, m)  # (out, in/m, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(n, dim=-1).indices, True)
    return keep.reshape(out_features, in_features)


def nm_masks(weights: dict[str, torch.Tensor], n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    return {name: nm_mask(w, n, m) for name, w in weights.items()}


@torch.no_grad()
def apply_masks(weights: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]) -> None:
    """Zero, in place, the weights whose mask is False."""
    for name, mask in masks.items():
        if weights[name].shape != mask.shape:
            raise ValueError(f"mask of {name} has shape {tuple(mask.shape)}, its weight {tuple(weights[name].shape)}")
        weights[name].mul_(mask)


def sparsity(tensors: dict[str, torch.Tensor]) -> float:
    """Fraction of zeros over all the tensors (for boolean masks: of False)."""
    zeros = sum((t == 0).sum().item() for t in tensors.values())
    return zeros / sum(t.numel() for t in tensors.values())


def is_nm_sparse(weight: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """True when every group of ``m`` consecutive inputs of each row has at most ``n`` non-zeros."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // m, m)  # (out, in/m, m)
    return bool(((groups != 0).sum(-1) <= n).all())


# -- attention heads (Michel et al. 2019) -------------------------------------------------------------


class HeadGates:
    """Multiply each head's output by a gate: ``with HeadGates(model) as g:``, ``g.gates`` is (L, H).

    ``per_example=True`` makes the gates (B, L, H) for a batch of B (set ``g.batch_size`` before each
    forward), so that d loss / d gate is each example's own derivative.
    """

    def __init__(self, model: nn.Module, per_example: bool = False):
        self.layers = [layer.attention.self for layer in model.bert.encoder.layer]
        cfg = model.config
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        self.per_example = per_example
        self.gates = torch.ones(len(self.layers), self.n_heads)  # (L, H)
        self._handles = []

    def _hook(self, index: int):
        def gate_output(module, args, output):
            context, weights = output  # context (B, T, H * D)
            B, T, _ = context.shape
            gate = self.gates[:, index] if self.per_example else self.gates[index].expand(B, -1)  # (B, H)
            gated = context.view(B, T, -1, self.head_dim) * gate[:, None, :, None]  # (B, T, H, D)
            return gated.view(B, T, -1), weights

        return gate_output

    def __enter__(self) -> HeadGates:
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.layers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()


def head_importance(model: nn.Module, data, n_batches: int | None = None, normalize: bool = True) -> torch.Tensor:
    """I_h = sum over examples of |dL(x)/d xi_h| at xi = 1 (Michel et al. 2019, eq. 2); (L, H).

    ``data[i]`` gives batches with ``input_ids``, ``attention_mask`` and ``labels``; the loss is the
    cross-entropy of each example. With ``normalize`` each layer's scores are divided by their l2 norm.
    """
    was_training = model.training
    model.eval()
    gates = HeadGates(model, per_example=True)
    scores = torch.zeros(len(gates.layers), gates.n_heads)  # (L, H)
    with gates:
        for i in range(n_batches if n_batches is not None else len(data)):
            b = data[i]
            B = b["input_ids"].shape[0]
            gates.gates = torch.ones(B, len(gates.layers), gates.n_heads, requires_grad=True)  # (B, L, H)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # (B, C)
            loss = nn.functional.cross_entropy(logits, b["labels"], reduction="sum")  # sum: per-example grads
            (grad,) = torch.autograd.grad(loss, gates.gates)  # (B, L, H)
            scores += grad.abs().sum(0)
    model.train(was_training)
    if normalize:
        scores = scores / scores.norm(dim=1, keepdim=True).clamp_min(1e-20)
    return scores


def heads_to_prune(importance: torch.Tensor, ratio: float) -> torch.Tensor:
    """A (L, H) keep-mask that drops the fraction ``ratio`` of heads with the lowest importance, ranked
    over all layers at once (Michel et al. prune globally)."""
    ratio = _check_ratio(ratio)
    keep = torch.ones(importance.numel(), dtype=torch.bool)
    n_prune = round(ratio * importance.numel())
    if n_prune:
        keep[importance.flatten().topk(n_prune, largest=False).indices] = False
    return keep.view(importance.shape)


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    new = nn.Linear(linear.in_features, len(rows), bias=linear.bias is not None)
    with torch.no_grad():
        new.weight.copy_(linear.weight[rows])
        if linear.bias is not None:
            new.bias.copy_(linear.bias[rows])
    return new


@torch.no_grad()
def remove_heads(model: nn.Module, keep: torch.Tensor) -> None:
    """Cut the heads whose ``keep`` (L, H) is False out of each layer, in place: the query, key and
    value matrices lose those output rows and the output projection those input columns.

    ``keep`` always numbers the heads as the model was built (H = ``config.num_attention_heads``), so a
    second call removes its heads from what the first left: two calls equal one with the union removed.
    Each layer records the original numbers of the heads it still has (``attention.self.kept_heads``)."""
    layers = model.bert.encoder.layer
    n_heads = model.config.num_attention_heads
    if keep.shape != (len(layers), n_heads):
        raise ValueError(f"keep must be (layers, heads) = {(len(layers), n_heads)}, got {tuple(keep.shape)}")
    head_dim = model.config.hidden_size // n_heads
    plans = []  # (layer, the original numbers of the heads it has now, those it keeps)
    for i, (layer, keep_heads) in enumerate(zip(layers, keep.tolist())):
        present = getattr(layer.attention.self, "kept_heads", None)
        if present is None:  # never cut here: every head is present
            n_now = layer.attention.self.query.out_features // head_dim
            if n_now != n_heads:
                raise ValueError(
                    f"layer {i} has {n_now} of {n_heads} heads but no record of which (cut by other code): "
                    "remove heads from the original model in one call, or with remove_heads only"
                )
            present = list(range(n_heads))
        plans.append((layer, present, [h for h in present if keep_heads[h]]))
    empty = [i for i, (_, _, kept) in enumerate(plans) if not kept]
    if empty:  # checked for every layer before any is cut
        raise ValueError(f"every layer must keep at least one head; layers {empty} keep none")
    for layer, present, kept in plans:
        if len(kept) == len(present):
            continue  # nothing removed here
        places = torch.tensor([present.index(h) for h in kept])  # where the kept heads sit in today's matrices
        rows = (places[:, None] * head_dim + torch.arange(head_dim)).flatten()  # (kept * D,)
        attn = layer.attention
        for name in ("query", "key", "value"):
            setattr(attn.self, name, _keep_rows(getattr(attn.self, name), rows))
        dense = attn.output.dense
        new = nn.Linear(len(rows), dense.out_features)
        new.weight.copy_(dense.weight[:, rows])
        new.bias.copy_(dense.bias)
        attn.output.dense = new
        attn.self.kept_heads = kept  # original head numbers, for the next call
        attn.self.num_attention_heads = len(kept)  # the forward infers the count; kept for readers
        attn.self.all_head_size = len(rows)
