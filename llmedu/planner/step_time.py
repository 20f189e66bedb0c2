"""The step time of one parallel layout, on paper: the planner's time model.

``memory`` defines a ``Layout`` (``world = dp * tp * pp * cp`` ranks, ZeRO stage, recomputation,
micro-batch, offload) and what each rank holds; this module prices one optimizer step of it on a
``Cluster``: the pipeline's (m + (pp-1)/v) micro-batch slots (GPipe's bubble, lesson 13) of compute +
the communication on the critical path, then what of the data-parallel sync compute does not hide,
then the optimizer step:

    compute    (6N + 12 L s d) FLOPs per token (``counting.flops_per_token``; 8N with full recompute)
               at ``cluster.flops`` (peak x an efficiency, stated with its source), plus the cluster's
               fixed cost of launching a layer's and a stage's ops (0 on GPUs; measured on a CPU)
    TP         4 all-reduces per layer and micro-batch (2 forward, 2 backward) of b (s/cp) h 16-bit
               values; SP swaps each for an all-gather + reduce-scatter of the same bytes (lesson 12);
               and the vocabulary-parallel ends our wrapper (and Megatron-LM) adds: the embedding's
               all-reduce of b (s/cp) h values (forward, first stage), the head's (backward, last
               stage) and the loss's three of b (s/cp) fp32 numbers (last stage) (``messages.tp_collectives``)
    CP         K and V of the other cp - 1 chunks pass around the ring (forward; twice that in
               backward), overlapped with attention: only what exceeds attention's time shows
    EP         4 all-to-alls per MoE layer (dispatch and combine, forward and backward) of the top_k
               copies of b (s/cp) h values (lesson 21)
    PP         one send forward and one backward per micro-batch, of b (s/cp) h values
    DP         ``messages.dp_collectives`` (counted from our wrappers), in pieces: DDP's 25 MiB buckets, ZeRO's
               units (a layer; the embedding and head together). Each hides only behind compute that runs
               while it can run, and each stretch of compute hides communication once (``dp_time``):
                 DDP       the bucket all-reduces, in the last micro-batch's backward
                 ZeRO-1    a reduce-scatter a unit in the last micro-batch's backward; ZeRO-2: in every
                           micro-batch's backward, each behind its own (DeepSpeed's stage 2, our ``zero.py``)
                 ZeRO-1/2  the all-gather of the updated weights after the optimizer step: exposed, since
                           nothing of the step is left to compute (only the next step's forward could hide
                           it, as Megatron-LM's --overlap-param-gather does: left out)
                 ZeRO-3    in every micro-batch, the gather of each unit behind the forward; the regather
                           for backward and the reduce-scatter of its gradient, together, behind the backward
                 ZeRO      the gradient norm's all-reduce (clipping), after backward: exposed
               forward is 1/3 of a micro-batch's compute and backward 2/3 (full recomputation reruns the
               forward inside backward: 1/4 and 3/4). A piece hides behind the other pieces' compute, not
               its own (the first unit is gathered before any compute, the last bucket or unit reduced after
               all of it): k pieces of c seconds in all behind w seconds of compute expose
               max(c/k, c - w (k-1)/k)                                                     (lessons 11, 15)
    optimizer  32 bytes read and written per parameter of the shard, at HBM bandwidth; offloaded:
               16-bit gradients down and weights up over PCIe, and ~28 bytes per parameter through
               host memory for the CPU's Adam (ZeRO-Offload, Ren et al. 2021), not overlapped

Every collective is costed by ``clusters`` on the slowest link its group crosses. Where ranks share
one CPU (this machine: ``cluster.sharing``, measured by ``shared_cores``, else ideal turns on
``cluster.cores``), the step is the longer of that critical path and each rank's CPU work at the speed
it keeps while all compute, plus its communication ("shared cores" in the breakdown); each hop of a
blocking message also pays the measured wait ("waits"; 0 on GPUs).

Which applies where: the GPU presets and our wrappers differ in two ways.

* Overlap. ``cluster.overlap`` (the GPU presets) prices production overlap: DDP's bucket all-reduces
  during backward (our ``data_parallel.DDP`` does it too), ZeRO's reduce-scatters during backward
  (DeepSpeed's ``overlap_comm``, Megatron-LM's ``--overlap-grad-reduce``) and ZeRO-3's gathers ahead of
  use (FSDP's prefetch). Our ``zero.ZeRO`` overlaps none of them: it reduce-scatters one unit at a time,
  synchronously (ZeRO-1's in ``step()``) and gathers ZeRO-3's units when used (one ahead with
  ``prefetch``). ``overlap=False`` (the local cluster) charges every collective in full, which is ours.
* Bytes. Collectives move values of the cluster's precision: 2 bytes on the bf16 presets (gradients held
  and reduced in 16 bits, as the memory model's 2 + 2 + 12 bytes assume; FSDP without a ``reduce_dtype``
  does so), 4 on the local cluster (fp32). Our ``zero.ZeRO`` reduce-scatters gradients in fp32 whatever
  the compute dtype (its all-gathers move compute-dtype weights), as Megatron-LM does in bf16
  (``--accumulate-allreduce-grads-in-fp32``, its bf16 default) and Llama 3 (§3.3.2): in bf16 those send
  twice the reduce-scatter and all-reduce bytes priced here. In fp32 both are 4 bytes and agree.

Offload is priced with any ZeRO stage (DeepSpeed offloads with 1-3); ours (``offload.ZeROOffload``) is
ZeRO-2's. Left out: overlap of TP communication with compute, and of one micro-batch's last reduce-scatter
with the next one's forward, zero-bubble schedules, kernel launch overheads, stragglers, the causal mask
halving attention FLOPs.
"""

from __future__ import annotations

from ..models.config import TransformerConfig
from ..models.counting import flops_per_token
from .clusters import Cluster, all_reduce_time, collective_time
from .memory import BF16, Batch, Layout, held_parameters, stage_layers
from .messages import blocking_hops, dp_collectives, dp_pieces, tp_collectives

__all__ = [
    "active_matmul_parameters",
    "dp_time",
    "step_time",
]


def active_matmul_parameters(cfg: TransformerConfig) -> int:
    """The N of 6N for one token: each layer's weight matrices (the router and top_k experts of an MoE),
    and the output head; no biases, norms or embedding lookups (``counting.matmul_parameters``)."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    ffn = (3 if cfg.activation in ("swiglu", "geglu") else 2) * d * cfg.d_ff
    if cfg.moe is not None:
        ffn = cfg.moe.top_k * ffn + d * cfg.moe.n_experts
    return cfg.n_layers * (d * (d + 2 * kv) + d * d + ffn) + cfg.vocab_size * d


def dp_time(cfg: TransformerConfig, layout: Layout, batch: Batch, cluster: Cluster, compute: float) -> float:
    """Seconds of one step's data-parallel sync that compute does not hide (the module docstring's DP), on the
    busiest stage whose micro-batch computes for ``compute`` seconds; nothing hides without ``cluster.overlap``."""
    v = BF16 if cluster.precision == "bf16" else 4
    moves = dp_collectives(cfg, layout, batch, v)
    if not moves:
        return 0.0
    shards, pieces = layout.dp * layout.cp, dp_pieces(cfg, layout, v)
    link = cluster.link(shards, stride=layout.tp)

    def one(kind: str) -> float:  # seconds of one collective of ``kind``
        op, _, size = moves[kind]
        if op == "all_reduce":  # ring or tree, as NCCL picks
            return all_reduce_time(size, shards, link)[0]
        return collective_time(op, size, shards, link)

    forward_share = 1 / 4 if layout.recompute == "full" else 1 / 3  # 2N of 8N, or 2N of 6N
    hide = compute if cluster.overlap else 0.0
    forward, backward = forward_share * hide, (1 - forward_share) * hide

    def exposed(seconds: float, behind: float) -> float:  # k pieces, each hidden behind the others' compute
        return max(seconds / pieces, seconds - behind * (pieces - 1) / pieces)

    if not layout.zero:
        return exposed(pieces * one("all-reduce"), backward)
    m = batch.sequences // (layout.dp * layout.micro_batch)
    scatter, gather, norm = pieces * one("reduce-scatter"), pieces * one("all-gather"), one("gradient norm")
    if layout.zero == 1:
        return exposed(scatter, backward) + norm + gather
    if layout.zero == 2:
        return m * exposed(scatter, backward) + norm + gather
    return m * (exposed(gather, forward) + exposed(gather + scatter, backward)) + norm


def step_time(cfg: TransformerConfig, layout: Layout, batch: Batch, cluster: Cluster) -> dict[str, float]:
    """Seconds of one optimizer step by part; ``total`` is their sum (see the module docstring)."""
    b = layout.micro_batch
    v = BF16 if cluster.precision == "bf16" else 4  # bytes per value on the wire
    m = batch.sequences // (layout.dp * b)  # micro-batches per pipeline per step
    layers = stage_layers(cfg, layout)  # the busiest stage sets the pipeline's pace

    # one micro-batch on the busiest stage: its share of the (6N + 12LTd) FLOPs per token ...
    per_token = flops_per_token(cfg, active_matmul_parameters(cfg), batch.seq_len)
    recompute = {"none": 1.0, "selective": 1.0, "full": 4 / 3}[layout.recompute]  # 8N instead of 6N
    compute = (
        per_token * recompute * b * batch.seq_len / (layout.tp * layout.cp) * layers / cfg.n_layers / cluster.flops
    )
    compute += recompute * (layers * cluster.layer_overhead + cluster.micro_batch_overhead)  # launches: 0 on GPUs
    # ... and the messages it waits for: TP's all-reduces, CP's K/V ring, EP's all-to-alls, the pipeline's sends
    tp_link = cluster.link(layout.tp)
    tp = sum(
        n * all_reduce_time(size, layout.tp, tp_link)[0] for n, size in tp_collectives(cfg, layout, batch, v).values()
    )
    cp, ep, p2p = _context_parallel(cfg, layout, batch, cluster, compute), *_sends(cfg, layout, batch, cluster)
    slot = compute + tp + cp + ep + p2p
    pipeline = (m + (layout.pp - 1) / layout.virtual) * slot  # 1F1B: m slots and (pp - 1) / v of bubble

    dp = dp_time(cfg, layout, batch, cluster, compute)  # what backward does not hide of the gradient sync
    optimizer = _optimizer_step(cfg, layout, cluster)
    parts = {"compute": m * compute, "bubble": (layout.pp - 1) / layout.virtual * slot}
    parts.update(tp=m * tp, cp=m * cp, ep=m * ep, pp=m * p2p, dp=dp, optimizer=optimizer)
    # where ranks share one CPU (0 on GPUs): the waits for the scheduler, and the CPU work that outlasts the path
    comm = tp + cp + ep + p2p
    waits, shared = _shared_cpu(
        cfg, layout, batch, cluster, m * compute + optimizer, m, comm, dp, pipeline + dp + optimizer
    )
    parts["waits"], parts["shared cores"] = waits, shared
    parts["total"] = pipeline + dp + optimizer + waits + shared
    return parts


def _context_parallel(cfg: TransformerConfig, layout: Layout, batch: Batch, cluster: Cluster, compute: float) -> float:
    """CP: K and V of the other cp - 1 chunks around the ring (3 passes: forward, twice in backward), per micro-batch,
    beyond what the attention's share of ``compute`` hides."""
    if layout.cp == 1:
        return 0.0
    v = BF16 if cluster.precision == "bf16" else 4
    s, b, h = batch.seq_len / layout.cp, layout.micro_batch, cfg.d_model
    hide = 1.0 if cluster.overlap else 0.0  # can communication run while the rank computes?
    attention_share = (
        12 * cfg.n_layers * batch.seq_len * h / flops_per_token(cfg, active_matmul_parameters(cfg), batch.seq_len)
    )
    kv_bytes = 2 * v * b * s * cfg.n_kv_heads * cfg.head_dim / layout.tp
    ring = (
        3
        * (layout.cp - 1)
        * collective_time("send", kv_bytes, 2, cluster.link(layout.cp, stride=layout.tp, rings=False))
    )
    return max(0.0, stage_layers(cfg, layout) * ring - hide * attention_share * compute)


def _sends(cfg: TransformerConfig, layout: Layout, batch: Batch, cluster: Cluster) -> tuple[float, float]:
    """Per micro-batch: EP's 4 all-to-alls a layer of top_k copies of b s h values, and the pipeline's sends of
    b s h / tp values, one each way per model chunk: with v chunks a micro-batch crosses v times as many stage
    boundaries (Narayanan et al. 2021 §2.2.2: "the amount of communication also increases by v")."""
    v = BF16 if cluster.precision == "bf16" else 4
    s, b, h = batch.seq_len / layout.cp, layout.micro_batch, cfg.d_model
    activation_bytes = v * b * s * h
    ep = 0.0
    if cfg.moe is not None and layout.ep > 1:
        ep_link = cluster.link(layout.ep, stride=layout.tp * layout.cp, rings=False)
        ep = (
            stage_layers(cfg, layout)
            * 4
            * collective_time("all_to_all", activation_bytes * cfg.moe.top_k / layout.tp, layout.ep, ep_link)
        )
    stride = layout.tp * layout.cp * (layout.dp if cluster.gpus_per_node > layout.tp * layout.cp else 1)
    pp_link = cluster.intra if layout.pp == 1 else cluster.link(layout.pp, stride=stride, rings=False)
    sends = 2 * layout.virtual  # one each way per chunk
    p2p = sends * collective_time("send", activation_bytes / layout.tp, 2, pp_link) if layout.pp > 1 else 0.0
    return ep, p2p


def _optimizer_step(cfg: TransformerConfig, layout: Layout, cluster: Cluster) -> float:
    """Adam on the rank's shard: 32 bytes a parameter through HBM, or, offloaded, the PCIe copies and the host's
    ~28 bytes a parameter at its share of the host's memory bandwidth."""
    v = BF16 if cluster.precision == "bf16" else 4
    shard = held_parameters(cfg, layout) / (layout.dp * layout.cp if layout.zero >= 1 else 1)
    if layout.offload:
        pcie = 2 * collective_time("send", v * shard, 2, cluster.host)
        return pcie + 28 * shard / (cluster.host_bandwidth / cluster.gpus_per_node)
    return 32 * shard / cluster.accelerator.memory_bandwidth


def _shared_cpu(
    cfg: TransformerConfig,
    layout: Layout,
    batch: Batch,
    cluster: Cluster,
    work: float,
    m: int,
    comm: float,
    dp: float,
    critical: float,
) -> tuple[float, float]:
    """What ranks that share one CPU add to a step (both 0 on GPUs): each hop of the busiest rank's blocking
    messages waits for a process to be scheduled ("waits"), and each rank's CPU ``work`` (compute and optimizer
    step) at the speed it keeps while all compute, plus its ``m`` micro-batches' messages (``comm`` each) and
    ``dp``, may outlast the ``critical`` path ("shared cores"; a pipeline's idle ranks leave the CPU to the busy
    ones, so its bubble costs less than on GPUs)."""
    if cluster.sharing is not None and layout.world != cluster.world_size:
        raise ValueError(
            f"{layout} has {layout.world} ranks; the cluster's sharing was measured with {cluster.world_size}"
        )
    v = BF16 if cluster.precision == "bf16" else 4
    waits = cluster.message_wait * blocking_hops(cfg, layout, dp_collectives(cfg, layout, batch, v), m)
    speed = cluster.shared_speed(layout.world)
    if speed >= 1:
        return waits, 0.0
    return waits, max(0.0, work / speed + m * comm + dp + waits - (critical + waits))
