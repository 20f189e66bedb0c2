"""Cramming end to end on a small slice: budget, checkpoints, exact resume, clear errors, fine-tuning."""

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmedu.cramming.__main__ import main
from llmedu.cramming.finetune import AUTHORS, FIXED, FinetuneSettings, finetune
from llmedu.cramming.pretrain import (
    PretrainRun,
    load_pretrained,
    load_run,
    mlm_flops_per_token,
    mlm_loss_fn,
    pretrain,
)
from llmedu.cramming.recipe import (
    ABLATIONS,
    CUDA_SHAPE,
    TINY_SHAPE,
    BudgetClock,
    Recipe,
    budget_accumulation,
    budget_schedule,
    crammed,
    original_bert,
    parse_budget,
)
from llmedu.data.packing import mask_tokens
from llmedu.models import MaskedLM, TransformerConfig
from llmedu.models.bert import mlm_loss
from llmedu.tokenizers import WordPieceTokenizer
from llmedu.train import checkpoint as ckpt

MAX_CHARS = 20_000  # of each corpus: ~150 rows of 128 tokens
QUIET = dict(tokenizer_chars=30_000, progress=False)
TINY = crammed(**{**TINY_SHAPE, "micro_batch": 8})


@pytest.mark.parametrize("text, seconds", [("30s", 30), ("10m", 600), ("24h", 86400), ("1.5h", 5400), ("90", 90)])
def test_budgets_parse(text, seconds):
    assert parse_budget(text) == seconds


@pytest.mark.parametrize("text", ["", "ten minutes", "10 min", "-5m", "0s", "5x"])
def test_a_budget_that_cannot_be_parsed_is_a_clear_error(text):
    with pytest.raises(ValueError, match="budget"):
        parse_budget(text)


def test_one_cycle_schedule_follows_the_budget_not_the_steps():
    clock = BudgetClock(seconds=100)
    schedule = budget_schedule(TINY, clock)
    factors = []
    for elapsed in (0, 25, 50, 75, 100):
        clock.elapsed = elapsed
        factors.append(schedule(step=7))  # the step does not matter, the clock does
    assert factors == [1e-3, 0.5, 1.0, 0.5, 0.0]


def test_the_batch_grows_to_full_at_sixty_percent_of_the_budget():
    clock = BudgetClock(seconds=100)
    ramp = budget_accumulation(crammed(accumulation=4), clock)
    sizes = []
    for elapsed in (0, 10, 20, 30, 45, 60, 90):
        clock.elapsed = elapsed
        sizes.append(ramp(step=3))
    assert sizes == [1, 1, 2, 2, 3, 4, 4]  # ceil(4 * f / 0.6), at least 1, at most 4
    assert budget_accumulation(original_bert(accumulation=4), clock) == 4  # BERT: a fixed batch


def test_auto_precision_is_bf16_only_where_the_hardware_has_it(monkeypatch):
    cpu, recipe = torch.device("cpu"), crammed()
    for avx512_bf16, amx, expected in ((True, False, "bf16"), (False, True, "bf16"), (False, False, "fp32")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert recipe.resolved_precision(cpu) == expected
    assert crammed(precision="fp32").resolved_precision(cpu) == "fp32"
    for bf16, expected in ((True, "bf16"), (False, "fp16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda v=bf16: v)
        assert recipe.resolved_precision(torch.device("cuda")) == expected


@pytest.mark.parametrize("sparse", [True, False])
def test_flops_per_token_equal_torch_flop_counter_for_sparse_and_full_prediction(sparse):
    """MFU must count what runs: with sparse prediction the head runs on the masked rows alone."""
    from torch.utils.flop_counter import FlopCounterMode

    recipe = crammed(**{**TINY_SHAPE, "mask_rate": 0.125, "sparse_prediction": sparse})
    model = MaskedLM(recipe.model)
    ids = torch.randint(5, recipe.model.vocab_size, (2, recipe.model.max_seq_len))  # (B, T)
    labels = torch.full_like(ids, -100)
    labels.view(-1)[torch.randperm(ids.numel())[: int(0.125 * ids.numel())]] = 7  # exactly the mask rate
    with FlopCounterMode(display=False) as counter:
        mlm_loss_fn(sparse)(model, {"input_ids": ids, "labels": labels}).backward()
    assert counter.get_total_flops() == mlm_flops_per_token(recipe, model) * ids.numel()


def test_geglu_splits_bert_ffn_like_the_authors_code():
    """The gated FFN splits BERT's 4d-wide projection into value and gate halves: 3/4 of the plain FFN's weights."""
    gated, plain = crammed(), crammed(activation="gelu")
    count = lambda r: sum(p.numel() for p in MaskedLM(r.model).transformer.blocks[0].mlp.parameters())  # noqa: E731
    d = gated.model.d_model
    assert (gated.model.d_ff, plain.model.d_ff) == (2 * d, 4 * d)
    assert count(gated) * 4 == count(plain) * 3 == 3 * 2 * d * 4 * d
    assert crammed(d_ff=300).model.d_ff == 300  # a width given is the gated FFN's hidden width, as in the config


def test_every_ablation_is_one_valid_change_of_the_recipe():
    for name, change in ABLATIONS.items():
        recipe = crammed(**change)
        assert set(recipe.differences(crammed())) <= set(change) | {"d_ff"}, name
        MaskedLM(recipe.model)  # builds


@pytest.mark.parametrize("recipe", [TINY, original_bert(**TINY_SHAPE)], ids=["crammed", "original"])
def test_sparse_prediction_gives_the_loss_and_gradients_of_full_prediction(recipe):
    torch.manual_seed(0)
    model = MaskedLM(recipe.model).eval()  # eval: dropout off, so both passes see the same network
    vocab = recipe.model.vocab_size
    ids = torch.randint(5, vocab, (4, 32))
    inputs, labels = mask_tokens(ids, 0.15, 4, vocab, [0, 1, 2, 3, 4], torch.Generator().manual_seed(1))
    batch = {"input_ids": inputs, "labels": labels}
    reference = mlm_loss(model(inputs), labels)  # the model's own head over every position, then masked
    grads = {}
    for sparse in (True, False):
        model.zero_grad()
        loss = mlm_loss_fn(sparse)(model, batch)
        loss.backward()
        grads[sparse] = [p.grad.clone() for p in model.parameters()]
        # the same float32 numbers summed over the same rows: only summation order can differ
        torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    for sparse_grad, full_grad in zip(grads[True], grads[False]):
        torch.testing.assert_close(sparse_grad, full_grad, rtol=1e-5, atol=1e-7)


def _weights(run):
    return load_pretrained(run)


def test_an_interrupted_run_resumes_exactly(tmp_path):
    """Interrupt after step 5 (checkpoints every 2): the interrupt saves step 5, so resuming redoes nothing,
    and the weights at step 6 equal an unbroken run's."""
    run = PretrainRun(TINY, budget_seconds=None, max_steps=6, corpora=["kjv"], max_chars=MAX_CHARS)
    settings = dict(checkpoint_every=2, eval_batches=1, **QUIET)
    pretrain(tmp_path / "whole", run, **settings)

    def interrupt(info):
        if info.step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pretrain(tmp_path / "broken", run, callbacks=[interrupt], **settings)
    saved = sorted(p.name for p in (tmp_path / "broken" / "checkpoints").iterdir())
    assert saved == ["step-000002", "step-000004", "step-000005"]  # the last by the interrupt
    summary = pretrain(tmp_path / "broken", run, resume=True, **settings)
    assert summary["steps"] == 6 and summary["steps_this_run"] == 1  # only step 6: nothing lost
    whole, resumed = _weights(tmp_path / "whole"), _weights(tmp_path / "broken")
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=0, msg=name)


def test_resuming_with_a_different_recipe_is_a_clear_error(tmp_path):
    run = PretrainRun(TINY, budget_seconds=None, max_steps=1, max_chars=MAX_CHARS)
    pretrain(tmp_path, run, eval_batches=1, **QUIET)
    other = PretrainRun(crammed(**{**TINY_SHAPE, "micro_batch": 8, "lr": 5e-4}), None, 2, max_chars=MAX_CHARS)
    with pytest.raises(ValueError, match="different recipe.*lr.*max_steps"):
        pretrain(tmp_path, other, resume=True, **QUIET)
    with pytest.raises(ValueError, match="different recipe.*d_model"):
        pretrain(tmp_path, replace(run, recipe=crammed(**{**TINY_SHAPE, "micro_batch": 8, "d_model": 32})), resume=True)
    with pytest.raises(FileExistsError, match="already holds a run"):
        pretrain(tmp_path, run, **QUIET)


def test_a_run_survives_its_json_file():
    """run.json round trip: the recipe with its TransformerConfig, the corpora (a JSON list) and the rest."""
    for recipe in (TINY, original_bert(**CUDA_SHAPE)):
        run = PretrainRun(recipe, budget_seconds=600.0, corpora=["kjv", "tweets"], max_chars=1000, seed=3)
        again = PretrainRun.from_dict(json.loads(json.dumps(run.to_dict())))
        assert again == run and again.differences(run) == {}
        assert isinstance(again.recipe.model, TransformerConfig) and again.recipe.betas == recipe.betas
    with pytest.raises(ValueError, match="unknown recipe fields"):
        Recipe.from_dict({**TINY.to_dict(), "learning_rate": 1e-3})
    with pytest.raises(ValueError, match="budget in seconds, max_steps, or both"):
        PretrainRun(TINY, budget_seconds=None)


def test_a_run_folder_saved_with_the_flat_recipe_still_loads(tmp_path):
    """Before the recipe held its TransformerConfig, run.json listed the model's fields among the recipe's,
    with d_ff as BERT's first projection (split in two when gated) and seq_len for max_seq_len."""
    flat = {
        "name": "crammed", "d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 128, "seq_len": 128,
        "vocab_size": 1024, "norm_placement": "pre", "bias": False, "activation": "geglu",
        "position": "scaled_sinusoidal", "dropout": 0.0, "attn_impl": "math", "fused": True,
        "sparse_prediction": True, "mask_rate": 0.15, "mask_fraction": 0.8, "random_fraction": 0.1,
        "schedule": "one_cycle", "lr": 0.001, "warmup": 0.1, "weight_decay": 0.01, "betas": [0.9, 0.98],
        "clip_grad_norm": 0.5, "micro_batch": 8, "accumulation": 1, "batch_ramp": 0.6, "precision": "auto",
    }  # fmt: skip
    spec = {"recipe": flat, "corpora": ["kjv"], "max_chars": 20000, "budget_seconds": None, "max_steps": 6, "seed": 0}
    (tmp_path / "run.json").write_text(json.dumps(spec, indent=1))
    saved = WordPieceTokenizer().train("a saved run", vocab_size=20)
    saved.save(tmp_path / "tokenizer.json")
    recipe, tokenizer = load_run(tmp_path)
    same = crammed(**{**TINY_SHAPE, "d_ff": 64, "micro_batch": 8})  # the GEGLU halves of the old d_ff=128
    assert recipe == same and tokenizer.vocab == saved.vocab
    # so the old run resumes with the same recipe written the new way
    assert PretrainRun.from_dict(spec).differences(PretrainRun(same, None, 6, ["kjv"], 20_000)) == {}


def test_a_corpus_too_small_for_one_batch_is_a_clear_error(tmp_path):
    run = PretrainRun(crammed(**{**TINY_SHAPE, "micro_batch": 64}), 5.0, corpora=["kjv"], max_chars=3_000)
    with pytest.raises(ValueError, match="too small for one batch"):
        pretrain(tmp_path, run, **QUIET)
    assert not (tmp_path / "run.json").exists(), "nothing is written before the data is known to suffice"


def test_budget_run_end_to_end_from_the_command_line(tmp_path, capsys):
    """pretrain under a wall-clock budget -> checkpoint -> resume -> fine-tune -> evaluate, via the CLI."""
    out = str(tmp_path / "run")
    common = [
        "--out",
        out,
        "--shape",
        "tiny",
        "--max-chars",
        "20000",
        "--tokenizer-chars",
        "30000",
        "--checkpoint-every",
        "5",
        "--keep-checkpoints",
        "2",
    ]
    first = main(["pretrain", "--budget", "6s", *common])
    saves = -(-first["steps"] // 5)  # every 5 steps and at the end
    assert len(ckpt.checkpoints(tmp_path / "run" / "checkpoints")) == min(2, saves)  # the older ones removed
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the last line is the JSON summary
    assert printed == first
    assert first["stop_reason"] == "seconds"
    # The trainer reads the clock before each step: it stops at the first step that ends past the
    # budget, so it overshoots by less than one step (a few percent of a real budget; on a loaded
    # 2-core test machine one step of this tiny model can take seconds, so the bound is the step).
    assert 6 <= first["elapsed_seconds"] < 6 + first["longest_step_seconds"], first
    assert first["wall_seconds"] >= first["elapsed_seconds"]
    assert first["val_loss"] < 7.0  # ln(1024) = 6.93 is a uniform guess; a few steps start from about there
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == first["steps"]

    # a longer budget of the same run is a different run: resuming it must be refused...
    with pytest.raises(ValueError, match="budget_seconds"):
        main(["pretrain", "--budget", "8s", "--resume", *common])
    capsys.readouterr()
    # ...while the same settings resume from the last checkpoint, which already spent the budget
    again = main(["pretrain", "--budget", "6s", "--resume", *common])
    assert again["steps"] == first["steps"] and again["steps_this_run"] == 0

    result = main(["finetune", "--checkpoint", out, "--epochs", "1", "--max-train", "96", "--max-eval", "64"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["init"] == "pretrained" and result["steps"] == 3 and 0 <= result["accuracy"] <= 1
    assert result["settings"] == {**asdict(FIXED), "epochs": 1}
    kept = Path(result["out"])  # the fine-tuned classifier is kept, in the run folder by default
    assert kept == tmp_path / "run" / "finetuned" / "rotten_tomatoes-pretrained-seed0"
    assert json.loads((kept / "results.json").read_text()) == {k: v for k, v in result.items() if k != "out"}
    weights = load_file(kept / "model.safetensors")
    assert weights["classifier.weight"].shape[0] == 2 and "transformer.tok_embed.weight" in weights
    with pytest.raises(FileExistsError, match="already holds fine-tuning results"):
        main(["finetune", "--checkpoint", out, "--epochs", "1", "--max-train", "96", "--max-eval", "64"])

    # the authors' settings, with the batch overridden: 96 examples in batches of 48 are 2 steps
    result = main(
        [
            "finetune",
            "--checkpoint",
            out,
            "--settings",
            "authors",
            "--batch-size",
            "48",
            "--epochs",
            "1",
            "--max-train",
            "96",
            "--max-eval",
            "64",
            "--from-scratch",
        ]
    )
    assert result["init"] == "random" and result["steps"] == 2
    assert result["settings"] == {**asdict(AUTHORS), "epochs": 1, "batch_size": 48}


def test_command_line_refuses_bad_arguments_before_writing_anything(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    for bad, says in (
        (["--budget", "-5m"], "the budget must be positive, got '-5m'"),
        (["--budget", "5m", "--max-steps", "0"], "max_steps must be an int >= 1, got 0"),
    ):
        with pytest.raises((SystemExit, ValueError)) as caught:
            main(["pretrain", *bad, "--out", str(out), "--shape", "tiny"])
        assert says in capsys.readouterr().err + str(caught.value)
        assert not out.exists(), f"{bad} left {sorted(p.name for p in out.iterdir())} behind"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main(["pretrain", "--budget", "5m", "--device", "cuda", "--out", str(out)])
    assert "--device: device 'cuda' was requested but is not available" in capsys.readouterr().err
    out.mkdir()
    (out / "run.json").write_text("{}")
    with pytest.raises(FileExistsError, match="--resume on the command line"):
        main(["pretrain", "--budget", "5m", "--out", str(out), "--shape", "tiny"])


def test_finetuning_rules(tmp_path):
    with pytest.raises(ValueError, match="1 to 5"):
        FinetuneSettings(epochs=6)
    with pytest.raises(ValueError, match="dropout"):
        FinetuneSettings(dropout=1.0)
    with pytest.raises(ValueError, match="schedule"):
        FinetuneSettings(schedule="constant")
    with pytest.raises(ValueError, match="lr must be positive"):
        FinetuneSettings(lr=0.0)
    with pytest.raises(FileNotFoundError, match="run.json"):
        finetune(tmp_path)


def test_graders_pass_the_reference_and_fail_a_wrong_answer(capsys):
    from llmedu.checks.cramming import check_pack, check_parse_budget, check_sparse_mlm_loss
    from llmedu.data.packing import pack

    assert check_pack(pack) and not check_pack(lambda d, t, c, s: pack(d, t, c, s)[:, 1:])
    assert check_parse_budget(parse_budget) and not check_parse_budget(lambda text: float(text.rstrip("smh")))
    assert check_sparse_mlm_loss(mlm_loss_fn(sparse=True))
    assert not check_sparse_mlm_loss(lambda model, batch: mlm_loss_fn(sparse=True)(model, batch) * 1.01)
    assert capsys.readouterr().out.count("FAIL") == 3


@pytest.mark.parametrize("damage", ["a flipped byte in its tensors", "its state.json cut short"])
def test_a_resume_past_a_damaged_newest_checkpoint_reads_everything_from_the_one_before(tmp_path, damage):
    """The newest checkpoint damaged: the resume takes its clock, step, position and weights from the one before
    (the damaged one moved aside), recomputes the lost steps exactly, and leaves a run that fine-tunes and resumes."""
    run = PretrainRun(TINY, budget_seconds=None, max_steps=6, corpora=["kjv"], max_chars=MAX_CHARS)
    settings = dict(checkpoint_every=2, eval_batches=1, **QUIET)
    whole = pretrain(tmp_path / "whole", run, **settings)
    pretrain(tmp_path / "broken", run, **settings)
    newest = tmp_path / "broken" / "checkpoints" / "step-000006"
    if damage.startswith("a flipped"):
        data = bytearray((newest / ckpt.TENSORS).read_bytes())
        data[-5] ^= 0xFF  # a byte of the tensors, past the header
        (newest / ckpt.TENSORS).write_bytes(bytes(data))
    else:
        state = (newest / ckpt.STATE).read_text()
        (newest / ckpt.STATE).write_text(state[: len(state) // 2])
    with pytest.warns(RuntimeWarning, match="damaged"):
        resumed = pretrain(tmp_path / "broken", run, resume=True, **settings)
    assert resumed["steps"] == 6 and resumed["steps_this_run"] == 2  # steps 5 and 6 again, from step 4
    assert resumed["tokens_seen"] == whole["tokens_seen"] and resumed["passes"] == whole["passes"]
    assert [s.lr for s in resumed["history"].steps] == [s.lr for s in whole["history"].steps[4:]]
    assert resumed["train_loss"] == pytest.approx(
        sum(s.loss for s in whole["history"].steps[4:]) / 2, abs=1e-4
    )  # the losses of steps 5 and 6 of the unbroken run
    for name, tensor in _weights(tmp_path / "whole").items():
        torch.testing.assert_close(_weights(tmp_path / "broken")[name], tensor, rtol=0, atol=0, msg=name)
    assert finetune(tmp_path / "broken", max_train=64, max_eval=32, progress=False)["steps"] > 0
    again = pretrain(tmp_path / "broken", run, resume=True, **settings)
    assert again["steps_this_run"] == 0 and again["tokens_seen"] == whole["tokens_seen"]


def test_a_run_json_with_an_unknown_field_or_attention_is_a_clear_error(tmp_path):
    run = PretrainRun(TINY, budget_seconds=None, max_steps=1, corpora=["kjv"], max_chars=MAX_CHARS)
    spec = run.to_dict()
    model = spec["recipe"]["model"]
    for i, (values, says) in enumerate(
        [
            ({**spec, "budget": 5}, r"unknown run fields 'budget'; allowed: recipe, budget_seconds, max_steps"),
            ({**spec, "recipe": {**spec["recipe"], "lr_peak": 1}}, r"unknown recipe fields 'lr_peak'; allowed: name"),
            (
                {**spec, "recipe": {**spec["recipe"], "model": {**model, "d_modle": 64}}},
                r"unknown model fields 'd_modle'",
            ),
            (
                {**spec, "recipe": {**spec["recipe"], "model": {**model, "attn_impl": "fast"}}},
                r"unknown attention implementation 'fast'; allowed: .*math, sdpa",
            ),
        ]
    ):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "run.json").write_text(json.dumps(values))
        with pytest.raises(ValueError, match=rf"{i}/run.json: {says}"):
            load_run(folder)
        with pytest.raises(ValueError, match=rf"{i}/run.json: {says}"):
            pretrain(folder, run, resume=True, **QUIET)


SIZE_OPTIONS = {  # every size option the capstone's commands take, with the arguments each command requires
    "pretrain": (["--out", "run"], ["--tokenizer-chars", "--max-chars", "--micro-batch", "--accumulation",
                                   "--checkpoint-every", "--keep-checkpoints", "--eval-every"]),
    "finetune": (["--checkpoint", "run"], ["--epochs", "--batch-size", "--max-train", "--max-eval"]),
    "evaluate": (["--runs", "run", "--out", "e.json"], ["--epochs", "--max-train", "--max-eval", "--max-chars",
                                                       "--tokenizer-chars", "--eval-every", "--label-sizes"]),
    "scaling": (["--out", "s.json"], ["--eval-batches", "--max-chars", "--tokenizer-chars"]),
    "vocab": (["--out", "v.json"], ["--eval-batches", "--max-chars", "--tokenizer-chars", "--probe-max-train",
                                    "--probe-max-eval"]),
    "probe-curve": (["--run", "run", "--out", "c.json"], ["--points", "--steps", "--max-train", "--max-eval"]),
}  # fmt: skip


@pytest.mark.parametrize("command, option", [(c, o) for c, (_, options) in SIZE_OPTIONS.items() for o in options])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_every_size_option_refuses_zero_and_negatives_naming_itself(command, option, value, capsys):
    from llmedu.cramming.cli import build_parser

    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args([command, *SIZE_OPTIONS[command][0], option, value])
    assert caught.value.code == 2
    assert f"argument {option}: {option} must be >= 1, got {value}" in capsys.readouterr().err


def test_pretrain_with_micro_batch_zero_is_refused_not_run_with_the_default(tmp_path, capsys):
    """A falsy 0 used to be dropped: the run went ahead at the recipe's micro-batch and exited 0."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        main(["pretrain", "--micro-batch", "0", "--max-steps", "1", "--shape", "tiny", "--max-chars", "20000",
              "--tokenizer-chars", "30000", "--out", str(out)])  # fmt: skip
    assert "--micro-batch must be >= 1, got 0" in capsys.readouterr().err and not out.exists()


def test_every_command_shows_examples_the_first_about_a_minute(capsys):
    from llmedu.cramming.cli import EXAMPLES, build_parser
    from llmedu.cramming.studies.commands import STUDY_COMMANDS, STUDY_EXAMPLES

    commands = ["pretrain", "finetune", "evaluate", *STUDY_COMMANDS]
    assert set(commands) <= set(EXAMPLES) | set(STUDY_EXAMPLES)
    for command in commands:
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        examples = capsys.readouterr().out.split("examples:\n")[1]
        first, *rest = examples.split("\n  python -m")
        assert first.startswith(f"  python -m llmedu.cramming {command} ") and "about a minute" in first, command
        assert all("about" in example or "after an interruption" in example or "the control" in example
                   for example in rest), command  # fmt: skip
