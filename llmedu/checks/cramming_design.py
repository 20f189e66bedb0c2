"""Graders for lesson 25's exercises that ask for a design decision: FLOPs per token, a budget's model, BERT's masking.

check_flops_per_token(fn)   fn(cfg) -> training FLOPs per token of the MLM encoder, 6N + 12 L T d, with N the
                            matmul weights that run for that token: the head's (d x d and the tied d x V
                            decoder) only at mask_rate of the tokens under sparse prediction; worked out by
                            hand (asking ``llmedu.models.counting`` or ``cramming.pretrain`` fails)
check_budget_choice(fn)     fn(runs, budget_s) -> the run that reaches the lowest loss in budget_s seconds: each
                            run's loss-against-tokens curve read at tokens_per_s x budget_s (linear between
                            points; a curve that stops short cannot say, so that run is out); None if none can
check_mask_tokens(fn)       fn(ids, rate, mask_id, vocab_size, special_ids, generator) -> (inputs, labels):
                            BERT's masking (Devlin et al. 2019, sec. 3.1): rate of the non-special tokens
                            chosen, of those 80% [MASK], 10% a random token, 10% unchanged, every other token
                            untouched, labels -100 elsewhere; from ``generator`` alone; the library's
                            ``mask_tokens`` fails
"""

from __future__ import annotations

import bisect
from pathlib import Path

import torch

from llmedu.checks.core import CheckResult, Grader, call_watching

__all__ = ["reference_flops_per_token", "check_flops_per_token", "loss_after", "check_budget_choice"]
__all__ += ["check_mask_tokens"]

LLMEDU = Path(__file__).resolve().parents[1]
_graders = lambda code: code.co_filename.startswith(str(LLMEDU / "checks"))  # noqa: E731  (the grader's own calls)


def reference_flops_per_token(cfg: dict) -> float:
    """6N + 12 L T d; N per layer 4d^2 (q, k, v, o) + the FFN (gated: 3 d d_ff, plain: 2 d d_ff), plus the head."""
    d, layers, d_ff = cfg["d_model"], cfg["n_layers"], cfg["d_ff"]
    body = layers * (4 * d * d + (3 if cfg["gated"] else 2) * d * d_ff)
    head = d * d + d * cfg["vocab_size"]  # the head's dense layer and the tied decoder
    share = cfg["mask_rate"] if cfg["sparse"] else 1.0
    return 6 * (body + share * head) + 12 * layers * cfg["seq_len"] * d


def _flops_cases() -> list[dict]:
    def cfg(d, layers, d_ff, vocab, gated, sparse, rate=0.15, seq=128):
        keys = ("d_model", "n_layers", "d_ff", "vocab_size", "gated", "sparse", "mask_rate", "seq_len")
        return dict(zip(keys, (d, layers, d_ff, vocab, gated, sparse, rate, seq)))

    return [
        cfg(96, 3, 192, 2048, True, True),
        cfg(96, 3, 384, 2048, False, False),
        cfg(96, 3, 384, 2048, False, True),  # BERT's FFN, sparse head: the 'full prediction' row's inverse
        cfg(256, 6, 512, 8192, True, True, rate=0.25, seq=256),  # bert-o4's 25% masking
        cfg(512, 8, 1024, 30522, True, False, seq=64),
    ]


def check_flops_per_token(fn) -> CheckResult:
    """``fn(cfg)`` against the count on configs the lesson does not print, without asking the library."""
    g = Grader("check_flops_per_token")
    for cfg in _flops_cases():
        got, asked = call_watching(g, fn, (dict(cfg),), LLMEDU, _graders)
        if not g.expect("worked out by hand", asked is None, f"your function called {asked}"):
            break
        shown = {k: cfg[k] for k in ("d_model", "n_layers", "d_ff", "gated", "sparse", "mask_rate")}
        g.compare(f"config {shown}", got, reference_flops_per_token(cfg), rtol=1e-6)
    return g.result()


def loss_after(run: dict, budget_s: float) -> float | None:
    """The run's curve [(tokens, loss), ...] read at tokens_per_s x budget_s, linearly; None past its last point."""
    tokens = run["tokens_per_s"] * budget_s
    xs = [t for t, _ in run["curve"]]
    if not xs or tokens > xs[-1] or tokens < xs[0]:
        return None
    i = bisect.bisect_left(xs, tokens)
    if xs[i] == tokens:
        return run["curve"][i][1]
    (t0, l0), (t1, l1) = run["curve"][i - 1], run["curve"][i]
    return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)


def _choose(runs: dict, budget_s: float):
    losses = {name: loss_after(run, budget_s) for name, run in runs.items()}
    known = {name: loss for name, loss in losses.items() if loss is not None}
    return min(known, key=known.get) if known else None


def _choice_cases() -> list[tuple[dict, float]]:
    curve = lambda pts: [(1e6 * t, loss) for t, loss in pts]  # noqa: E731  (millions of tokens)
    grid = {  # the large model learns most per token, the small one reads fastest
        "small": {"tokens_per_s": 40_000, "curve": curve([(0.5, 7.0), (2, 6.4), (8, 6.0), (16, 5.9)])},
        "medium": {"tokens_per_s": 20_000, "curve": curve([(0.5, 6.9), (2, 6.2), (8, 5.7), (12, 5.6)])},
        "large": {"tokens_per_s": 8_000, "curve": curve([(0.5, 6.8), (2, 6.0), (4, 5.7)])},
    }
    return [
        (grid, 100),  # 4M, 2M and 0.8M tokens: small 6.27, medium 6.2, large 6.24 -> medium
        (grid, 250),  # 10M, 5M, 2M: small 5.975, medium 5.9, large 6.0 -> medium
        (grid, 500),  # 20M (past small's curve), 10M, 4M: medium 5.65, large 5.7 -> medium
        (grid, 625),  # 25M, 12.5M, 5M: every curve stops short, none can say -> None (not the last points' best)
        (grid, 30),  # 1.2M, 0.6M, 0.24M (before large's first point): small 6.68, medium 6.853 -> small
        ({"a": {"tokens_per_s": 1000, "curve": curve([(0.1, 6.0), (0.2, 5.0)])}}, 1e4),  # 10M: past -> None
    ]


def check_budget_choice(fn) -> CheckResult:
    """``fn(runs, budget_s)`` -> the name with the lowest loss after the budget (or None), on grids that separate
    reading per token, per second and per curve's end."""
    g = Grader("check_budget_choice")
    for runs, budget in _choice_cases():
        got = g.call(fn, {k: {**v, "curve": list(v["curve"])} for k, v in runs.items()}, budget)
        speeds = {k: v["tokens_per_s"] for k, v in runs.items()}
        g.compare(f"runs at {speeds} tokens/s, a budget of {budget:g} s", got, _choose(runs, budget))
    return g.result()


def _mask_batch(seed: int, vocab: int) -> torch.Tensor:
    ids = torch.randint(5, vocab, (96, 128), generator=torch.Generator().manual_seed(seed))  # (B, T)
    ids[:, 0] = 2  # [CLS]
    ids[:, 40::41] = 3  # [SEP]s inside the rows
    return ids


def check_mask_tokens(fn) -> CheckResult:
    """BERT's masking, by its statistics on 12,288 tokens, its untouched tokens exactly, and its generator."""
    g = Grader("check_mask_tokens")
    vocab, specials, mask_id = 1000, [0, 1, 2, 3, 4], 4
    for rate in (0.15, 0.25):
        ids = _mask_batch(0, vocab)
        torch.manual_seed(1)  # a global RNG in another state at each call: only the generator may decide
        out, asked = call_watching(g, fn, (ids.clone(), rate, mask_id, vocab, specials, torch.Generator().manual_seed(7)), LLMEDU, _graders)  # fmt: skip
        if not g.expect("BERT's masking written out", asked is None, f"your function called {asked}"):
            break
        if not g.expect("returns (inputs, labels)", isinstance(out, tuple) and len(out) == 2):
            break
        inputs, labels = out
        if not g.expect("shapes", inputs.shape == ids.shape and labels.shape == ids.shape, f"{tuple(ids.shape)}"):
            break
        chosen = labels != -100
        special = torch.isin(ids, torch.tensor(specials))
        g.expect("labels hold the original token where chosen", bool((labels[chosen] == ids[chosen]).all()))
        g.expect("no special token is chosen", not bool((chosen & special).any()))
        share = chosen.sum().item() / (~special).sum().item()
        g.expect(f"about {rate:.0%} of the tokens chosen", abs(share - rate) < 0.015, f"got {share:.3f}")
        changed = (inputs != ids) & ~chosen
        g.expect("every token not chosen is left as it was", not bool(changed.any()), f"{changed.sum().item()} changed")
        n = chosen.sum().item()
        masked = (inputs[chosen] == mask_id).sum().item() / n
        kept = (inputs[chosen] == ids[chosen]).sum().item() / n
        g.expect("80% of the chosen become [MASK]", abs(masked - 0.8) < 0.04, f"got {masked:.3f}")
        g.expect("10% of the chosen stay as they were", abs(kept - 0.1) < 0.03, f"got {kept:.3f}")
        torch.manual_seed(2)
        again = g.call(fn, ids.clone(), rate, mask_id, vocab, specials, torch.Generator().manual_seed(7))
        same = isinstance(again, tuple) and all(torch.equal(a, b) for a, b in zip(again, out))
        g.expect("the same generator seed gives the same masks (no global RNG)", same)
    return g.result()
