"""ZeRO 1/2/3 against single-process AdamW, ZeroRedundancyOptimizer (stage 1) and FSDP2 (stage 3);
then frozen (LoRA) and tied (GPT-2) parameters, and our own AdamW, against one process.

Each `launch` runs every check of one world size in one go (process start-up dominates on 2 cores).
Tolerances: fp32 1e-6 absolute on parameters of size ~0.1-1 after 3 AdamW steps: the sums run in a
different order (per-rank micro-batches, then a reduce), so results differ by a few ulps, never more.
A whole tiny GPT-2 (7,440 parameters) gets 5e-5, against a movement of 3e-2: Adam's first step divides
each gradient by its magnitude, so an element whose gradient nearly cancels moves by an amount set by
rounding. Measured: one process summing the gradients in ZeRO-1's order (per rank, then averaged) is
8e-6 from one summing the global micro-batches, and ZeRO-1 within 1e-7 of it (ZeRO-2/3, reduced per
micro-batch, 1.3e-6). LoRA's 512 trainable elements keep 1e-6.
"""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.optim import AdamW
from llmedu.parallel import launch
from llmedu.parallel.zero import ZeRO
from llmedu.peft import apply_lora

STEPS, ACCUM, LR, CLIP = 3, 2, 1e-2, 0.05  # CLIP is small enough that clipping really happens


class Tiny(nn.Module):
    """At width 5 each layer holds 35 parameters and the root 49: no unit divides by 2, 3 or 4 ranks."""

    def __init__(self, width=5, depth=2):
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width, bias=False), nn.GELU()) for _ in range(depth)
        )
        self.out = nn.Linear(width, 3)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):  # (B, 5) -> (B, 3)
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h) * self.scale


def _batches(world, per_rank=4):
    g = torch.Generator().manual_seed(1)
    rows = world * per_rank * ACCUM
    return [(torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(STEPS)]


def _micro(x, rank, world):
    """This rank's ACCUM micro-batches of a global batch (rank-major, as DistributedSampler would)."""
    return x.chunk(world)[rank].chunk(ACCUM)


def _oracle(model, batches, clip=CLIP, loss=nn.functional.mse_loss, optimizer_class=torch.optim.AdamW):
    """Single-process AdamW on the whole batch, with accumulation and clipping: params after each step."""
    opt = optimizer_class([p for p in model.parameters() if p.requires_grad], lr=LR)  # the trainable ones
    history = []
    for x, y in batches:
        for xm, ym in zip(x.chunk(ACCUM), y.chunk(ACCUM)):
            (loss(model(xm), ym) / ACCUM).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
        opt.step()
        opt.zero_grad()
        history.append(({k: v.detach().clone() for k, v in model.named_parameters()}, norm))
    return history


def _max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _train(zero, batches, oracle, loss=nn.functional.mse_loss):
    """ZeRO on this rank's micro-batches: per step, max |diff| to the oracle (or the norm's relative error)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    diffs, states = [], []
    for (x, y), (want, want_norm) in zip(batches, oracle):
        for xm, ym in zip(_micro(x, rank, world), _micro(y, rank, world)):
            (loss(zero(xm), ym) / ACCUM).backward()
        norm = zero.step()  # Adam hides a wrong gradient scale; the norm does not
        zero.zero_grad()
        states.append(zero.full_state_dict())
        diffs.append(max(_max_diff(states[-1], want), abs(norm / want_norm - 1)))
    return diffs, states


def _parity_worker():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = Tiny()
    batches = _batches(world)
    oracle = _oracle(copy.deepcopy(base), batches)
    out = {}

    def run(stage, **kw):
        return _train(ZeRO(copy.deepcopy(base), stage, lr=LR, max_grad_norm=CLIP, **kw), batches, oracle)

    (out["stage1"], ours1), (out["stage2"], _), (out["stage3"], _) = (run(stage) for stage in (1, 2, 3))
    out["stage3_prefetch"], ours3 = run(3, prefetch=True)

    # peer, stage 1: torch's DDP + ZeroRedundancyOptimizer
    ddp = DistributedDataParallel(copy.deepcopy(base))
    zro = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    out["zero_redundancy_optimizer"] = []
    for (x, y), mine in zip(batches, ours1):
        for i, (xm, ym) in enumerate(zip(_micro(x, rank, world), _micro(y, rank, world))):
            with ddp.no_sync() if i < ACCUM - 1 else contextlib.nullcontext():  # reduce on the last one only
                (nn.functional.mse_loss(ddp(xm), ym) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        zro.step()
        zro.zero_grad()
        out["zero_redundancy_optimizer"].append(_max_diff({k: v for k, v in ddp.module.named_parameters()}, mine))

    # peer, stage 3: FSDP2 (fully_shard on each layer, then the root), on CPU with gloo
    fsdp = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))  # its default is one GPU per rank where CUDA is present
    for layer in fsdp.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=LR)
    out["fsdp2"] = []
    for (x, y), mine in zip(batches, ours3):
        for xm, ym in zip(_micro(x, rank, world), _micro(y, rank, world)):
            (nn.functional.mse_loss(fsdp(xm), ym) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(fsdp.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        full = {k: v.full_tensor() for k, v in fsdp.named_parameters()}
        out["fsdp2"].append(_max_diff(full, mine))
    out["moved"] = _max_diff(oracle[-1][0], dict(base.named_parameters()))
    out["clipped"] = min(norm for _, norm in oracle) > CLIP  # the tolerance is far below this
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_stage_matches_adamw_and_torch_peers(world):
    results = launch(_parity_worker, world, echo=False, timeout=120)
    for rank, out in enumerate(results):
        assert out["moved"] > 1e-2, "the parameters barely moved: the comparison would prove nothing"
        assert out["clipped"], "every step must clip, or clipping is not tested"
        for name in ("stage1", "stage2", "stage3", "stage3_prefetch", "zero_redundancy_optimizer", "fsdp2"):
            assert len(out[name]) == STEPS
            assert max(out[name]) < 1e-6, f"rank {rank}, {name}: max |diff| (or norm error) per step {out[name]}"


def _bf16_oracle(base, x, y):
    model = copy.deepcopy(base).bfloat16()
    master = [p.detach().clone().requires_grad_() for p in base.parameters()]  # fp32 from the fp32 init
    opt = torch.optim.AdamW(master, lr=LR)
    for _ in range(2):
        nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        for p, m in zip(model.parameters(), master):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), master):
                p.copy_(m)
    return dict(zip([k for k, _ in base.named_parameters()], master))


def _memory_and_errors_worker():
    from llmedu.memory import MemoryTracker

    torch.manual_seed(0)
    base = Tiny(width=48, depth=4)  # Ψ = 9,843: large enough that scalars (Adam's step) are noise
    n = sum(p.numel() for p in base.parameters())
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    want = _bf16_oracle(base, x, y)  # here, not in the parent: same threads, same summation order
    out = {"n": n, "measured": {}, "bf16": {}, "moved": _max_diff(want, dict(base.named_parameters()))}
    for stage in (1, 2, 3):
        zero = ZeRO(copy.deepcopy(base), stage, lr=LR)
        for _step in range(2):  # measure the second step: the optimizer state exists by then
            tracker = MemoryTracker(zero, zero.optimizer)
            with tracker:
                nn.functional.mse_loss(zero(x), y).backward()
                zero.step()
                zero.zero_grad()
        out["measured"][stage] = tracker.max_bytes("parameters", "gradients", "optimizer")
        # mixed precision: bf16 compute, fp32 master, against the same on one process. Every rank gets
        # the same batch, so the average over ranks (a power of 2) of identical gradients is exact.
        zero = ZeRO(copy.deepcopy(base), stage, compute_dtype=torch.bfloat16, lr=LR)
        for _ in range(2):
            nn.functional.mse_loss(zero(x.bfloat16()).float(), y).backward()
            zero.step()
            zero.zero_grad()
        out["bf16"][stage] = _max_diff(zero.full_state_dict(), want)

    errors = {}
    for name, make in {
        "stage": lambda: ZeRO(Tiny(), 4),
        "optimizer": lambda: ZeRO(Tiny(), 1, torch.optim.LBFGS),
        "frozen": lambda: ZeRO(Tiny().requires_grad_(False), 1),
    }.items():
        try:
            make()
        except (ValueError, TypeError) as err:
            errors[name] = str(err)
    zero = ZeRO(Tiny(), 2, lr=LR)
    zero(torch.randn(2, 5))
    with torch.no_grad():
        zero.module.inp.weight.add_(1.0)  # a view of the full copy, changed behind the wrapper's back
    try:
        zero(torch.randn(2, 5))
    except RuntimeError as err:
        errors["changed"] = str(err)
    for stage in (2, 3):  # the gradient shards are made by backward: none exists before it
        try:
            ZeRO(Tiny(), stage, lr=LR).step()
        except RuntimeError as err:
            errors[f"step first {stage}"] = str(err)
    # buffers live only while their stage needs them
    out["lifetimes"] = {}
    for stage in (1, 2, 3):
        zero = ZeRO(Tiny(), stage, lr=LR)
        nn.functional.mse_loss(zero(x), y).backward()
        zero.step()  # stage 1: the full gradient is freed once reduce-scattered, before AdamW runs
        full_grads = [u.flat.grad for u in zero.units] if stage == 1 else []
        zero.zero_grad()  # stages 2 and 3: no gradient shard is kept between steps
        out["lifetimes"][stage] = (full_grads, [u.shard.grad for u in zero.units])
    zero = ZeRO(Tiny(), 3, lr=LR)
    zero.module.out.weight = nn.Parameter(torch.zeros(3, 7))
    try:
        zero(torch.randn(2, 5))
    except RuntimeError as err:
        errors["replaced"] = str(err)
    return out, errors


@pytest.mark.parametrize("world", [2, 4])
def test_memory_matches_the_formulas_mixed_precision_and_errors(world):
    results = launch(_memory_and_errors_worker, world, echo=False, timeout=120)
    for out, errors in results:
        n = out["n"]
        # fp32 AdamW: parameters 4Ψ, gradients 4Ψ, moments 8Ψ; stage s shards the last s of (opt, grad, param)
        formula = {1: 4 * n + 4 * n + 8 * n / world, 2: 4 * n + (4 + 8) * n / world, 3: 16 * n / world}
        for stage, measured in out["measured"].items():
            assert abs(measured / formula[stage] - 1) < 0.10, (stage, measured, formula[stage])
        for stage, diff in out["bf16"].items():
            assert out["moved"] > 1e-2 and diff < 1e-6, (stage, diff, out["moved"])
        assert "must be 1, 2 or 3" in errors["stage"]
        assert "cannot shard 'LBFGS'" in errors["optimizer"]
        assert "nothing to train: every parameter of the module is frozen" in errors["frozen"]
        assert "changed in place outside ZeRO" in errors["changed"]
        assert "replaced by a new parameter outside ZeRO" in errors["replaced"]
        for stage in (2, 3):
            assert "step() before any backward()" in errors[f"step first {stage}"]
        for stage, (full_grads, shard_grads) in out["lifetimes"].items():
            assert all(g is None for g in full_grads + shard_grads), (stage, full_grads, shard_grads)


# -- frozen parameters (LoRA), tied parameters (GPT-2), our AdamW ------------------------------------


def _gpt2(lora: bool) -> CausalLM:
    """A tiny GPT-2 whose output head is the embedding matrix; with LoRA on q and v, all else frozen."""
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.gpt2(vocab_size=37, d_model=16, n_layers=2, n_heads=2, max_seq_len=16))
    if lora:
        apply_lora(model, ["q_proj", "v_proj"], r=4)
    return model


def _frozen_and_tied_worker():
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(37, (world * 2 * ACCUM, 9), generator=g) for _ in range(STEPS)]
    batches = [(t, t) for t in tokens]  # (inputs, targets): lm_loss(logits, ids) shifts the targets itself
    out, kw = {"world": world, "diff": {}, "moved": {}, "state": {}}, dict(lr=LR, max_grad_norm=CLIP)

    def check(name, base, make, optimizer_class=torch.optim.AdamW):
        oracle = _oracle(copy.deepcopy(base), batches, loss=lm_loss, optimizer_class=optimizer_class)
        out["moved"][name] = _max_diff(oracle[-1][0], dict(base.named_parameters()))
        zero = make(copy.deepcopy(base))
        out["diff"][name] = max(_train(zero, batches, oracle, lm_loss)[0])
        moments = sum(v.numel() for s in zero.optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg"))
        trainable = sum(p.numel() for p in base.parameters() if p.requires_grad)  # a tied matrix once
        out["state"][name] = (moments, trainable, sum(u.numel for u in zero.units), len(zero.units))

    lora, tied = _gpt2(lora=True), _gpt2(lora=False)
    for stage in (1, 2, 3):
        check(f"lora stage {stage}", lora, lambda m: ZeRO(m, stage, **kw))
        check(f"tied stage {stage}", tied, lambda m: ZeRO(m, stage, **kw))
        check(f"our AdamW stage {stage}", tied, lambda m: ZeRO(m, stage, AdamW, **kw), AdamW)
    # the two uses in different units (the embedding in the transformer's, the head in the root's): the root takes it
    check("tied across units stage 3", tied, lambda m: ZeRO(m, 3, units=[*m.transformer.blocks, m.transformer], **kw))

    # frozen weights end up the same on every rank (broadcast from rank 0) and in the compute dtype
    model = _gpt2(lora=True)
    model.transformer.tok_embed.weight.data.add_(rank)  # rank 1's copy differs before wrapping
    zero = ZeRO(model, 3, compute_dtype=torch.bfloat16, lr=LR)
    lm_loss(zero(tokens[0]).float(), tokens[0]).backward()  # bf16 views beside bf16 frozen weights
    out["frozen"] = (zero.full_state_dict()["transformer.tok_embed.weight"].sum().item(), zero.frozen[0].dtype)
    return out


def test_frozen_and_tied_parameters_and_our_adamw_match_one_process():
    results = launch(_frozen_and_tied_worker, 2, echo=False, timeout=180)
    for rank, out in enumerate(results):
        for name, diff in out["diff"].items():
            assert out["moved"][name] > 1e-2, (name, out["moved"][name])
            assert diff < (1e-6 if name.startswith("lora") else 5e-5), f"rank {rank}, {name}: max |diff| {diff}"
            # only trainable parameters have shards (m and v, S each); padding adds fewer than N per unit
            moments, trainable, stored, units = out["state"][name]
            assert 0 <= moments / 2 - trainable / out["world"] < units, (name, out["state"][name])
            assert stored == trainable, (name, stored, trainable)  # a tied matrix is stored once
        assert out["state"]["lora stage 1"][0] < out["state"]["tied stage 1"][0] / 10
        assert out["frozen"] == (results[0]["frozen"][0], torch.bfloat16)
