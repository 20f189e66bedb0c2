"""Lesson 25's design graders: a right answer passes; a plausible wrong value and a right value reached the wrong way
fail. Also Welch's test and the final table of ``cramming.studies.final``, which the lesson reads."""

import math

import pytest
import torch

from llmedu.checks.cramming import (
    best_of_k_optimism,
    check_best_of_k,
    check_budget_choice,
    check_dev_protocol,
    check_flops_per_token,
    check_mask_tokens,
)
from llmedu.checks.cramming_design import _choose, loss_after, reference_flops_per_token
from llmedu.cramming.evaluate import best_rate, protocol, summarize, sweep
from llmedu.cramming.pretrain import mlm_flops_per_token
from llmedu.cramming.recipe import CUDA_SHAPE, crammed, original_bert
from llmedu.cramming.studies.final import FINAL, final_table, load_study, student_t_sf2, welch
from llmedu.cramming.studies.significance import student_t_two_sided
from llmedu.data.packing import mask_tokens
from llmedu.models import MaskedLM


def right_flops(cfg):
    d, layers = cfg["d_model"], cfg["n_layers"]
    body = layers * (4 * d * d + (3 if cfg["gated"] else 2) * d * cfg["d_ff"])
    head = d * d + d * cfg["vocab_size"]
    return 6 * (body + (cfg["mask_rate"] if cfg["sparse"] else 1) * head) + 12 * layers * cfg["seq_len"] * d


def test_flops_grader(capsys):
    assert check_flops_per_token(right_flops)
    dense_head = lambda cfg: right_flops({**cfg, "sparse": False})  # noqa: E731  (the head at every position)
    no_attention = lambda cfg: right_flops(cfg) - 12 * cfg["n_layers"] * cfg["seq_len"] * cfg["d_model"]  # noqa: E731
    plain_ffn = lambda cfg: right_flops({**cfg, "gated": False})  # noqa: E731  (GEGLU counted as 2 matrices)

    def asks_library(cfg):  # the right number, from the library's own count
        recipe = crammed(d_model=cfg["d_model"], n_layers=cfg["n_layers"], d_ff=cfg["d_ff"])
        return mlm_flops_per_token(recipe, MaskedLM(recipe.model))

    for fn in (dense_head, no_attention, plain_ffn, asks_library):
        assert not check_flops_per_token(fn)
    assert "your function called" in capsys.readouterr().out


def test_flops_reference_is_the_library_count():
    """The hand count the grader holds equals the library's at the CPU shape, both recipes, and the count recorded
    with the GPU run at the BERT-base shape."""
    import json

    from llmedu.checks.cramming_design import reference_flops_per_token
    from llmedu.cramming.studies.final import RESULTS

    def cfg(recipe):
        m = recipe.model
        out = dict(d_model=m.d_model, n_layers=m.n_layers, d_ff=m.d_ff, vocab_size=m.vocab_size, seq_len=m.max_seq_len)
        return out | dict(gated=m.activation == "geglu", sparse=recipe.sparse_prediction, mask_rate=recipe.mask_rate)

    for recipe in (crammed(), original_bert()):
        assert reference_flops_per_token(cfg(recipe)) == pytest.approx(
            mlm_flops_per_token(recipe, MaskedLM(recipe.model))
        )
    gpu = json.loads((RESULTS / "bench_cramming_gpu_h200.json").read_text())["result"]["throughput"]
    for recipe, row in ((crammed(**CUDA_SHAPE), "crammed (ours)"), (original_bert(**CUDA_SHAPE), "BertForMaskedLM")):
        assert reference_flops_per_token(cfg(recipe)) == pytest.approx(gpu[row]["flops_per_token"])


def read_curve(run, budget_s):
    """The learner's own reading of a curve (the grader fails a call into its ``loss_after``)."""
    tokens, curve = run["tokens_per_s"] * budget_s, run["curve"]
    if not curve or not curve[0][0] <= tokens <= curve[-1][0]:
        return None
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return curve[0][1]  # a one-point curve read at its point


def test_read_curve_is_the_graders_reading():
    run = {"tokens_per_s": 1000, "curve": [(1e5, 7.0), (3e5, 6.0), (4e5, 5.5)]}
    for budget in (50, 100, 150, 300, 350, 400, 401):
        assert read_curve(run, budget) == loss_after(run, budget)


def right_choice(runs, budget_s):
    losses = {name: read_curve(run, budget_s) for name, run in runs.items()}
    known = {k: v for k, v in losses.items() if v is not None}
    return min(known, key=known.get) if known else None


def test_budget_choice_grader(capsys):
    assert check_budget_choice(right_choice)

    def per_token(runs, budget_s):  # the lowest loss at the tokens every run read: ignores speed
        common = min(run["curve"][-1][0] for run in runs.values())
        return min(runs, key=lambda k: read_curve({"tokens_per_s": 1, "curve": runs[k]["curve"]}, common))

    fastest = lambda runs, budget_s: max(runs, key=lambda k: runs[k]["tokens_per_s"])  # noqa: E731
    last_point = lambda runs, budget_s: min(runs, key=lambda k: runs[k]["curve"][-1][1])  # noqa: E731

    def clamped(runs, budget_s):  # reads a curve that stops short at its last point: extrapolates
        def at(run):
            tokens = min(run["tokens_per_s"] * budget_s, run["curve"][-1][0])
            return read_curve({"tokens_per_s": 1, "curve": run["curve"]}, tokens)

        return min(runs, key=lambda k: at(runs[k]))

    for fn in (per_token, fastest, last_point, clamped):
        assert not check_budget_choice(fn)


def buggy_mask(ids, rate, mask_id, vocab_size, special_ids, generator):
    """The lesson's buggy masking: the random replacement is not restricted to the chosen tokens."""
    special = torch.isin(ids, torch.tensor(special_ids))
    chosen = (torch.rand(ids.shape, generator=generator) < rate) & ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    to_mask = chosen & (torch.rand(ids.shape, generator=generator) < 0.8)
    to_random = (torch.rand(ids.shape, generator=generator) < 0.5) & ~to_mask
    inputs = ids.masked_fill(to_mask, mask_id)
    return torch.where(to_random, torch.randint(vocab_size, ids.shape, generator=generator), inputs), labels


def fixed_mask(ids, rate, mask_id, vocab_size, special_ids, generator):
    special = torch.isin(ids, torch.tensor(special_ids))
    chosen = (torch.rand(ids.shape, generator=generator) < rate) & ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    to_mask = chosen & (torch.rand(ids.shape, generator=generator) < 0.8)
    to_random = chosen & ~to_mask & (torch.rand(ids.shape, generator=generator) < 0.5)
    inputs = ids.masked_fill(to_mask, mask_id)
    return torch.where(to_random, torch.randint(vocab_size, ids.shape, generator=generator), inputs), labels


def test_mask_grader(capsys):
    assert check_mask_tokens(fixed_mask)

    def global_rng(ids, rate, mask_id, vocab_size, special_ids, generator):  # right statistics, wrong RNG
        return fixed_mask(ids, rate, mask_id, vocab_size, special_ids, None)

    def library(ids, rate, mask_id, vocab_size, special_ids, generator):  # the right answer, asked of the library
        return mask_tokens(ids, rate, mask_id, vocab_size, special_ids, generator)

    def specials_too(ids, rate, mask_id, vocab_size, special_ids, generator):  # [CLS] and [SEP] can be chosen
        return fixed_mask(ids, rate, mask_id, vocab_size, [], generator)

    def all_masked(ids, rate, mask_id, vocab_size, special_ids, generator):  # no 10% random, no 10% kept
        special = torch.isin(ids, torch.tensor(special_ids))
        chosen = (torch.rand(ids.shape, generator=generator) < rate) & ~special
        return ids.masked_fill(chosen, mask_id), torch.where(chosen, ids, torch.full_like(ids, -100))

    for fn in (buggy_mask, global_rng, library, specials_too, all_masked):
        assert not check_mask_tokens(fn)
    assert "your function called" in capsys.readouterr().out


def test_student_t_matches_the_integer_closed_forms():
    for t, dof in ((0.3, 1), (2.0, 3), (1.3, 7), (4.2, 10), (12.0, 4)):
        assert student_t_sf2(t, dof) == pytest.approx(student_t_two_sided(t, dof), rel=1e-9, abs=1e-14)
    assert student_t_sf2(2.0, 3.5) < student_t_sf2(2.0, 3) and student_t_sf2(2.0, 3.5) > student_t_sf2(2.0, 4)
    with pytest.raises(ValueError, match="dof"):
        student_t_sf2(1.0, 0)


def test_welch_by_hand():
    a, b = [1.0, 2.0, 3.0], [0.0, 0.0, 3.0, 5.0]  # variances 1 and 6
    r = welch(a, b)
    se = math.sqrt(1 / 3 + 6 / 4)
    assert r["diff"] == pytest.approx(0.0) and r["se"] == pytest.approx(se)
    assert r["dof"] == pytest.approx((1 / 3 + 6 / 4) ** 2 / ((1 / 3) ** 2 / 2 + (6 / 4) ** 2 / 3))
    with pytest.raises(ValueError, match="at least 2"):
        welch([1.0], b)


def test_final_table_leads_with_the_rows_that_need_no_pretraining():
    study = load_study(FINAL)
    lines = final_table(study).splitlines()
    assert lines[2].startswith("majority class") and lines[3].startswith("TF-IDF")
    assert lines[4].startswith("random init")


def test_graders_fail_the_answers_they_hold(capsys):
    """The references the graders hold are importable from ``llmedu.checks``: handing them in fails, as does the
    library's own protocol, which the page shows."""
    assert not check_flops_per_token(reference_flops_per_token)
    assert not check_budget_choice(_choose)

    def via_loss_after(runs, budget_s):  # the right choice, read with the grader's own loss_after
        known = {k: loss_after(r, budget_s) for k, r in runs.items() if loss_after(r, budget_s) is not None}
        return min(known, key=known.get) if known else None

    assert not check_budget_choice(via_loss_after)
    assert not check_dev_protocol(protocol)

    def via_sweep(scorer, splits, lrs, seeds):  # the library's sweep, then the seeds by hand
        lr, _ = sweep(scorer, splits, lrs, seeds[0])
        return {"lr": lr, "test": summarize([scorer(splits.train, splits.test, lr, s) for s in seeds])}

    def via_best_rate(scorer, splits, lrs, seeds):
        dev = {str(lr): scorer(splits.train, splits.dev, lr, seeds[0]) for lr in lrs}
        lr = best_rate(dev, lrs)
        return {"lr": lr, "test": summarize([scorer(splits.train, splits.test, lr, s) for s in seeds])}

    assert not check_dev_protocol(via_sweep) and not check_dev_protocol(via_best_rate)
    out = capsys.readouterr().out
    for name in ("reference_flops_per_token", "_choose", "loss_after", "evaluate.protocol", "evaluate.sweep"):
        assert f"called cramming_design.{name}" in out or f"called {name}" in out, name


def test_dev_protocol_grader_passes_a_protocol_written_out(capsys):
    def written_out(scorer, splits, lrs, seeds):  # summarize and the splits' own methods are allowed
        dev = {lr: scorer(splits.train, splits.dev, lr, seeds[0]) for lr in lrs}
        lr = max(lrs, key=lambda r: dev[r])
        assert splits.sizes()["test"] == len(splits.test)
        return {"lr": lr, "test": summarize([scorer(splits.train, splits.test, lr, s) for s in seeds])}

    assert check_dev_protocol(written_out), capsys.readouterr().out


def expected_max(k):  # E[max of k N(0, 1)] = integral of x k phi(x) Phi(x)^(k-1) dx, by the midpoint rule
    h = 1e-3
    xs = [-10 + h * (i + 0.5) for i in range(20_000)]
    phi = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    return sum(x * k * phi(x) * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (k - 1) * h for x in xs)


def right_optimism(k, n_seeds, sigma):
    return sigma / math.sqrt(n_seeds) * expected_max(k)


def test_best_of_k_grader_passes_the_order_statistic_worked_out(capsys):
    assert check_best_of_k(right_optimism), capsys.readouterr().out
    assert right_optimism(2, 1, 1.0) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)  # the known case k = 2
    # the grader's own reference agrees with a direct simulation of grid_protocol's report
    g = torch.Generator().manual_seed(0)
    reports = (0.03 * torch.randn(100_000, 6, 5, generator=g, dtype=torch.float64)).mean(2).max(1).values
    assert float(reports.mean()) == pytest.approx(best_of_k_optimism(6, 5, 0.03), rel=0.01)


def test_best_of_k_grader_passes_an_exact_zero_for_one_rate(capsys):
    # one rate has nothing to choose among: an answer that says so exactly must not read as "one score per rate"
    def exact_at_one(k, n_seeds, sigma):
        return 0.0 if k == 1 else right_optimism(k, n_seeds, sigma)

    assert check_best_of_k(exact_at_one), capsys.readouterr().out


def test_best_of_k_grader_fails_plausible_wrong_values(capsys):
    one_score = lambda k, n, sigma: sigma * expected_max(k)  # noqa: E731  (forgets that a report is a mean)
    sqrt_log = lambda k, n, sigma: sigma / math.sqrt(n) * math.sqrt(2 * math.log(k))  # noqa: E731  (large-k growth)
    over_k = lambda k, n, sigma: sigma / math.sqrt(n * k)  # noqa: E731  (averaging over the rates too)
    for fn in (one_score, sqrt_log, over_k):
        assert not check_best_of_k(fn)
    assert "each rate's report is a mean of n_seeds scores" in capsys.readouterr().out


def test_best_of_k_grader_fails_the_right_value_reached_the_wrong_way(capsys):
    def sampled(k, n, sigma):  # a fresh simulation each call: near the value, never the same twice
        return float((sigma * torch.randn(20_000, k, n, dtype=torch.float64)).mean(2).max(1).values.mean())

    def sampled_seeded(k, n, sigma):  # the same every call, but a sample: about 0.5% off
        g = torch.Generator().manual_seed(1)
        return float((sigma * torch.randn(20_000, k, n, generator=g, dtype=torch.float64)).mean(2).max(1).values.mean())

    assert not check_best_of_k(best_of_k_optimism)  # the grader's own reference, from the library
    assert not check_best_of_k(sampled)
    assert not check_best_of_k(sampled_seeded)
    out = capsys.readouterr().out
    assert "called cramming.best_of_k_optimism" in out and "not its expected value" in out
