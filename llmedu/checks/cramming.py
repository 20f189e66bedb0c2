"""Graders for lesson 25, the capstone (Cramming): packing, sparse prediction, the budget, passes, the study.
The design graders (FLOPs per token, a budget's model, BERT's masking, a protocol that leaks) live in
``cramming_design``; they are imported here too, beside the page's fourth exercise:

check_best_of_k(fn)            fn(k, n_seeds, sigma) -> the expected optimism of reporting the best of k rates'
                               means over n_seeds test scores when no rate is better: sigma / sqrt(n_seeds) times
                               E[max of k standard normals] (an order statistic's mean),
                               to 1e-4 relative; worked out (a call into ``llmedu`` fails) and the same value on
                               every call (a random sample of it fails)

check_pack(fn)                 fn(documents, seq_len, cls_id, sep_id) -> (n_rows, seq_len) rows: the
                               stream doc_0 [SEP] doc_1 [SEP] ... cut into rows opening with [CLS], no padding
check_sparse_mlm_loss(fn)      fn(model, batch) -> the MLM loss computed by running the head on the
                               masked positions only; it must equal the loss of the full head
check_parse_budget(fn)         fn("10m") -> 600.0; '30s', '24h', '1.5h', seconds; a ValueError otherwise
check_passes_over_data(fn)     fn(budget, tokens_per_s, n_rows, seq_len) -> how many times a run of that budget
                               ("10m", "24h") at that speed reads a corpus of n_rows packed rows of seq_len
                               tokens (``pretrain.passes_over_data``), within 0.1%
check_gap_curve(fn)            fn(results, task, pretrained, control) -> {labels: summary of the gaps}: from a
                               study's JSON, pretrained minus control along the label-efficiency curve, paired
                               seed by seed (the same slice of labels) and label count by label count
"""

from __future__ import annotations

import math

import torch

from llmedu.checks.core import CheckResult, Grader, call_watching
from llmedu.checks.cramming_design import (
    LLMEDU,
    _graders,
    check_budget_choice,
    check_dev_protocol,
    check_flops_per_token,
    check_mask_tokens,
)
from llmedu.cramming.evaluate import summarize
from llmedu.cramming.pretrain import passes_over_data
from llmedu.cramming.recipe import TINY_SHAPE, crammed, parse_budget
from llmedu.data.packing import mask_tokens, pack
from llmedu.models import MaskedLM
from llmedu.models.bert import mlm_loss

__all__ = [
    "check_pack",
    "check_sparse_mlm_loss",
    "check_parse_budget",
    "check_passes_over_data",
    "check_dev_protocol",
    "check_gap_curve",
    "check_flops_per_token",
    "check_budget_choice",
    "check_mask_tokens",
    "best_of_k_optimism",
    "check_best_of_k",
]


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


# -- exercise: passes over the data ---------------------------------------------------------------


def passes_over_budget(budget: str, tokens_per_s: float, n_rows: int, seq_len: int) -> float:
    """The reference: tokens the budget reads over the corpus's tokens (``pretrain.passes_over_data``)."""
    return passes_over_data(parse_budget(budget) * tokens_per_s, n_rows * seq_len)


def check_passes_over_data(fn) -> CheckResult:
    """``fn(budget, tokens_per_s, n_rows, seq_len)`` -> passes, a float, within 0.1%."""
    g = Grader("check_passes_over_data")
    cases = [
        ("10m", 66_700, 37_900, 128),  # the lesson's 10-minute CPU run on the six corpora
        ("30m", 23_654, 29_569, 128),  # the lesson's recorded 30-minute run on the five corpora left
        ("24h", 72_029, 37_900, 128),  # a day at the rate bench measured at the CPU shape (a GPU is faster)
        ("90s", 5_000, 40_000, 64),  # not even one pass
        ("1.5h", 20_000, 1_000_000, 512),
    ]
    for budget, speed, n_rows, seq_len in cases:
        g.compare(
            f"budget {budget!r} at {speed:,} tokens/s over {n_rows:,} rows of {seq_len} tokens",
            g.call(fn, budget, speed, n_rows, seq_len),
            passes_over_budget(budget, speed, n_rows, seq_len),
            rtol=1e-3,
        )
    return g.result()


# -- exercise: reading a study: the paired gap along the label-efficiency curve ---------------------


def gap_curve(results: dict, task: str, pretrained: str = "crammed", control: str = "random init") -> dict:
    """The reference: {n labels (int): summary of pretrained - control, seed by seed} on one task.

    Seed s trained both models on the same random slice of labels (``evaluate.subsample``), so the
    gaps pair by seed; the curves pair by label count (their keys), whatever order they are stored in.
    """
    models = results["tasks"][task]["models"]
    ours, theirs = models[pretrained]["label_efficiency"], models[control]["label_efficiency"]
    return {
        int(n): summarize([a - b for a, b in zip(ours[n]["scores"], theirs[n]["scores"])]) for n in ours if n in theirs
    }


def _toy_study() -> dict:
    """A study's JSON in miniature (``study.run_study``'s shape): two tasks, six models, three seeds."""

    def row(lr, curve: dict[str, list[float]]) -> dict:
        every = curve[max(curve, key=int)]  # all the labels: the protocol's own test scores
        return {
            "lr": lr,
            "dev": {str(lr): round(sum(every) / 3 + 0.01, 4)},
            "test": summarize(every),
            "label_efficiency": {n: summarize(s) for n, s in curve.items()},
        }

    def flat(value: float) -> dict:  # a model without a rate: one score, whatever the seed
        return {"lr": None, "dev": {"None": value}, "test": summarize([value] * 3)}

    rt = {  # Rotten Tomatoes: 10,371 training labels after the dev split; three points of each curve
        "crammed": row(1e-4, {"100": [0.58, 0.55, 0.61], "1000": [0.66, 0.64, 0.65], "10371": [0.72, 0.715, 0.725]}),
        "crammed, 30 min": row(
            1e-4, {"100": [0.60, 0.57, 0.59], "1000": [0.65, 0.66, 0.67], "10371": [0.724, 0.72, 0.722]}
        ),
        "crammed, linear probe": flat(0.61),
        # the control's curve stored largest first: pair the curves by label count, not by position
        "random init": row(4e-4, {"10371": [0.73, 0.72, 0.74], "1000": [0.60, 0.63, 0.59], "100": [0.56, 0.50, 0.51]}),
        "majority class": flat(0.5),
        "TF-IDF + logistic regression": flat(0.742),
    }
    bbc = {  # BBC News: 1,520 training labels; three points of each curve
        "crammed": row(4e-4, {"100": [0.45, 0.52, 0.40], "300": [0.70, 0.74, 0.69], "1520": [0.93, 0.92, 0.93]}),
        "crammed, 30 min": row(
            4e-4, {"100": [0.50, 0.49, 0.47], "300": [0.75, 0.71, 0.72], "1520": [0.94, 0.93, 0.925]}
        ),
        "crammed, linear probe": flat(0.80),
        "random init": row(8e-4, {"100": [0.41, 0.30, 0.22], "300": [0.66, 0.50, 0.48], "1520": [0.88, 0.78, 0.92]}),
        "majority class": flat(0.226),
        "TF-IDF + logistic regression": flat(0.986),
    }
    tasks = {"rotten_tomatoes": (rt, 10371), "bbc_news": (bbc, 1520)}
    return {
        "config": {"seeds": [0, 1, 2], "lrs": [1e-4, 2e-4, 4e-4, 8e-4], "label_sizes": [100, 300, 1000, 3000, None]},
        "pretraining": {"crammed": {"summary": None, "unigram_cross_entropy": 6.46}},
        "tasks": {
            name: {"sizes": {"train": n, "dev": round(n / 9), "test": 1000}, "models": models}
            for name, (models, n) in tasks.items()
        },
        "average": {},
    }


def check_gap_curve(fn) -> CheckResult:
    """``fn(results, task, pretrained, control)`` -> {labels: {"scores", "mean", "std"}} of the paired gaps."""
    g = Grader("check_gap_curve")
    for task, pretrained, control in [
        ("rotten_tomatoes", "crammed", "random init"),
        ("bbc_news", "crammed", "random init"),
        ("rotten_tomatoes", "crammed, 30 min", "crammed"),
    ]:
        where = f"{task}, {pretrained!r} minus {control!r}"
        got = g.call(fn, _toy_study(), task, pretrained, control)  # a fresh copy: the answer may edit it
        expected = gap_curve(_toy_study(), task, pretrained, control)
        if g.failure is not None or not g.expect(
            f"{where}: the answer", isinstance(got, dict), f"expected a dict, got {type(got).__name__}"
        ):
            break
        try:
            got = {int(n): v for n, v in got.items()}
        except (TypeError, ValueError):
            g.expect(f"{where}: the keys", False, f"the keys must be label counts, got {list(got)}")
            break
        if not g.compare(f"{where}: the label counts", sorted(got), sorted(expected)):
            break
        for n, exp in expected.items():
            summary = got[n]
            if not g.expect(
                f"{where}, {n} labels",
                isinstance(summary, dict) and {"scores", "mean", "std"} <= set(summary),
                f"expected a summary with 'scores', 'mean' and 'std' (evaluate.summarize), got {summary!r:.80}",
            ):
                break
            g.compare(f"{where}, {n} labels: the gap of each seed", list(summary["scores"]), exp["scores"], atol=1e-9)
            g.compare(f"{where}, {n} labels: the mean gap", summary["mean"], exp["mean"], atol=1e-9)
            g.compare(f"{where}, {n} labels: the spread of the gaps", summary["std"], exp["std"], atol=1e-9)
    return g.result()


def best_of_k_optimism(k: int, n_seeds: int, sigma: float) -> float:
    """E[reported] - true accuracy for the best of k equally good rates, each the mean of n_seeds scores with
    noise sigma: sigma / sqrt(n_seeds) * E[max of k N(0, 1)], E = integral of x k phi(x) Phi(x)^(k-1) dx."""
    x = torch.linspace(-12.0, 12.0, 48_001, dtype=torch.float64)
    density = k * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) * torch.special.ndtr(x) ** (k - 1)
    return sigma / math.sqrt(n_seeds) * float(torch.trapezoid(x * density, x)) if k > 1 else 0.0


def check_best_of_k(fn) -> CheckResult:
    """``fn(k, n_seeds, sigma)`` -> the expected optimism of ``grid_protocol``'s report, worked out, not sampled."""
    g = Grader("check_best_of_k")
    for k, n, sigma in ((1, 3, 0.02), (2, 1, 1.0), (6, 5, 0.03), (3, 2, 0.1), (10, 4, 0.5)):
        where = f"k={k} rates, n_seeds={n}, sigma={sigma}"
        got, asked = call_watching(g, fn, (k, n, sigma), LLMEDU, _graders)
        if not g.expect(f"{where}: worked out", asked is None, f"your function called {asked}: derive the value"):
            break
        if not g.expect(f"{where}: a number", isinstance(got, (int, float)), f"expected a float, got {got!r:.60}"):
            break
        again = g.call(fn, k, n, sigma)
        detail = f"it returned {got!r}, then {again!r}: a random sample of the optimism, not its expected value"
        if not g.expect(f"{where}: the same value twice", again == got, detail):
            break
        expected = best_of_k_optimism(k, n, sigma)
        per_score = (
            n > 1 and expected > 0 and math.isclose(got, expected * math.sqrt(n), rel_tol=1e-3)
        )  # k=1: 0 either way
        detail = "this is the optimism of one score per rate: each rate's report is a mean of n_seeds scores"
        if not g.expect(f"{where}: the noise of a mean", not per_score, detail):
            break
        g.compare(f"{where}: the expected optimism", got, expected, rtol=1e-4, atol=1e-12)
    return g.result()
