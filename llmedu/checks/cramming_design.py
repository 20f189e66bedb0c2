"""Graders for lesson 25's exercises: FLOPs per token, a budget's model, BERT's masking, a protocol that leaks.

check_flops_per_token(fn)   fn(cfg) -> training FLOPs per token of the MLM encoder, 6N + 12 L T d, with N the
                            matmul weights that run for that token: the head's (d x d and the tied d x V
                            decoder) only at mask_rate of the tokens under sparse prediction; worked out by
                            hand (asking ``llmedu.models.counting``, ``cramming.pretrain`` or this file's
                            ``reference_flops_per_token`` fails)
check_budget_choice(fn)     fn(runs, budget_s) -> the run that reaches the lowest loss in budget_s seconds: each
                            run's loss-against-tokens curve read at tokens_per_s x budget_s (linear between
                            points; a curve that stops short cannot say, so that run is out); None if none can;
                            written out (asking this file's ``loss_after`` or any of ``llmedu`` fails)
check_mask_tokens(fn)       fn(ids, rate, mask_id, vocab_size, special_ids, generator) -> (inputs, labels):
                            BERT's masking (Devlin et al. 2019, sec. 3.1): rate of the non-special tokens
                            chosen, of those 80% [MASK], 10% a random token, 10% unchanged, every other token
                            untouched, labels -100 elsewhere; from ``generator`` alone; the library's
                            ``mask_tokens`` fails
check_dev_protocol(fn)      fn(scorer, splits, lrs, seeds) -> {"lr", "test": summary}: the bug-fixed protocol;
                            a recording fake scorer whose dev and test splits prefer different rates shows
                            whether the rate was chosen on dev, only the chosen rate saw test, and test was
                            scored once with every seed; written out (a call into ``evaluate.protocol``,
                            ``sweep``, ``best_rate`` or anything of ``llmedu`` but ``summarize`` fails)
"""

from __future__ import annotations

import bisect
from pathlib import Path

import torch

from llmedu.checks.core import CheckResult, Grader, call_watching
from llmedu.cramming.evaluate import Data, Splits, summarize

__all__ = ["reference_flops_per_token", "check_flops_per_token", "loss_after", "check_budget_choice"]
__all__ += ["check_mask_tokens", "check_dev_protocol"]

LLMEDU = Path(__file__).resolve().parents[1]
GRADING = LLMEDU / "checks" / "core.py"  # the Grader itself, which runs the learner's function
# Only the Grader's own frames are exempt: a call into this file's references (reference_flops_per_token,
# loss_after, _choose) counts as asking the library, like a call into llmedu.models or llmedu.data.
_graders = lambda code: code.co_filename == str(GRADING)  # noqa: E731


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
        fresh = {k: {**v, "curve": list(v["curve"])} for k, v in runs.items()}
        got, asked = call_watching(g, fn, (fresh, budget), LLMEDU, _graders)
        if not g.expect("worked out by hand", asked is None, f"your function called {asked}"):
            break
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


# -- exercise: find the bug in a protocol that chooses on the test split --------------------------


class _Recorder:
    """A fake scorer: the dev split and the test split disagree on the best rate, and it notes each call."""

    def __init__(self, splits: Splits, dev_best, test_best, lrs):
        self.splits, self.calls = splits, []
        rank = {lr: i for i, lr in enumerate(lrs)}
        self.dev_score = {lr: 0.80 - 0.05 * abs(rank[lr] - rank[dev_best]) for lr in lrs}
        self.test_score = {lr: 0.75 - 0.04 * abs(rank[lr] - rank[test_best]) for lr in lrs}

    def split_name(self, data) -> str:
        for name in ("train", "dev", "test"):
            if data is getattr(self.splits, name):
                return name
        return "a split of your own"

    def __call__(self, train, test, lr, seed) -> float:
        trained_on, scored_on = self.split_name(train), self.split_name(test)
        if scored_on == "dev":
            score = self.dev_score[lr] + 0.002 * (seed % 5)  # seeds move dev a little, never the ranking
        else:
            score = self.test_score[lr] + (0.0, 0.03, -0.02, 0.01, -0.01)[seed % 5]
        self.calls.append((trained_on, scored_on, lr, seed, score))
        return score


def _toy_splits() -> Splits:
    def data(prefix, n):
        return Data(tuple(f"{prefix} {i}" for i in range(n)), tuple(i % 2 for i in range(n)))

    return Splits(data("train", 40), data("dev", 10), data("test", 12))


_ALLOWED = {  # (file, qualname prefix) the learner's protocol may call: the Grader, the fake scorer, the summary
    (str(LLMEDU / "checks" / "core.py"), ""),
    (__file__, "_Recorder."),
    (str(LLMEDU / "cramming" / "evaluate.py"), "summarize"),
    (str(LLMEDU / "cramming" / "evaluate.py"), "Data."),
    (str(LLMEDU / "cramming" / "evaluate.py"), "Splits."),
}


def _allowed(code) -> bool:
    return any(code.co_filename == f and code.co_qualname.startswith(q) for f, q in _ALLOWED)


def check_dev_protocol(fn) -> CheckResult:
    """``fn(scorer, splits, lrs, seeds)`` -> {"lr", "test": summary}: chosen on dev, every seed scored on test."""
    g = Grader("check_dev_protocol")
    cases = [  # (rates, seeds, the rate dev prefers, the rate test prefers)
        ((1e-4, 2e-4, 4e-4, 8e-4), (0, 1, 2), 2e-4, 8e-4),
        ((3e-5, 1e-4), (4, 1), 3e-5, 1e-4),
        ((None,), (0, 1, 2), None, None),  # a model without a rate: the probe, the baselines
    ]
    for lrs, seeds, dev_best, test_best in cases:
        splits = _toy_splits()
        scorer = _Recorder(splits, dev_best, test_best, lrs)
        where = f"rates {list(lrs)}, seeds {list(seeds)}"
        result, asked = call_watching(g, fn, (scorer, splits, list(lrs), list(seeds)), LLMEDU, _allowed)
        if not g.expect(
            f"{where}: written out", asked is None, f"your function called {asked}: write the sweep and the seeds"
        ):
            break
        if not g.expect(
            f"{where}: the result",
            isinstance(result, dict) and "lr" in result and "test" in result,
            f"expected a dict with 'lr' and 'test', got {result!r:.80}",
        ):
            break
        calls = scorer.calls
        g.expect(
            f"{where}: training",
            all(c[0] == "train" for c in calls),
            f"a model was trained on the {next((c[0] for c in calls if c[0] != 'train'), '')} split; "
            "every model trains on splits.train",
        )
        elsewhere = next((c[1] for c in calls if c[1] not in ("dev", "test")), None)
        g.expect(
            f"{where}: scoring",
            elsewhere is None,
            f"a model was scored on {'the ' + elsewhere + ' split' if elsewhere == 'train' else elsewhere}: "
            "rates are compared on splits.dev and the result is reported on splits.test",
        )
        on_test = [c for c in calls if c[1] == "test"]
        g.expect(
            f"{where}: the test split",
            bool(on_test),
            "no model was scored on splits.test: the numbers reported as 'test' come from another split",
        )
        rates_on_test = sorted({c[2] for c in on_test}, key=str)
        g.expect(
            f"{where}: the test split",
            len(rates_on_test) <= 1,
            f"rates {rates_on_test} were all scored on the test split, so the choice among them was made on "
            "test: the reported score is the best of several tries on it, an optimistic number",
        )
        g.expect(
            f"{where}: the chosen rate",
            len(lrs) == 1 or any(c[1] == "dev" for c in calls),
            "no rate was scored on dev: the sweep must compare the rates on splits.dev",
        )
        g.compare(
            f"{where}: the chosen rate (dev prefers {dev_best}, test would prefer {test_best})",
            result["lr"],
            dev_best,
        )
        g.expect(
            f"{where}: the rate scored on test",
            rates_on_test == [result["lr"]],
            f"the test split saw rate(s) {rates_on_test}, but the result reports lr={result['lr']}",
        )
        seeds_on_test = sorted(c[3] for c in on_test)
        g.expect(
            f"{where}: the seeds on test",
            seeds_on_test == sorted(seeds),
            f"the test split was scored with seeds {seeds_on_test}; it must be scored once with each of {sorted(seeds)}",
        )
        if g.failure is None:
            by_seed = {c[3]: c[4] for c in on_test}
            expected = summarize([by_seed[s] for s in seeds])
            test = result["test"]
            if g.expect(
                f"{where}: result['test']",
                isinstance(test, dict) and "mean" in test and "std" in test,
                f"expected a summary with 'mean' and 'std' (evaluate.summarize), got {test!r:.80}",
            ):
                g.compare(f"{where}: the mean of the test scores over seeds", test["mean"], expected["mean"], atol=1e-9)
                g.compare(
                    f"{where}: the spread (sample standard deviation) of the test scores over seeds",
                    test["std"],
                    expected["std"],
                    atol=1e-9,
                )
    return g.result()
