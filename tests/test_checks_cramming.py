"""Lesson 25's exercise graders: each passes a right answer and fails plausible wrong ones.

(``check_pack``, ``check_sparse_mlm_loss`` and ``check_parse_budget`` are tested in test_cramming.py.)
"""

import math
import statistics

import pytest

from llmedu.checks.cramming import check_dev_protocol, check_gap_curve, check_passes_over_data
from llmedu.cramming.evaluate import summarize
from llmedu.cramming.recipe import parse_budget


def test_check_passes_over_data(capsys):
    def right(budget, tokens_per_s, n_rows, seq_len):
        return parse_budget(budget) * tokens_per_s / (n_rows * seq_len)

    assert check_passes_over_data(right)
    wrong = [
        lambda b, v, n, t: float(b.rstrip("smh")) * v / (n * t),  # "10m" read as 10 seconds
        lambda b, v, n, t: parse_budget(b) * v / n,  # rows counted as tokens
        lambda b, v, n, t: (n * t) / (parse_budget(b) * v),  # upside down
        lambda b, v, n, t: math.floor(right(b, v, n, t)),  # complete passes only: 8.25 is not 8
        lambda b, v, n, t: parse_budget(b) * v / (n * (t - 1)),  # [CLS] not counted: the trainer reads it
    ]
    for fn in wrong:
        assert not check_passes_over_data(fn)
    assert capsys.readouterr().out.count("FAIL") == len(wrong)


def leaky(scorer, splits, lrs, seeds):
    """The exercise's given bug: every rate with every seed on test, then the best rate's row."""
    grid = {lr: [scorer(splits.train, splits.test, lr, s) for s in seeds] for lr in lrs}
    best = max(lrs, key=lambda lr: statistics.fmean(grid[lr]))
    return {"lr": best, "test": summarize(grid[best])}


def fixed(scorer, splits, lrs, seeds):
    dev = {lr: scorer(splits.train, splits.dev, lr, seeds[0]) for lr in lrs}
    best = max(lrs, key=lambda lr: dev[lr])  # max keeps the first of equal rates
    return {"lr": best, "test": summarize([scorer(splits.train, splits.test, best, s) for s in seeds])}


def fixed_grid(scorer, splits, lrs, seeds):
    """The colleague's thorough grid kept, on dev: also right."""
    grid = {lr: [scorer(splits.train, splits.dev, lr, s) for s in seeds] for lr in lrs}
    best = max(lrs, key=lambda lr: statistics.fmean(grid[lr]))
    return {"lr": best, "test": summarize([scorer(splits.train, splits.test, best, s) for s in seeds])}


def test_check_dev_protocol(capsys):
    assert check_dev_protocol(fixed) and check_dev_protocol(fixed_grid)

    def dev_only(scorer, splits, lrs, seeds):  # chosen on dev, and dev's scores reported
        grid = {lr: [scorer(splits.train, splits.dev, lr, s) for s in seeds] for lr in lrs}
        best = max(lrs, key=lambda lr: statistics.fmean(grid[lr]))
        return {"lr": best, "test": summarize(grid[best])}

    def one_seed_on_test(scorer, splits, lrs, seeds):
        best = fixed(lambda tr, te, lr, s: scorer(tr, te, lr, s) if te is splits.dev else 0.0, splits, lrs, seeds)
        return {"lr": best["lr"], "test": summarize([scorer(splits.train, splits.test, best["lr"], seeds[0])])}

    def best_seed(scorer, splits, lrs, seeds):  # the right runs, the best seed reported
        result = fixed(scorer, splits, lrs, seeds)
        return {"lr": result["lr"], "test": summarize([max(result["test"]["scores"])] * len(seeds))}

    def chosen_on_train(scorer, splits, lrs, seeds):  # the sweep scores the split it trained on
        train = {lr: scorer(splits.train, splits.train, lr, seeds[0]) for lr in lrs}
        best = max(lrs, key=lambda lr: train[lr])
        return {"lr": best, "test": summarize([scorer(splits.train, splits.test, best, s) for s in seeds])}

    wrong = [leaky, dev_only, one_seed_on_test, best_seed, chosen_on_train]
    for fn in wrong:
        assert not check_dev_protocol(fn)
    out = capsys.readouterr().out
    assert out.count("FAIL") == len(wrong)
    assert "were all scored on the test split" in out  # the leak is named as such
    assert "no model was scored on splits.test" in out  # and so is reporting dev as test


def right_gap_curve(results, task, pretrained, control):
    models = results["tasks"][task]["models"]
    ours, theirs = models[pretrained]["label_efficiency"], models[control]["label_efficiency"]
    return {int(n): summarize([a - b for a, b in zip(ours[n]["scores"], theirs[n]["scores"])]) for n in ours}


def test_check_gap_curve(capsys):
    assert check_gap_curve(right_gap_curve)
    assert check_gap_curve(lambda *args: {str(n): v for n, v in right_gap_curve(*args).items()})  # str keys: fine

    def curves(results, task, pretrained, control):
        models = results["tasks"][task]["models"]
        return models[pretrained]["label_efficiency"], models[control]["label_efficiency"]

    def sorted_pairs(*args):  # "best against best" misread: each model's best seed paired
        ours, theirs = curves(*args)
        return {
            int(n): summarize([a - b for a, b in zip(sorted(ours[n]["scores"]), sorted(theirs[n]["scores"]))])
            for n in ours
        }

    def by_position(*args):  # the curves paired by their order in the file, not by label count
        ours, theirs = curves(*args)
        return {
            int(n): summarize([a - b for a, b in zip(x["scores"], y["scores"])])
            for (n, x), y in zip(ours.items(), theirs.values())
        }

    def unpaired(*args):  # difference of means; spreads added as if the seeds were independent
        ours, theirs = curves(*args)
        out = {}
        for n in ours:
            a, b = ours[n], theirs[n]
            gap = a["mean"] - b["mean"]
            out[int(n)] = {"scores": [gap] * len(a["scores"]), "mean": gap, "std": math.hypot(a["std"], b["std"])}
        return out

    def flipped(*args):  # control minus pretrained
        return {n: summarize([-g for g in s["scores"]]) for n, s in right_gap_curve(*args).items()}

    def population_std(*args):  # pstdev, not the sample standard deviation summarize uses
        return {n: s | {"std": statistics.pstdev(s["scores"])} for n, s in right_gap_curve(*args).items()}

    def protocol_row_everywhere(results, task, pretrained, control):  # the all-labels test scores at every count
        models = results["tasks"][task]["models"]
        gaps = summarize(
            [a - b for a, b in zip(models[pretrained]["test"]["scores"], models[control]["test"]["scores"])]
        )
        return {int(n): gaps for n in models[pretrained]["label_efficiency"]}

    wrong = [sorted_pairs, by_position, unpaired, flipped, population_std, protocol_row_everywhere]
    for fn in wrong:
        assert not check_gap_curve(fn)
    assert capsys.readouterr().out.count("FAIL") == len(wrong)


@pytest.mark.alone  # a wall-clock bound
def test_the_new_graders_are_fast():
    import time

    for check, fn in [
        (check_passes_over_data, lambda b, v, n, t: parse_budget(b) * v / (n * t)),
        (check_dev_protocol, fixed),
        (check_gap_curve, right_gap_curve),
    ]:
        start = time.perf_counter()
        assert check(fn)
        assert time.perf_counter() - start < 2.0
