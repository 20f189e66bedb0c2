"""crammed_loop, the capstone's budgeted step in one loop: the budget clock, the schedule, the batch ramp,
clipping, autocast, the hooks; and pretrain, which runs it, still gives the loss curve it gave before."""

import math

import pytest
import torch

import llmedu.cramming.loop as loop
from llmedu.cramming.loop import Hooks, crammed_loop
from llmedu.cramming.pretrain import PretrainRun, _adamw, pretrain
from llmedu.cramming.recipe import TINY_SHAPE, BudgetClock, crammed
from llmedu.models import MaskedLM
from llmedu.train.clipping import global_grad_norm

CPU = torch.device("cpu")
B, T = 2, 16  # a micro-batch of 2 rows of 16 tokens


def _recipe(**overrides):
    return crammed(**{**TINY_SHAPE, "micro_batch": B, "precision": "fp32", **overrides})


def _batches(vocab: int, seen: list | None = None):
    """batches(i): random tokens with every 4th position masked; ``seen`` records the indices read."""

    def batch(i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(5, vocab, (B, T), generator=g)
        labels = torch.full((B, T), -100)
        labels[:, ::4] = ids[:, ::4]
        inputs = ids.clone()
        inputs[:, ::4] = 4  # [MASK]
        if seen is not None:
            seen.append(i)
        return {"input_ids": inputs, "labels": labels}

    return batch


class FakeTime:
    """A perf_counter that moves ``step_seconds`` from each call to the next: the loop reads it at the start
    and the end of each step, so every step takes exactly ``step_seconds`` of the budget."""

    def __init__(self, step_seconds: float):
        self.now, self.step = 0.0, step_seconds

    def __call__(self) -> float:
        self.now += self.step
        return self.now - self.step


def _run(recipe, clock, monkeypatch, step_seconds=1.25, seen=None, make_optimizer=_adamw, **kw):
    monkeypatch.setattr(loop, "perf_counter", FakeTime(step_seconds))
    torch.manual_seed(0)
    model = MaskedLM(recipe.model)
    optimizer = make_optimizer(model, recipe)
    history = crammed_loop(model, optimizer, _batches(recipe.model.vocab_size, seen), recipe, clock, device=CPU, **kw)
    return history, model, optimizer


def test_the_loop_stops_when_the_seconds_or_the_steps_are_spent(monkeypatch):
    """Steps of 1.25 s on a budget of 10 s: the 8th step ends at 10.0 s, so there are 8; steps count too."""
    history, _, _ = _run(_recipe(), BudgetClock(10.0, max_steps=50), monkeypatch)  # 50: a stop that is not reached
    assert history.stop_reason == "seconds" and len(history.steps) == 8
    assert [s.elapsed for s in history.steps] == [1.25 * n for n in range(1, 9)]
    # a resumed clock that has spent 9 of the 10 seconds has one step left
    history, _, _ = _run(_recipe(), BudgetClock(10.0, elapsed=9.0), monkeypatch, step=40)
    assert history.stop_reason == "seconds" and [s.step for s in history.steps] == [41]
    history, _, _ = _run(_recipe(), BudgetClock(10.0, max_steps=3), monkeypatch)
    assert history.stop_reason == "steps" and len(history.steps) == 3


def test_the_learning_rate_follows_the_budget_schedule_at_each_step(monkeypatch):
    """One-cycle over the budget: up to recipe.lr at half of it, down to 0 at its end (never 0 at the start).
    Step n starts with (n - 1) x 1.25 s of the 10 s spent, so f = 0, 1/8, ..., 7/8; max_steps=100 spends less."""
    history, _, optimizer = _run(_recipe(lr=1e-3), BudgetClock(10.0, max_steps=100), monkeypatch)
    triangle = [1e-3, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25]  # written out: the multiplier at f = n / 8
    assert [s.lr for s in history.steps] == pytest.approx([1e-3 * m for m in triangle], rel=1e-12)
    assert all(g["lr"] == pytest.approx(1e-3 * 0.25) for g in optimizer.param_groups)  # every group, not one
    linear = _run(_recipe(lr=1e-3, schedule="linear", warmup=0.25), BudgetClock(10.0), monkeypatch)[0]
    warm_then_down = [1e-3, 0.5, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]  # up over 25% of the budget, then down
    assert [s.lr for s in linear.steps] == pytest.approx([1e-3 * m for m in warm_then_down], rel=1e-12)


def test_accumulation_follows_the_batch_ramp(monkeypatch):
    """accumulation=4 reached at 60% of the budget: k = ceil(4 f / 0.6), at least 1. The micro-batches are read
    in order, k of them per step, and the step's tokens are k micro-batches' worth."""
    seen = []
    history, _, _ = _run(_recipe(accumulation=4, batch_ramp=0.6), BudgetClock(10.0), monkeypatch, seen=seen)
    ramp = [1, 1, 2, 3, 4, 4, 4, 4]  # f = n / 8: 4f/0.6 = 0, 0.83, 1.67, 2.5, 3.33, 4.17, ...
    assert [s.tokens for s in history.steps] == [k * B * T for k in ramp]
    assert seen == list(range(sum(ramp)))
    # without a ramp every step reads the full batch, from where a resumed run left off
    seen.clear()
    fixed, _, _ = _run(_recipe(accumulation=4, batch_ramp=0.0), BudgetClock(10.0, max_steps=2), monkeypatch, seen=seen)
    assert [s.tokens for s in fixed.steps] == [4 * B * T] * 2 and seen == list(range(8))
    seen.clear()
    _run(_recipe(accumulation=4, batch_ramp=0.0), BudgetClock(None, max_steps=1), monkeypatch, seen=seen, position=17)
    assert seen == [17, 18, 19, 20]


@pytest.mark.parametrize("clip", [0.5, None])
def test_clipping_bounds_the_gradient_norm_that_the_optimizer_steps_with(monkeypatch, clip):
    norms = []  # the global gradient norm as optimizer.step() sees it

    def spied_adamw(model, recipe):
        optimizer = _adamw(model, recipe)
        step = optimizer.step
        optimizer.step = lambda: (norms.append(float(global_grad_norm(list(model.parameters())))), step())[1]
        return optimizer

    history, _, _ = _run(_recipe(clip_grad_norm=clip), BudgetClock(5.0), monkeypatch, make_optimizer=spied_adamw)
    before = [s.grad_norm for s in history.steps]  # StepInfo records the norm before clipping
    assert len(norms) == 4 and min(before) > 0.5, "the test needs gradients larger than the clip"
    if clip is None:
        assert norms == pytest.approx(before, rel=1e-5)
    else:
        assert all(n <= 0.5 * (1 + 1e-5) for n in norms), norms
        assert norms == pytest.approx([0.5] * 4, rel=1e-4)


@pytest.mark.parametrize("precision, autocast", [("fp32", False), ("bf16", True)])
def test_the_forward_runs_under_autocast_where_the_precision_is_bf16(monkeypatch, precision, autocast):
    seen = []
    recipe = _recipe(precision=precision)
    torch.manual_seed(0)
    model = MaskedLM(recipe.model)
    model.transformer.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    monkeypatch.setattr(loop, "perf_counter", FakeTime(1.0))
    crammed_loop(model, _adamw(model, recipe), _batches(1024), recipe, BudgetClock(None, 2), device=CPU)
    assert seen == [autocast, autocast]


class Recorded(Hooks):
    def __init__(self, stop_at=None):
        self.calls, self.stop_at = [], stop_at

    def evaluate(self, info):
        self.calls.append(("evaluate", info.step))

    def step_done(self, info):
        if info.step == self.stop_at:
            raise KeyboardInterrupt

    def checkpoint(self, step, position, seconds):
        self.calls.append(("checkpoint", step, position, seconds))


def test_the_hooks_run_every_n_steps_at_the_end_and_on_an_interrupt(monkeypatch):
    hooks = Recorded()
    _run(_recipe(), BudgetClock(None, 7), monkeypatch, step_seconds=1.0, eval_every=2, checkpoint_every=3, hooks=hooks)
    assert hooks.calls == [  # (hook, step[, micro-batches read, seconds spent])
        ("evaluate", 2),
        ("checkpoint", 3, 3, 3.0),
        ("evaluate", 4),
        ("evaluate", 6),
        ("checkpoint", 6, 6, 6.0),
        ("checkpoint", 7, 7, 7.0),  # the final state
    ]
    hooks = Recorded(stop_at=2)  # Ctrl-C after step 2: step 2 is what a resume needs
    with pytest.raises(KeyboardInterrupt):
        _run(_recipe(), BudgetClock(None, 7), monkeypatch, step_seconds=1.0, hooks=hooks)
    assert hooks.calls == [("checkpoint", 2, 2, 2.0)]


def test_a_non_finite_loss_stops_the_run_before_the_step_is_applied(monkeypatch):
    def broken_adamw(model, recipe):
        with torch.no_grad():
            model.mlm_head.decoder.bias[0] = float("nan")  # every logit row holds a NaN: the loss is NaN
        return _adamw(model, recipe)

    torch.manual_seed(0)
    model = MaskedLM(_recipe().model)
    optimizer = broken_adamw(model, _recipe())
    monkeypatch.setattr(loop, "perf_counter", FakeTime(1.0))
    with pytest.raises(FloatingPointError, match="step 1: loss nan"):
        crammed_loop(model, optimizer, _batches(1024), _recipe(), BudgetClock(None, 3), device=CPU)
    # it raised before optimizer.step(): AdamW makes its per-parameter state on its first step
    assert len(optimizer.state) == 0


# pretrain's curve, recorded from the code before it ran crammed_loop (it ran llmedu.train.train with the
# budget's schedule and ramp as callbacks): fp32, seed 0, 6 steps, the ramp to 2 micro-batches included
OLD_LOSS = [6.928645610809326, 6.949896812438965, 6.9210004806518555, 6.900131702423096, 6.847527980804443,
            6.817399978637695]  # fmt: skip
OLD_LR = [1e-06, 0.0003333333333333333, 0.0006666666666666666, 0.001, 0.0006666666666666668, 0.00033333333333333327]
OLD_GRAD_NORM = [1.3096201419830322, 1.1508615016937256, 1.1660553216934204, 1.0641425848007202, 1.0949124097824097,
                 1.0743917226791382]  # fmt: skip
OLD_VAL = [(2, 6.9423), (4, 6.8795), (6, 6.8375)]


def test_pretrain_gives_the_loss_curve_it_gave_before_it_ran_the_crammed_loop(tmp_path):
    recipe = crammed(**{**TINY_SHAPE, "micro_batch": 8, "accumulation": 2, "precision": "fp32"})
    run = PretrainRun(recipe, budget_seconds=None, max_steps=6, corpora=["kjv"], max_chars=100_000)
    s = pretrain(
        tmp_path / "r", run, tokenizer_chars=30_000, progress=False, eval_batches=2, eval_every=2, checkpoint_every=3
    )
    steps = s["history"].steps
    assert [x.lr for x in steps] == OLD_LR
    assert [x.tokens for x in steps] == [1024, 1024, 2048, 2048, 2048, 2048]  # the ramp: 1, then 2 micro-batches
    assert [x.loss for x in steps] == pytest.approx(OLD_LOSS, abs=2e-4)
    assert [x.grad_norm for x in steps] == pytest.approx(OLD_GRAD_NORM, rel=1e-3)
    assert [h["step"] for h in s["val_history"]] == [step for step, _ in OLD_VAL]
    assert [h["val_loss"] for h in s["val_history"]] == pytest.approx([loss for _, loss in OLD_VAL], abs=2e-4)
    assert (
        s["stop_reason"] == "steps" and s["tokens_seen"] == 10240 and s["val_loss"] == pytest.approx(6.8375, abs=2e-4)
    )
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step-000003", "step-000006"]
    assert not math.isnan(s["train_loss"])
