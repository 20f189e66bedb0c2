"""MemoryTracker against PyTorch's own accounting of a real training step.

References: ``torch.distributed._tools.mem_tracker.MemTracker`` (a dispatch-mode tracker that runs
on CPU as well as CUDA, so it is the peer the brief names), the profiler's memory timeline (it
records every allocation of the CPU allocator, so it also sees what bypasses the dispatcher), and
on a GPU ``torch.cuda.max_memory_allocated``. Tolerance: 5% of the peak. Every storage of the step
goes through an ATen op, so on CPU the peaks should agree to a few bytes; 5% leaves room for
allocations private to kernels and for the allocator's rounding on other builds.
"""

import json
import warnings

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from llmedu.memory import CATEGORIES, MemoryTracker, TinyGPT, training_step

VOCAB, SEQ, BATCH = 512, 64, 8


def make_run(device="cpu", warmup_steps=0):
    """A fresh, seeded model, AdamW and batch; ``warmup_steps`` steps already taken."""
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, SEQ, d_model=128, n_layers=2, n_heads=4).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.randint(0, VOCAB, (BATCH, SEQ), device=device), torch.randint(0, VOCAB, (BATCH, SEQ), device=device))
    for _ in range(warmup_steps):
        training_step(model, optimizer, batch)
    return model, optimizer, batch


def n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("warmup_steps", [0, 1], ids=["first step", "steady step"])
def test_peak_agrees_with_pytorch_memtracker(warmup_steps):
    model, optimizer, batch = make_run(warmup_steps=warmup_steps)
    with MemoryTracker(model, optimizer) as mt:
        training_step(model, optimizer, batch)

    model, optimizer, batch = make_run(warmup_steps=warmup_steps)  # the same step, from the same state
    reference = MemTracker()
    reference.track_external(model, optimizer, batch)  # what existed before its `with`
    with reference:
        training_step(model, optimizer, batch)
    ref_peak = reference.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    print(f"ours {mt.peak_bytes} B, MemTracker {ref_peak} B, ratio {mt.peak_bytes / ref_peak:.6f}")
    assert mt.peak_bytes == pytest.approx(ref_peak, rel=0.05)


@pytest.mark.parametrize("warmup_steps", [0, 1], ids=["first step", "steady step"])
def test_peak_agrees_with_profiler_memory_timeline(warmup_steps, tmp_path):
    model, optimizer, batch = make_run(warmup_steps=warmup_steps)
    with MemoryTracker(model, optimizer) as mt:
        training_step(model, optimizer, batch)

    model, optimizer, batch = make_run(warmup_steps=warmup_steps)
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    )
    with profiler:
        training_step(model, optimizer, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the memory timeline export is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        profiler.export_memory_timeline(str(tmp_path / "timeline.json"), device="cpu")
    _, sizes = json.loads((tmp_path / "timeline.json").read_text())  # [times, [bytes by category]]
    ref_peak = max(sum(row) for row in sizes)

    print(f"ours {mt.peak_bytes} B, profiler {ref_peak} B, ratio {mt.peak_bytes / ref_peak:.6f}")
    assert mt.peak_bytes == pytest.approx(ref_peak, rel=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_peak_agrees_with_cuda_allocator():
    model, optimizer, batch = make_run("cuda", warmup_steps=1)  # warm-up also creates cuBLAS workspaces
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with MemoryTracker(model, optimizer) as mt:
        training_step(model, optimizer, batch)
    torch.cuda.synchronize()
    # Bytes the allocator holds that the tracker never sees: workspaces, leftovers of earlier tests.
    batch_bytes = sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in batch)
    unseen = before - mt.timeline[0].total - batch_bytes
    assert mt.peak_bytes == pytest.approx(torch.cuda.max_memory_allocated() - unseen, rel=0.05)


def saved_for_backward(root):
    """Bytes by storage of every tensor the autograd graph under ``root`` holds for backward.

    An independent count: it walks the graph's nodes and reads their ``_saved_*`` attributes.
    """
    saved, seen, stack = {}, set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                for t in value if isinstance(value, (tuple, list)) else [value]:
                    if isinstance(t, torch.Tensor):
                        saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return saved


def test_categories_of_a_training_step():
    model, optimizer, batch = make_run(warmup_steps=0)
    params = {id(p.untyped_storage()) for p in model.parameters()}
    with MemoryTracker(model, optimizer) as mt:
        logits = model(batch[0])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
        activations = mt.current_by_category()["activations"]
        saved = saved_for_backward(loss.grad_fn)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del logits, loss

    # Dividing by a Python number saves it as an 8-byte wrapped scalar that never reaches the
    # dispatcher nor the saved-tensor hooks: one per block here (q @ k^T / sqrt(d)).
    wrapped_scalars = 8 * len(model.blocks)
    assert activations == sum(n for key, n in saved.items() if key not in params) - wrapped_scalars
    psi = n_params(model)
    step_counters = 4 * len(list(model.parameters()))  # AdamW's `step`: one fp32 scalar per tensor
    assert all(s.by_category["parameters"] == 4 * psi for s in mt.timeline)
    assert mt.max_bytes("gradients") == 4 * psi
    assert mt.max_bytes("optimizer") == 8 * psi + step_counters
    end = mt.timeline[-1].by_category
    assert end["gradients"] == 0  # zero_grad(set_to_none=True) freed them
    assert end["activations"] == sum(t.numel() * t.element_size() for t in batch)  # only the batch is left
    assert {s.phase for s in mt.timeline} == {"forward", "backward", "optimizer"}
    assert sum(mt.peak_by_category().values()) == mt.peak_bytes
    assert set(mt.series()) == set(CATEGORIES) and len(mt.series()["other"]) == len(mt.timeline)


def test_views_share_one_storage_and_frees_are_seen():
    model = torch.nn.Linear(2, 2)
    with MemoryTracker(model) as mt:
        x = torch.zeros(1000)  # 4000 bytes
        views = [x[:10], x.view(10, 100), x.unsqueeze(0).expand(3, 1000)]
        during = mt.current_by_category()["other"]
        del x, views
        after = mt.current_by_category()["other"]
    assert during == 4000
    assert after == 0
    assert mt.peak_bytes == 4000 + 4 * 6  # the Linear's 6 parameters are always counted


def test_only_the_chosen_device_is_counted():
    model = torch.nn.Linear(2, 2)
    with MemoryTracker(model, device="meta") as mt:  # the model is on the CPU; watch "meta"
        cpu = torch.zeros(1000)
        meta = torch.zeros(1000, device="meta")
    assert mt.peak_bytes == 4000
    assert cpu.device != meta.device


def test_tensors_made_before_the_block_are_counted_from_first_use():
    outside = torch.ones(256)  # 1024 bytes, neither parameter nor gradient nor optimizer state
    model = torch.nn.Linear(4, 4)
    with MemoryTracker(model) as mt:
        y = outside * 2  # reads `outside`: both are now counted
    assert mt.timeline[0].by_category["other"] == 0
    assert mt.timeline[-1].by_category["other"] == 2048
    assert y.shape == outside.shape


def test_existing_gradients_and_optimizer_state_are_recognised():
    model, optimizer, batch = make_run(warmup_steps=1)
    loss = model(batch[0]).sum()
    loss.backward()  # gradients exist before the block
    with MemoryTracker(model, optimizer) as mt:
        pass
    psi = n_params(model)
    assert mt.timeline[0].by_category["gradients"] == 4 * psi
    assert mt.timeline[0].by_category["optimizer"] >= 8 * psi


def test_bad_input_and_misuse():
    with pytest.raises(TypeError, match="nn.Module"):
        MemoryTracker(torch.zeros(3))
    with pytest.raises(TypeError, match="Optimizer"):
        MemoryTracker(torch.nn.Linear(2, 2), optimizer="adam")
    with pytest.raises(ValueError, match="choose one with device="):
        MemoryTracker(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")))
    with pytest.raises(ValueError, match="no parameters.*pass device="):  # once counted the CPU on a GPU run
        MemoryTracker(torch.nn.Module())
    assert MemoryTracker(torch.nn.Module(), device="meta").device == torch.device("meta")
    mt = MemoryTracker(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="has not started"):
        mt.current_by_category()
    with mt:
        with pytest.raises(RuntimeError, match="once the"):
            _ = mt.peak_bytes
    with pytest.raises(RuntimeError, match="one block"):
        with mt:
            pass
    with pytest.raises(ValueError, match="name one or more"):
        mt.max_bytes("weights")
    with pytest.raises(ValueError, match="unit"):
        mt.summary("MB")
    with pytest.raises(NotImplementedError, match="dense"):
        with MemoryTracker(torch.nn.Linear(2, 2)):
            torch.eye(3).to_sparse() * 2
