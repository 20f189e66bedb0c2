"""Simulated training steps: a 1B model on fake tensors, and a small one simulated vs measured."""

import resource

import pytest
import torch

from llmedu.memory import CATEGORIES, MemoryTracker, TinyGPT, adamw_fp32_bytes, simulate_training_step, training_step

ONE_BILLION = dict(vocab_size=32000, seq_len=2048, d_model=2048, n_layers=18, n_heads=16)
SMALL = dict(vocab_size=512, seq_len=64, d_model=128, n_layers=2, n_heads=4)


def token_batch(vocab_size, seq_len, batch_size):
    shape = (batch_size, seq_len)
    return lambda: (torch.randint(0, vocab_size, shape), torch.randint(0, vocab_size, shape))


def test_a_one_billion_parameter_step_is_simulated_without_allocating_it():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes on Linux
    mt = simulate_training_step(lambda: TinyGPT(**ONE_BILLION), token_batch(32000, 2048, 1))
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before

    psi = sum(p.numel() for p in mt.model.parameters())
    assert 1.0e9 < psi < 1.1e9
    model_states = mt.max_bytes("parameters", "gradients", "optimizer")
    estimate = sum(adamw_fp32_bytes(psi).values())
    print(
        f"Ψ = {psi:,}; model states simulated {model_states / 2**30:.3f} GiB, estimated "
        f"{estimate / 2**30:.3f} GiB; peak {mt.peak_bytes / 2**30:.2f} GiB at {mt.peak_op}; "
        f"RSS grew {rss_growth / 2**20:.0f} MiB"
    )
    # The only difference is AdamW's step counters: one 4-byte scalar per parameter tensor.
    assert model_states - estimate == 4 * len(list(mt.model.parameters()))
    assert mt.peak_bytes > model_states - mt.max_bytes("gradients")  # activations come on top
    assert mt.peak_by_category()["activations"] > 0
    assert rss_growth < 2**30  # the step "uses" more than 20 GiB; this process did not


@pytest.mark.parametrize("warmup_steps", [0, 1], ids=["first step", "steady step"])
def test_a_small_step_simulated_equals_the_step_measured(warmup_steps):
    simulated = simulate_training_step(lambda: TinyGPT(**SMALL), token_batch(512, 64, 4), warmup_steps=warmup_steps)

    torch.manual_seed(0)
    model = TinyGPT(**SMALL)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = token_batch(512, 64, 4)()
    for _ in range(warmup_steps):
        training_step(model, optimizer, batch)
    with MemoryTracker(model, optimizer) as measured:
        training_step(model, optimizer, batch)

    print(f"peak simulated {simulated.peak_bytes} B, measured {measured.peak_bytes} B")
    # Fake tensors have the real shapes, dtypes and storage sizes, and the step runs the same ops
    # in the same order, so we expect the same bytes; 1% allows for ops whose fake (meta)
    # implementation allocates differently from the CPU kernel.
    assert simulated.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.01)
    for category in CATEGORIES:
        assert simulated.max_bytes(category) == pytest.approx(measured.max_bytes(category), rel=0.01), category


def test_the_first_step_has_no_optimizer_state_until_it_steps():
    first = simulate_training_step(lambda: TinyGPT(**SMALL), token_batch(512, 64, 4), warmup_steps=0)
    steady = simulate_training_step(lambda: TinyGPT(**SMALL), token_batch(512, 64, 4), warmup_steps=1)
    assert first.timeline[0].by_category["optimizer"] == 0
    assert steady.timeline[0].by_category["optimizer"] == first.max_bytes("optimizer")
    assert steady.peak_bytes > first.peak_bytes


def test_other_optimizers_and_losses_can_be_simulated():
    def loss_fn(model, batch):
        return model(batch).float().pow(2).mean()

    sgd = simulate_training_step(
        lambda: TinyGPT(**SMALL),
        lambda: torch.randint(0, 512, (2, 64)),
        lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=loss_fn,
    )
    assert sgd.max_bytes("optimizer") == 0  # plain SGD keeps no state


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="not a model"):
        simulate_training_step(TinyGPT(**SMALL), token_batch(512, 64, 1))
    with pytest.raises(TypeError, match="make_batch must be a callable"):
        simulate_training_step(lambda: TinyGPT(**SMALL), (torch.zeros(1, 64), torch.zeros(1, 64)))
    with pytest.raises(TypeError, match="must return an nn.Module"):
        simulate_training_step(lambda: "a model", token_batch(512, 64, 1))
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer"):
        simulate_training_step(lambda: TinyGPT(**SMALL), token_batch(512, 64, 1), lambda params: None)
    with pytest.raises(ValueError, match="warmup_steps"):
        simulate_training_step(lambda: TinyGPT(**SMALL), token_batch(512, 64, 1), warmup_steps=-1)
    with pytest.raises(ValueError, match="not divisible"):
        TinyGPT(512, 64, d_model=100, n_layers=1, n_heads=3)
    with pytest.raises(ValueError, match="n_layers"):
        TinyGPT(512, 64, d_model=128, n_layers=0, n_heads=4)
    with pytest.raises(ValueError, match="token ids of shape"):
        TinyGPT(**SMALL)(torch.zeros(1, 65, dtype=torch.long))
