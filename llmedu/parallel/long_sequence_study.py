"""The checks and measurements of the long-sequence lesson (20): sequence parallelism and ring attention
against one process and torch, ring attention's steps timed with the K/V transfer hidden or not on a link
of known speed, and the bytes sequence parallelism moves.

The algorithms live in ``sequence_parallel*.py`` and ``context_parallel.py``; this file checks, times, counts.

Checks (inside ``launch``). ``sp_check``: a pre-LN ``SerialBlock`` on the whole sequence (the oracle), our
``SequenceParallelBlock`` on this rank's tokens, and torch's ``parallelize_module`` plan with the same weights
(``SequenceParallel`` norms, ``PrepareModuleInput`` all-gathers, ``ColwiseParallel`` and ``RowwiseParallel``
with ``Shard(1)`` outputs); the largest differences of outputs and gradients. ``ring_check``: zig-zag ring
attention against SDPA on the whole sequence, output and dQ, dK, dV; ``fused_ring_check``: the forward with one
fused kernel per tile (``fused_ring.py``), the one the overlap study times.

Overlap. Each ring step computes this rank's queries against the visiting K/V block and passes the block
on. Posted before the compute (``overlap=True``) the transfer runs beside it; posted after, it adds to it.
With ``c`` the compute of the slowest rank (every rank waits for its neighbour's block) and ``C`` the
transfer of one K/V message, a step takes (``step_model``)

    blocking      c + C
    overlapped    max(c, C)             so the overlap saves min(c, C); the last step sends nothing: c.

A ``Link`` (``link.py``) gives every message the alpha-beta time alpha + bytes / beta (its sleep uses no
CPU, as a network card's transfer would not), so C is known; c is measured, step by step, on every rank, each
tile one fused kernel (``fused_ring_forward``), and the bandwidths are chosen from a first measure of c so that
C / c takes the ratios asked for. What the model leaves out is read off the link's records: how long gloo took
to deliver each message (a receive's modelled transfer starts only then) and how late each handle completed
after its modelled end (the helper thread's wake-up).
``overlap_study`` runs the forward in both orders, alternating repeat by repeat, so that each blocking
forward has an overlapped one run beside it under the same load; ``summarise_steps`` reads each step on
the slowest rank: quartiles of the two times, the model at the compute each repeat measured, the paired
saving against the model's, and the verdicts (saving resolved; model inside the quartiles).

Volumes. ``collective_volumes`` counts (``collectives.traffic``) the bytes one rank sends in the course's
ring all-reduce of an activation and in a reduce-scatter followed by an all-gather of the same tensor:
tensor parallelism's collective against sequence parallelism's two.

Left out: the backward (the same ring twice, the dK/dV transfer not overlapped here), and GPU streams.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..nn.blocks import SerialBlock
from .collectives import all_gather, reduce_scatter, ring_all_reduce, traffic
from .context_parallel import ring_attention, ring_step_times
from .fused_ring import fused_ring_forward
from .link import Link
from .sequence_layout import split_sequence
from .sequence_parallel import all_reduce_sequence_parallel_grads, sequence_shard
from .sequence_parallel_attention import SequenceParallelBlock
from .tensor_parallel import shard

__all__ = ["sp_check", "ring_check", "fused_ring_check", "step_model", "overlap_study", "summarise_steps"]
__all__ += ["collective_volumes", "link_delays"]


def _torch_sequence_parallel(block: SerialBlock, n: int) -> SerialBlock:
    """A copy of ``block`` under torch's DTensor plan for Megatron-SP, on a gloo mesh of ``n`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    peer = copy.deepcopy(block)  # the same weights
    peer.attn.n_heads //= n  # ColwiseParallel's local output holds H / N heads
    peer.attn.n_kv_heads //= n
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))  # the all-gather
    plan = {"attn_norm": SequenceParallel(), "attn": gather, "attn.o_proj": RowwiseParallel(output_layouts=Shard(1))}
    plan |= {f"attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan |= {"mlp_norm": SequenceParallel(), "mlp": gather, "mlp.up_proj": ColwiseParallel()}
    plan["mlp.down_proj"] = RowwiseParallel(output_layouts=Shard(1))  # the reduce-scatter
    return parallelize_module(peer, init_device_mesh("cpu", (n,)), plan)


def sp_check(causal: bool) -> dict[str, float]:
    """Inside ``launch``: the largest differences of our SP block from one process and from torch's SP, fp32."""
    torch.set_num_threads(1)
    n, B, T, D, H = dist.get_world_size(), 2, 16, 32, 4
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    w = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2))  # a loss weighing every output
    torch.manual_seed(0)
    block = SerialBlock(D, H, 4 * D)
    xf = x.clone().requires_grad_()
    full = block(xf, causal=causal)
    (full * w).sum().backward()
    ours = SequenceParallelBlock(block)
    xs = sequence_shard(x).requires_grad_()  # (B, T/N, d)
    out = ours(xs, causal=causal)
    (out * sequence_shard(w)).sum().backward()
    all_reduce_sequence_parallel_grads(ours)  # the norms' and row biases' partial gradients
    peer = _torch_sequence_parallel(block, n)
    theirs = peer(sequence_shard(x).requires_grad_(), causal=causal)
    (theirs * sequence_shard(w)).sum().backward()
    rename = {"attn.norm.": "attn_norm.", "mlp.norm.": "mlp_norm."}
    mine = {}
    for k, p in ours.named_parameters():
        for old, new in rename.items():
            k = k.replace(old, new)
        mine[k] = p
    oracle = {k: p.grad for k, p in block.named_parameters()}
    return {
        "out vs one process": (out - sequence_shard(full.detach())).abs().max().item(),
        "dx vs one process": (xs.grad - sequence_shard(xf.grad)).abs().max().item(),
        f"{len(mine)} param grads vs one process": max(
            (p.grad - (oracle[k] if p.tp_dim is None else shard(oracle[k], p.tp_dim))).abs().max().item()
            for k, p in mine.items()
        ),
        "out vs torch SP": (theirs - out).abs().max().item(),
        f"{len(mine)} param grads vs torch SP": max(
            (p.grad.redistribute(p.device_mesh, p.placements).to_local() - mine[k].grad).abs().max().item()
            for k, p in peer.named_parameters()
        ),
    }


def ring_check(seq_len: int, causal: bool, layout: str = "zigzag", block_size: int | None = None) -> dict[str, float]:
    """Inside ``launch``: the largest differences of ring attention (output, dQ, dK, dV) from SDPA on the whole
    sequence, on this rank's part."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, seq_len, 16, generator=g) for _ in range(4))  # (B, H, T, D)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal)
    ref.backward(grad)
    mine = [split_sequence(t, rank, world, layout).requires_grad_() for t in (q, k, v)]  # (B, H, T/N, D)
    out = ring_attention(*mine, causal=causal, layout=layout, block_size=block_size)
    out.backward(split_sequence(grad, rank, world, layout))
    errors = {"out vs SDPA": (out - split_sequence(ref, rank, world, layout)).abs().max().item()}
    for name, m, f in zip(("dQ", "dK", "dV"), mine, full):
        errors[name] = (m.grad - split_sequence(f.grad, rank, world, layout)).abs().max().item()
    return errors


def fused_ring_check(seq_len: int, causal: bool = True, layout: str = "zigzag") -> dict[str, float]:
    """Inside ``launch``: the largest difference of ``fused_ring_forward`` from SDPA on the whole sequence."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = (torch.randn(1, 2, seq_len, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, H, T, D)
    mine = [split_sequence(t, rank, world, layout) for t in (q, k, v)]
    out = fused_ring_forward(*mine, causal=causal, layout=layout, link=Link(1e-5, 1e10))
    return {"out vs SDPA": (out - split_sequence(ref, rank, world, layout)).abs().max().item()}


def step_model(compute_s: float, comm_s: float, overlap: bool) -> float:
    """Seconds of one ring step: max(compute, transfer) when the transfer was posted first, else their sum."""
    return max(compute_s, comm_s) if overlap else compute_s + comm_s


class _StampedLink(Link):
    """A ``Link`` whose receive handles stamp, in their record, when the rank's ``wait()`` returned ("done")."""

    def post(self, sends, recvs):
        works = super().post(sends, recvs)
        for record, work in zip(self.records[len(self.records) - len(works) :], works):
            if record["op"] == "recv":
                work.wait = _stamping(work.wait, record)
        return works


def _stamping(wait, record: dict):
    def stamped(timeout=None):
        done = wait(timeout)
        record.setdefault("done", time.perf_counter())
        return done

    return stamped


def link_delays(records: list[dict]) -> dict[str, list[float]]:
    """What a ``Link``'s model leaves out, from its receives' records: "delivery", seconds from the receive's post
    to gloo's delivery (the modelled transfer starts only then); "late", seconds after the modelled end that the
    rank's wait returned (the helper thread's and the rank's wake-ups)."""
    recvs = [r for r in records if r["op"] == "recv"]
    return {
        "delivery": [r["gloo_end"] - r["launched"] for r in recvs],
        "late": [r["done"] - r["end"] for r in recvs if "done" in r],
    }


def _forward(q, overlap: bool, link: Link | None) -> list[dict]:
    """One forward of causal zig-zag ring attention, K = V = Q, one fused kernel per tile; its steps' logs."""
    with ring_step_times() as log:
        fused_ring_forward(q, q, q, True, "zigzag", overlap=overlap, link=link)
    return log


def overlap_study(seq_len: int, heads: int, head_dim: int, alpha: float, ratios: list[float], repeats: int) -> dict:
    """Launched on N ranks: ring attention's forward (causal, zig-zag, one fused kernel per tile) over
    ``Link(alpha, beta)``, blocking and overlapped in turn (which goes first alternates), ``repeats`` times
    each after two warm-ups, for each ratio C / c of transfer to compute.

    c is the first step's compute on the slowest rank (median of five forwards without a link, after three); each ratio
    sets beta so that one K/V message takes C = ratio * c. Returns {"compute_s": c, (ratio, overlap): dict(steps,
    beta, comm_s, overruns, delivery, late)}: per repeat a list of (compute_s, step_s) per step; the bandwidth;
    the modelled transfer of one K/V message; the messages gloo delivered after the model's time; ``link_delays``.
    """
    if repeats < 3:
        raise ValueError(f"repeats must be >= 3 to read quartiles of the paired differences, got {repeats}")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.randn(1, heads, seq_len, head_dim, generator=torch.Generator().manual_seed(0))  # (B, H, T, D)
    q = split_sequence(full, rank, world, "zigzag")  # (1, H, T/N, D); K and V are the same tensor
    message = 2 * q.numel() * q.element_size()  # K and V stacked: one message a step
    for _ in range(3):  # warm-up: the kernel's first calls on a shape are slower
        _forward(q, True, None)
    compute = torch.tensor([statistics.median(_forward(q, True, None)[0]["compute_s"] for _ in range(5))])
    dist.all_reduce(compute, op=dist.ReduceOp.MAX)  # the slowest rank's, the same number everywhere
    results = {"compute_s": compute.item()}
    for ratio in ratios:
        comm_s = ratio * compute.item()
        if comm_s <= alpha:
            raise ValueError(f"ratio {ratio} asks for a transfer of {comm_s:.2e} s, not above the latency {alpha}")
        beta = message / (comm_s - alpha)
        links = {o: _StampedLink(alpha, beta) for o in (False, True)}
        for o, link in links.items():
            results[ratio, o] = dict(steps=[], beta=beta, comm_s=link.message_time(message), overruns=0)
            results[ratio, o] |= dict(delivery=[], late=[])
        for i in range(2 + repeats):
            for overlap in (False, True) if i % 2 else (True, False):
                links[overlap].records.clear()
                dist.barrier()
                log = _forward(q, overlap, links[overlap])
                if i >= 2:
                    kept = results[ratio, overlap]
                    kept["steps"].append([(r["compute_s"], r["step_s"]) for r in log])
                    kept["overruns"] += sum(r["overrun"] for r in links[overlap].records)
                    for key, values in link_delays(links[overlap].records).items():
                        kept[key] += values
    return results


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, statistics.median(values), q3


def _inside(x: float, quartiles: tuple[float, float, float]) -> bool:
    return quartiles[0] <= x <= quartiles[2]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise_steps(study: list[dict], ratio: float) -> list[dict]:
    """One row per ring step of ``overlap_study``'s per-rank results at transfer/compute ``ratio``, each repeat read on
    the slowest rank: (q1, median, q3) of the blocking and the overlapped step, the model's median at the
    compute each repeat measured, the paired saving blocking - overlapped (q1, median, q3) beside the model's
    median saving, and the verdicts: ``resolved`` (the saving's q1 > 0), ``consistent`` (the model's saving inside
    its quartiles), ``overlapped_inside`` (the model's overlapped step inside the measured quartiles), with the
    link's ``delivery`` and ``late`` medians (``link_delays``) over both orders."""
    world, delays = len(study), ("delivery", "late")
    rows = []
    for step in range(world):
        comm = study[0][ratio, True]["comm_s"] if step < world - 1 else 0.0
        times, model = {}, {}
        for o in (False, True):
            runs = list(zip(*(r[ratio, o]["steps"] for r in study)))  # per repeat: every rank's steps
            times[o] = [max(ranks[k][step][1] for k in range(world)) for ranks in runs]
            computes = [max(ranks[k][step][0] for k in range(world)) for ranks in runs]
            model[o] = [step_model(c, comm, o) for c in computes]
        saved = _quartiles([b - a for b, a in zip(times[False], times[True])])
        saved_model = statistics.median(b - a for b, a in zip(model[False], model[True]))
        rows.append(
            dict(
                step=step,
                comm_s=comm,
                blocking=_quartiles(times[False]),
                blocking_model=statistics.median(model[False]),
                overlapped=_quartiles(times[True]),
                overlapped_model=statistics.median(model[True]),
                saved=saved,
                saved_model=saved_model,
                resolved=saved[0] > 0,
                consistent=saved[0] <= saved_model <= saved[2],
                overlapped_inside=_inside(statistics.median(model[True]), _quartiles(times[True])),
                overruns=sum(r[ratio, o]["overruns"] for r in study for o in (False, True)),
                repeats=len(times[False]),
                **{
                    k: _median([x for r in study for o in (False, True) for x in r[ratio, o].get(k, [])])
                    for k in delays
                },
            )
        )
    return rows


def collective_volumes(seq_len: int, batch: int, width: int) -> dict[str, int]:
    """Launched on N ranks: bytes this rank sends in the course's ring all-reduce of a (T, B, d) fp32 activation,
    and in a reduce-scatter of it followed by an all-gather of the piece; and the activation's own bytes."""
    x = torch.randn(seq_len, batch, width, generator=torch.Generator().manual_seed(dist.get_rank()))  # (T, B, d)
    counted = {}
    with traffic() as sent:
        ring_all_reduce(x)
    counted["all-reduce"] = sent.bytes_sent
    with traffic() as sent:
        piece = reduce_scatter(x)  # (T/N, B, d): this rank's tokens, summed over the ranks
    counted["reduce-scatter"] = sent.bytes_sent
    with traffic() as sent:
        all_gather(piece)  # (T, B, d) again, on every rank
    counted["all-gather"] = sent.bytes_sent
    counted["activation"] = x.numel() * x.element_size()
    return counted
