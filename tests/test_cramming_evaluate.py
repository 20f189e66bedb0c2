"""The capstone's evaluation protocol: splits, the dev sweep, seeds, the probe, calibration rows."""

import json
import math
import re
from dataclasses import replace

import pytest
import torch

from llmedu.cramming.evaluate import (
    Data,
    check_no_overlap,
    label_efficiency,
    make_splits,
    protocol,
    split_data,
    subsample,
    summarize,
    sweep,
    task_average,
)
from llmedu.cramming.finetune import FinetuneSettings
from llmedu.cramming.studies.calibration import majority_accuracy, tfidf_accuracy, unigram_cross_entropy
from llmedu.cramming.studies.encoders import encoder_features, finetune_scorer, probe_scorer
from llmedu.cramming.studies.study import StudyConfig

TOY = Data(tuple(f"text {i}" for i in range(100)), tuple(i % 3 for i in range(100)))
TOY_TEST = Data(tuple(f"test {i}" for i in range(30)), tuple(i % 3 for i in range(30)))


def test_splits_are_disjoint_deterministic_and_of_the_stated_sizes():
    a = split_data(TOY, TOY_TEST, dev_fraction=0.2, seed=3)
    assert a == split_data(TOY, TOY_TEST, dev_fraction=0.2, seed=3)  # the same seed, the same splits
    assert a != split_data(TOY, TOY_TEST, dev_fraction=0.2, seed=4)
    assert a.sizes() == {"train": 80, "dev": 20, "test": 30}
    assert not set(a.train.texts) & set(a.dev.texts)
    assert set(a.train.texts) | set(a.dev.texts) == set(TOY.texts) and a.test == TOY_TEST
    for part in (a.train, a.dev):  # each text keeps its own label
        assert all(int(t.split()[1]) % 3 == y for t, y in zip(part.texts, part.labels))
    capped = split_data(TOY, TOY_TEST, dev_fraction=0.2, seed=3, max_train=10, max_eval=5)
    assert capped.sizes() == {"train": 10, "dev": 5, "test": 5}
    assert set(capped.dev.texts) <= set(a.dev.texts) and set(capped.train.texts) <= set(a.train.texts)


def test_a_real_task_splits_into_disjoint_parts():
    splits = make_splits("bbc_news", seed=0)
    texts = [set(part.texts) for part in (splits.train, splits.dev, splits.test)]
    assert not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])
    assert splits.sizes()["dev"] == round(0.1 * (splits.sizes()["train"] + splits.sizes()["dev"]))
    assert make_splits("bbc_news", seed=0) == splits


def fake_scorer(best_lr):
    """Scores peak at ``best_lr`` on dev; on test the seed moves the score a little."""

    def score(train, test, lr, seed):
        base = 1.0 - abs(math.log(lr) - math.log(best_lr))
        return base + (0.01 * seed if test is not TOY_SPLITS.dev else 0.0)

    return score


TOY_SPLITS = split_data(TOY, TOY_TEST, seed=0)


@pytest.mark.parametrize("best", [1e-4, 4e-4, 8e-4])
def test_the_sweep_picks_the_best_dev_rate(best):
    lr, dev = sweep(fake_scorer(best), TOY_SPLITS, [1e-4, 2e-4, 4e-4, 8e-4])
    assert lr == best and max(dev, key=dev.get) == str(best)
    # ties go to the earlier rate in the list
    assert sweep(lambda tr, te, lr, s: 0.5, TOY_SPLITS, [3e-4, 1e-4])[0] == 3e-4


def test_protocol_scores_the_chosen_rate_on_test_over_the_seeds():
    calls = []

    def score(train, test, lr, seed):
        calls.append((test is TOY_SPLITS.test, lr, seed))
        return fake_scorer(2e-4)(train, test, lr, seed)

    result = protocol(score, TOY_SPLITS, [1e-4, 2e-4], seeds=[0, 1, 2])
    assert result["lr"] == 2e-4
    assert calls == [(False, 1e-4, 0), (False, 2e-4, 0), (True, 2e-4, 0), (True, 2e-4, 1), (True, 2e-4, 2)]
    assert result["test"]["scores"] == pytest.approx([1.0, 1.01, 1.02])
    assert result["test"]["mean"] == pytest.approx(1.01) and result["test"]["std"] == pytest.approx(0.01)


def test_label_efficiency_slices_train_by_seed_and_caps_at_all():
    seen = []

    def score(train, test, lr, seed):
        seen.append((len(train), seed, train))
        return len(train) / 100

    curve = label_efficiency(score, TOY_SPLITS, None, [10, 50, None, 1000], seeds=[0, 1])
    n_train = len(TOY_SPLITS.train)
    assert list(curve) == ["10", "50", str(n_train)]  # 1000 is all of train too: run once
    assert len(seen) == 3 * 2 and seen[-1][0] == n_train
    assert curve["10"]["mean"] == pytest.approx(0.1)
    assert seen[0][2] != seen[1][2]  # different seeds, different slices of 10
    assert subsample(TOY_SPLITS.train, 10, 0) == seen[0][2]  # and reproducible


def test_label_efficiency_reuses_the_protocols_all_label_scores():
    calls = []

    def score(train, test, lr, seed):
        calls.append(len(train))
        return len(train) / 100

    n_train = len(TOY_SPLITS.train)
    assert subsample(TOY_SPLITS.train, None, seed=3) is TOY_SPLITS.train  # all: the protocol's split, its order
    assert subsample(TOY_SPLITS.train, n_train + 5, seed=3) is TOY_SPLITS.train
    curve = label_efficiency(score, TOY_SPLITS, 1e-4, [10, None], seeds=[0, 1], all_labels=[0.5, 0.7])
    assert calls == [10, 10]  # the all-labels point is not trained again
    assert curve[str(n_train)]["scores"] == [0.5, 0.7]
    with pytest.raises(ValueError, match="3 scores for 2 seeds"):
        label_efficiency(score, TOY_SPLITS, 1e-4, [None], seeds=[0, 1], all_labels=[0.5, 0.6, 0.7])


def test_task_average_is_the_mean_over_tasks_per_seed():
    results = {"a": {"test": summarize([0.6, 0.8])}, "b": {"test": summarize([0.8, 1.0])}}
    avg = task_average(results)
    assert avg["scores"] == pytest.approx([0.7, 0.9]) and avg["mean"] == pytest.approx(0.8)
    assert avg["std"] == pytest.approx(math.sqrt(0.02)) and avg["tasks"] == ["a", "b"]
    with pytest.raises(ValueError, match="same seeds"):
        task_average({"a": {"test": summarize([0.6])}, "b": {"test": summarize([0.8, 1.0])}})


def test_bad_input_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown task 'sst2'"):
        make_splits("sst2")
    with pytest.raises(KeyError, match="unknown task"):
        StudyConfig(tasks=("sst2",))
    with pytest.raises(ValueError, match="sweep is empty"):
        protocol(fake_scorer(1e-4), TOY_SPLITS, [], seeds=[0])
    with pytest.raises(ValueError, match="sweep is empty"):
        StudyConfig(lrs=())
    with pytest.raises(ValueError, match="at least one seed"):
        protocol(fake_scorer(1e-4), TOY_SPLITS, [1e-4], seeds=[])
    with pytest.raises(ValueError, match="at least one seed"):
        StudyConfig(seeds=())
    with pytest.raises(ValueError, match="seeds must differ"):
        protocol(fake_scorer(1e-4), TOY_SPLITS, [1e-4], seeds=[1, 1])
    with pytest.raises(ValueError, match="dev_fraction"):
        split_data(TOY, TOY_TEST, dev_fraction=1.5)
    with pytest.raises(ValueError, match="label budget"):
        subsample(TOY, 0, seed=0)
    with pytest.raises(ValueError, match="3 texts but 2 labels"):
        Data(("a", "b", "c"), (0, 1))


def test_a_task_whose_text_was_pretrained_on_is_refused():
    with pytest.raises(ValueError, match="tweet_sentiment.*'tweets'"):
        check_no_overlap(["rotten_tomatoes", "tweet_sentiment"], ["kjv", "tweets"])
    check_no_overlap(["rotten_tomatoes", "bbc_news", "tweet_sentiment"], ["kjv", "vader", "wikipedia"])


def test_majority_and_tfidf_rows_on_a_toy_set():
    words = ("apple banana", "cherry grape", "lemon melon")  # each class its own words
    train = [f"{words[i % 3]} filler{i}" for i in range(30)]
    labels = [i % 3 for i in range(30)]
    test = ["banana apple", "melon", "grape cherry", "lemon lemon"]
    assert tfidf_accuracy(train, labels, test, [0, 2, 1, 2]) == 1.0  # one-vs-rest, 3 classes
    assert tfidf_accuracy(train[:20], [y % 2 for y in labels[:20]], test[:1], [0]) == pytest.approx(1.0)
    # majority: the training set's most common label, scored on the test labels
    assert majority_accuracy([2, 2, 1, 0], [2, 1, 1, 2, 2]) == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="at least 2"):
        tfidf_accuracy(["a b", "a c"], [1, 1], ["a"], [1])


def test_unigram_cross_entropy_by_hand():
    # vocabulary of 6: ids 0 and 1 special; training counts of the ordinary ids 2..5 are 3, 1, 0, 0
    train = torch.tensor([[0, 2, 2, 2, 3, 1]])
    held = torch.tensor([[0, 2, 5, 1]])
    # add-one over the 4 ordinary ids: p = (4, 2, 1, 1) / 8; the held-out ordinary tokens are 2 and 5
    expected = -(math.log(4 / 8) + math.log(1 / 8)) / 2
    assert unigram_cross_entropy(train, held, 6, [0, 1]) == pytest.approx(expected, rel=1e-12)  # float64 sums
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        unigram_cross_entropy(train, held, 4, [0, 1])


def test_the_linear_probe_leaves_the_encoder_unchanged(tiny_cramming_run):
    features, encoder = encoder_features(tiny_cramming_run)
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    splits = split_data(TOY, TOY_TEST, seed=0)
    score = probe_scorer(features)
    accuracy = score(splits.train, splits.test, None, 0)
    assert 0 <= accuracy <= 1
    for k, v in encoder.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)  # bit for bit
    assert score(splits.train, splits.test, None, 1) == accuracy  # convex, from zero: no seed dependence


def test_fine_tuning_depends_on_the_seed_and_repeats_given_it(tiny_cramming_run, seed_dependent_scores):
    """The score is read from the fine-tuned weights (``seed_dependent_scores``), not the accuracy."""
    splits = split_data(
        Data(
            tuple(f"{'good fine' if i % 2 else 'bad awful'} day {i}" for i in range(80)),
            tuple(i % 2 for i in range(80)),
        ),
        TOY_TEST,
        seed=0,
    )
    settings = FinetuneSettings(epochs=1, batch_size=8)
    for from_scratch in (True, False):
        score = finetune_scorer(tiny_cramming_run, from_scratch=from_scratch, settings=settings)
        first = [score(splits.train, splits.test, 4e-4, seed) for seed in (0, 1)]
        # exact: the same seed must give the same weights (fp32 on a CPU, one thread order)
        assert [score(splits.train, splits.test, 4e-4, seed) for seed in (0, 1)] == first
        assert first[0] != first[1]  # the seed moves the result (head, dropout and batch order; weights too)


def test_minilm_rows_fine_tune_and_probe_on_a_toy_task():
    from llmedu.cramming.studies.encoders import minilm_features, minilm_scorer

    splits = split_data(TOY, TOY_TEST, seed=0)
    accuracy = minilm_scorer(FinetuneSettings(epochs=1, batch_size=30))(splits.train, splits.test, 1e-4, 0)
    assert 0 <= accuracy <= 1
    features, model = minilm_features()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert 0 <= probe_scorer(features)(splits.train, splits.test, None, 0) <= 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_the_evaluation_runs_end_to_end_from_the_command_line(tmp_path, capsys):
    """Pretrain a tiny run (no tweets: a task is made of them), then the whole protocol on three tasks."""
    from llmedu.cramming.__main__ import main

    out = tmp_path / "evaluation.json"
    args = ["evaluate", "--runs", f"crammed={tmp_path / 'crammed'}", "--out", str(out)]
    quick = ["--lrs", "1e-4", "4e-4", "--seeds", "0", "1", "--label-sizes", "40", "all", "--epochs", "1"]
    quick += ["--max-train", "64", "--max-eval", "32", "--no-minilm"]
    with pytest.raises(FileNotFoundError, match="--pretrain"):
        main([*args, *quick])
    pretraining = ["--pretrain", "4s", "--shape", "tiny", "--max-chars", "20000", "--tokenizer-chars", "30000"]
    printed = main([*args, *quick, *pretraining, "--eval-every", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == printed
    results = json.loads(out.read_text())
    assert "tweets" not in json.loads((tmp_path / "crammed" / "run.json").read_text())["corpora"]
    summary = results["pretraining"]["crammed"]["summary"]
    assert summary["passes"] > 0 and summary["dedup"]["train"]["documents"] > 0 and summary["val_history"]
    assert 0 < results["pretraining"]["crammed"]["unigram_cross_entropy"] < math.log(1024)
    assert list(results["tasks"]) == ["rotten_tomatoes", "bbc_news", "tweet_sentiment"]
    models = {"crammed", "crammed, linear probe", "random init", "random init, linear probe", "majority class",
              "TF-IDF + logistic regression"}  # fmt: skip
    for r in results["tasks"].values():
        assert r["sizes"] == {"train": 64, "dev": 32, "test": 32}
        assert set(r["models"]) == models
        assert r["models"]["crammed"]["lr"] in (1e-4, 4e-4) and r["models"]["majority class"]["lr"] is None
        assert list(r["models"]["crammed"]["label_efficiency"]) == ["40", "64"]
        assert len(r["models"]["random init"]["test"]["scores"]) == 2
    assert set(results["average"]) == models and printed["average"]["majority class"] == pytest.approx(
        results["average"]["majority class"]["mean"], abs=1e-4
    )


def test_finetune_and_evaluate_say_their_steps_and_duration_before_the_work(tiny_cramming_run, tmp_path, capsys):
    """The step count before the first step; the duration measured on the first steps (finetune) or the first
    fine-tune (evaluate), said to be measured, before the rest."""
    from llmedu.cramming.__main__ import main

    ft = ["finetune", "--checkpoint", str(tiny_cramming_run), "--epochs", "1", "--max-train", "192"]
    main([*ft, "--max-eval", "32", "--out", str(tmp_path / "ft")])
    err = capsys.readouterr().err
    said = "finetune: 1 epoch(s) of 6 batches of 32 = 6 optimizer steps; the duration is measured on the first 5"
    estimate = re.search(r"finetune: the first 5 steps took [\d.]+ s: about \d+ s for all 6 steps \(measured", err)
    assert said in err and estimate and err.index(said) < estimate.start()
    ev = ["evaluate", "--runs", f"crammed={tiny_cramming_run}", "--out", str(tmp_path / "e.json"), "--no-minilm"]
    quick = ["--tasks", "rotten_tomatoes", "--lrs", "1e-4", "--seeds", "0", "--label-sizes", "--epochs", "1"]
    main([*ev, *quick, "--max-train", "64", "--max-eval", "32"])
    err = capsys.readouterr().err
    said = "evaluate: 2 fine-tuned rows (crammed, random init) x 1 task(s): 8 optimizer steps"
    estimate = re.search(r"evaluate: the first fine-tune \(2 steps\) took \d+ s: about \d+ s for every fine-tune "
                         r"\(measured on this machine", err)  # fmt: skip
    assert said in err and estimate and err.index(said) < estimate.start()


def test_a_study_borrows_an_earlier_study_s_controls_only_when_its_fingerprint_repeats(tiny_cramming_run, tmp_path):
    """The control rows are reused, not measured again, and each way the reuse could be wrong is refused:
    another protocol, another tokenizer/shape/split (injected by moving the fingerprint), a name clash."""
    from llmedu.cramming.studies.study import FINGERPRINT, run_study

    config = StudyConfig(tasks=("bbc_news",), lrs=(4e-4,), seeds=(0,), label_sizes=(), epochs=1, max_train=32,
                         max_eval=16, minilm=False)  # fmt: skip
    first = run_study({"crammed": tiny_cramming_run}, config, out=tmp_path / "first.json", progress=False)
    second = run_study(
        {"crammed again": tiny_cramming_run},
        config,
        out=tmp_path / "second.json",
        progress=False,
        controls_from=tmp_path / "first.json",
    )
    then, now = first["tasks"]["bbc_news"]["models"], second["tasks"]["bbc_news"]["models"]
    borrowed = ["random init", "majority class", "TF-IDF + logistic regression"]
    assert second["controls_from"]["rows"] == borrowed
    assert set(now) == {"crammed again", "crammed again, linear probe", FINGERPRINT, *borrowed}
    for row in borrowed:
        assert now[row] == then[row] | {"borrowed": True}
    assert "borrowed" not in now[FINGERPRINT] and now[FINGERPRINT]["test"] == then[FINGERPRINT]["test"]
    assert now["crammed again"]["test"] == then["crammed"]["test"]  # same weights, same seed: measured again
    assert set(second["average"]) == set(now)

    with pytest.raises(ValueError, match="another protocol.*seeds"):
        run_study(
            {"c": tiny_cramming_run}, replace(config, seeds=(1,)), progress=False, controls_from=tmp_path / "first.json"
        )
    with pytest.raises(ValueError, match="may not be named like a control"):
        run_study({"random init": tiny_cramming_run}, config, progress=False, controls_from=tmp_path / "first.json")
    made_here = run_study.__globals__["make_splits"]  # splits drawn with another seed: same counts, other examples
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            "llmedu.cramming.studies.study.make_splits",
            lambda task, fraction, seed, **caps: made_here(task, fraction, 1, **caps),
        )
        with pytest.raises(ValueError, match="bbc_news: the splits made here .* are not the ones .*first.json"):
            run_study({"c": tiny_cramming_run}, config, progress=False, controls_from=tmp_path / "first.json")
    for examples, refused in ((2, False), (3, True)):  # another CPU may move it by an example or two: still it
        moved = json.loads((tmp_path / "first.json").read_text())
        moved["tasks"]["bbc_news"]["models"][FINGERPRINT]["test"]["mean"] += examples / 16
        (tmp_path / "moved.json").write_text(json.dumps(moved))
        if refused:
            with pytest.raises(ValueError, match="random-init probe scores .* 3 of 16 examples apart"):
                run_study({"c": tiny_cramming_run}, config, progress=False, controls_from=tmp_path / "moved.json")
        else:
            run_study({"c": tiny_cramming_run}, config, progress=False, controls_from=tmp_path / "moved.json")


def test_a_pretraining_run_that_did_not_finish_is_refused(tiny_cramming_run, tmp_path):
    """A stopped run keeps its run.json and a checkpoint but writes no summary.json: evaluating that checkpoint as
    the run would report a shorter pretraining than the one named."""
    import shutil

    from llmedu.cramming.studies.study import run_study

    stopped = tmp_path / "stopped"
    shutil.copytree(tiny_cramming_run, stopped)
    (stopped / "summary.json").unlink()
    with pytest.raises(ValueError, match=r"stopped holds a pretraining run that did not finish .*--resume"):
        run_study({"crammed": stopped}, StudyConfig(tasks=("rotten_tomatoes",)), progress=False)
