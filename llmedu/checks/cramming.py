"""Graders for lesson 22, the capstone (Cramming): packing, sparse prediction, the wall-clock budget.

check_pack(fn)                 fn(documents, seq_len, cls_id, sep_id) -> (n_rows, seq_len) rows: the
                               stream doc_0 [SEP] doc_1 [SEP] ... cut into rows opening with [CLS], no padding
check_sparse_mlm_loss(fn)      fn(model, batch) -> the MLM loss computed by running the head on the
                               masked positions only; it must equal the loss of the full head
check_parse_budget(fn)         fn("10m") -> 600.0; '30s', '24h', '1.5h', seconds; a ValueError otherwise
"""

from __future__ import annotations

import torch

from llmedu.checks.core import CheckResult, Grader
from llmedu.cramming.recipe import TINY_SHAPE, crammed, parse_budget
from llmedu.data.packing import mask_tokens, pack
from llmedu.models import MaskedLM
from llmedu.models.bert import mlm_loss

__all__ = ["check_pack", "check_sparse_mlm_loss", "check_parse_budget"]


def check_pack(fn) -> CheckResult:
    """Compare ``fn`` with ``llmedu.data.packing.pack`` on documents of awkward lengths."""
    g = Grader("check_pack")
    cases = [([[5, 6, 7], [8, 9]], 4), ([list(range(10, 40))], 8), ([[11], [12], [13], [14], [15]], 3)]
    for docs, seq_len in cases:
        expected = pack(docs, seq_len, cls_id=2, sep_id=3)
        got = g.call(fn, docs, seq_len, 2, 3)
        g.compare(f"documents of lengths {[len(d) for d in docs]}, seq_len={seq_len}", got, expected)
    return g.result()


def check_sparse_mlm_loss(fn) -> CheckResult:
    """``fn(model, batch)`` against the full head's loss, and its gradients against the full head's."""
    g = Grader("check_sparse_mlm_loss")
    recipe = crammed(**TINY_SHAPE)
    torch.manual_seed(0)
    model = MaskedLM(recipe.model)
    ids = torch.randint(5, recipe.model.vocab_size, (4, 32))  # (B, T)
    inputs, labels = mask_tokens(
        ids, 0.15, 4, recipe.model.vocab_size, [0, 1, 2, 3, 4], torch.Generator().manual_seed(0)
    )
    batch = {"input_ids": inputs, "labels": labels}
    expected = mlm_loss(model(inputs), labels)
    expected.backward()
    expected_grad = model.transformer.tok_embed.weight.grad.clone()
    model.zero_grad()
    got = g.call(fn, model, batch)
    if g.compare("the loss over the masked positions", got, expected.detach(), rtol=1e-5, atol=1e-6):
        got.backward()
        g.compare(
            "the gradient of the token embeddings",
            model.transformer.tok_embed.weight.grad,
            expected_grad,
            rtol=1e-4,
            atol=1e-7,
        )
    return g.result()


def check_parse_budget(fn) -> CheckResult:
    g = Grader("check_parse_budget")
    for text in ("30s", "10m", "24h", "1.5h", "90"):
        g.compare(repr(text), g.call(fn, text), parse_budget(text))

    def rejects(text: str) -> bool:
        try:
            fn(text)
        except ValueError:
            return True
        return False

    for text in ("ten minutes", "-5m", "0s"):
        g.expect(f"{text!r} is rejected", g.call(rejects, text) is True, "no ValueError was raised")
    return g.result()
