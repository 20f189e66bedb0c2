"""What a collective costs on a given link, and the clusters the planner reasons about.

The alpha-beta model (Hockney 1994; for collectives, Thakur, Rabenseifner & Gropp 2005, "Optimization
of Collective Communication Operations in MPICH", and Chan et al. 2007): sending n bytes over one link
takes ``alpha + n / beta``, alpha the latency of a message and beta the bandwidth of the link in one
direction. A ring collective over p ranks is p - 1 (or 2(p - 1)) steps in which every rank sends a
1/p chunk at once, each over its own link, so

    all-gather, reduce-scatter   (p - 1) * (alpha + n / (p * beta))           n: the full buffer
    all-reduce (ring)            2 (p - 1) * (alpha + n / (p * beta))         = reduce-scatter + all-gather
    all-reduce (tree)            2 * ceil(log2 p) * alpha + 2 n / beta        latency-bound small messages
    all-to-all (pairwise)        (p - 1) * (alpha + n / (p * beta))          n: what one rank sends in all
    send/recv                    alpha + n / beta

``bytes_sent`` gives the bytes each rank puts on the wire for each of them: for the ring all-reduce it
is ``2 (p - 1) n / p``, which is what our ``ring_all_reduce`` sends (``collectives.ring_all_reduce_bytes``,
checked in the tests). NCCL picks between ring and tree by message size (``all_reduce_time`` takes the
faster of the two, as its tuner would).

**Bandwidth is per direction.** NVIDIA quotes NVLink as the sum over both directions (A100: 600 GB/s,
H100: 900 GB/s); a ring sends and receives at once, so the figure that bounds it is half: 300 and
450 GB/s. InfiniBand is quoted per direction per port (HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s),
one port per GPU in a DGX node. A group that spans nodes runs at the speed of its slowest link.

**Across nodes**, each preset's ``inter`` link is one GPU's share of its node's network: a DGX has one
InfiniBand port per GPU; a node with a single 100 Gb/s Ethernet NIC (``ETHERNET``) gives each of its 8
GPUs an eighth, 1.56 GB/s. A ring collective of a group with g members on every node runs as g rings at
once, each crossing the nodes through a different GPU's share, the group's traffic split among them
over NVLink (NCCL builds one ring per NIC and balances the traffic over them through NVLink, when NVLink
can carry the NICs' sum: NVIDIA/nccl#412), so the group crosses at g times the share (``Cluster.link``):
data parallelism over all 16 GPUs of two DGX nodes at 8 x 25 GB/s, while 8 groups of one GPU per node
(TP8 inside each node) get 25 GB/s each. Sends and all-to-alls get the share: each rank sends its own bytes.

**Memory is in GiB.** A GPU's "80 GB" of HBM are 80 GiB (2^30 bytes): DRAM dies come in binary sizes
(nvidia-smi reports 81920 MiB on an A100 80GB, 40960 MiB on an A100 40GB), so the presets hold
``memory_gib`` x 2^30 bytes, not the 80e9 of the spec table (``hardware.specs``). The driver keeps a little
of it (an H100 80GB shows 81559 MiB), and the CUDA context, NCCL's buffers and the allocator's
fragmentation take more: the planner keeps a margin of 10% for all of that (``search.plan``).

Left out: contention between groups that share a link (TP and DP traffic at once), in-network
reduction (SHARP), NCCL's protocol choices (LL/LL128/Simple) and its pipelining of a ring's chunks,
topology beyond "inside a node or not".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..hardware.specs import ACCELERATORS, Accelerator
from .sharing import Sharing

__all__ = [
    "Link",
    "Cluster",
    "CLUSTERS",
    "cluster",
    "bytes_sent",
    "collective_time",
    "ETHERNET",
    "all_reduce_time",
]

GB = 1e9
GiB = 2**30
US = 1e-6
PRECISIONS = ("bf16", "fp32")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")


@dataclass(frozen=True)
class Link:
    """One link: bandwidth in one direction (bytes/s) and the latency of one message (s)."""

    name: str
    bandwidth: float
    latency: float
    source: str

    def __post_init__(self):
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(f"link {self.name!r}: bandwidth must be > 0 and latency >= 0")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``gpus_per_node`` accelerators; ``intra`` links inside a node, ``inter`` between.

    ``efficiency`` is the fraction of the accelerator's 16-bit peak that a transformer's large matmuls
    sustain (its own provenance in ``efficiency_source``); ``host`` is the link to host memory that
    ZeRO-Offload uses, ``host_bandwidth`` the host memory's bandwidth that a CPU optimizer step streams through.
    ``precision`` is how training runs there: "bf16" mixed precision (16-bit weights, activations and
    gradients, fp32 master weights and Adam moments) or "fp32" throughout; ``overlap`` says whether
    communication can hide behind compute (a GPU's copy engines and NCCL's own SMs: yes; ranks that
    share every CPU core: no). ``layer_overhead`` and ``micro_batch_overhead`` are seconds a rank spends
    per layer, and per stage, in every micro-batch's forward and backward beyond its FLOPs (launching
    ops from Python); 0 for the GPU presets, where launches queue ahead of the kernels. ``cores``: the
    CPU cores that all ranks share, counted in threads (0: every rank has its own accelerator); with
    more rank threads than cores, ranks take turns (``step_time.step_time``). ``sharing``: what ranks that
    share one CPU cost each other (``sharing.Sharing``, measured by ``shared_cores``: the speed a rank
    keeps when all compute, the wait of each blocking message); None: ideal turns on ``cores``, no wait.
    """

    name: str
    accelerator: Accelerator
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link
    efficiency: float
    efficiency_source: str
    host: Link
    host_bandwidth: float
    notes: str = field(default="")
    precision: str = "bf16"
    overlap: bool = True
    layer_overhead: float = 0.0
    micro_batch_overhead: float = 0.0
    cores: int = 0
    threads: int = 1
    sharing: Sharing | None = None

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"cluster {self.name!r}: precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(f"cluster {self.name!r}: gpus_per_node and nodes must be >= 1")
        if not isinstance(self.cores, int) or self.cores < 0 or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"cluster {self.name!r}: cores must be an int >= 0 and threads an int >= 1")
        if self.layer_overhead < 0 or self.micro_batch_overhead < 0:
            raise ValueError(f"cluster {self.name!r}: overheads must be >= 0 seconds")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"cluster {self.name!r}: efficiency must be in (0, 1], got {self.efficiency}")
        if self.sharing is not None and self.sharing.world != self.world_size:
            raise ValueError(
                f"cluster {self.name!r}: sharing was measured with {self.sharing.world} ranks, the cluster has {self.world_size}"
            )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def flops(self) -> float:
        """Sustained matmul FLOP/s of one accelerator in the cluster's precision: peak x efficiency."""
        return self.accelerator.peak_flops_16bit * self.efficiency

    def shared_speed(self, ranks: int) -> float:
        """Fraction of its own speed a rank keeps while ``ranks`` ranks compute at once: 1 with an accelerator
        each; measured where ranks share a CPU (``sharing``), else ideal turns, min(1, cores / their threads)."""
        if self.sharing is not None:
            return self.sharing.speed
        return min(1.0, self.cores / (ranks * self.threads)) if self.cores else 1.0

    @property
    def message_wait(self) -> float:
        """Seconds each blocking message costs beyond its alpha-beta: 0 unless measured (``sharing``)."""
        return self.sharing.wait if self.sharing is not None else 0.0

    def link(self, group_size: int, stride: int = 1, *, rings: bool = True) -> Link:
        """The slowest link a group of ``group_size`` ranks, ``stride`` apart in rank order, crosses.

        Ranks fill nodes in order, so a group stays inside one node only if its span divides the node
        (TP6 on 8-GPU nodes has groups that straddle two). Across nodes, ``inter`` is one GPU's share of its
        node's network; a ring collective (``rings``) of a group with g members on every node runs g rings at
        once, one through each member's share, so it crosses at g times the share (at most the intra-node
        link's speed): the module docstring's "Across nodes". Sends and all-to-alls (``rings=False``): each
        rank sends its own bytes through its own share.
        """
        span = group_size * stride
        if span <= self.gpus_per_node and self.gpus_per_node % span == 0:
            return self.intra
        per_node = self.gpus_per_node // stride if self.gpus_per_node % stride == 0 else 1
        if not rings or per_node <= 1 or group_size % per_node:  # unaligned groups: the share alone, conservative
            return self.inter
        return Link(
            f"{self.inter.name} x {per_node} rings",
            min(self.intra.bandwidth, per_node * self.inter.bandwidth),
            self.inter.latency,
            f"{self.inter.source}; {per_node} GPUs of the group on each node: {per_node} rings at once, one through "
            "each GPU's share (NCCL builds a ring per NIC and splits the traffic over them through NVLink)",
        )


def _spec(name: str) -> Accelerator:
    return next(a for a in ACCELERATORS if a.name == name)


NVLINK3 = Link("NVLink 3 (A100)", 300 * GB, 5 * US, "A100 datasheet: 600 GB/s both directions; half per direction")
NVLINK4 = Link("NVLink 4 (H100)", 450 * GB, 5 * US, "H100 datasheet: 900 GB/s both directions; half per direction")
HDR = Link("InfiniBand HDR", 25 * GB, 10 * US, "200 Gb/s per port, one port per GPU (DGX A100 user guide)")
NDR = Link("InfiniBand NDR", 50 * GB, 10 * US, "400 Gb/s per port, one port per GPU (DGX H100 user guide)")
ETHERNET = Link(
    "100 Gb Ethernet / 8", 12.5 * GB / 8, 30 * US, "one 100 Gb/s NIC per 8-GPU node: an eighth per GPU, a slow cluster"
)
PCIE4 = Link("PCIe 4.0 x16", 25 * GB, 5 * US, "PCIe 4.0 x16: 32 GB/s raw, ~25 GB/s achieved per direction")
PCIE5 = Link("PCIe 5.0 x16", 50 * GB, 5 * US, "PCIe 5.0 x16: 64 GB/s raw, ~50 GB/s achieved per direction")
_LATENCY_NOTE = "latencies are assumed orders of magnitude of NCCL's small-message times, not measurements"
_EFFICIENCY = (
    0.6,
    "assumed: large bf16 GEMMs sustain ~60% of peak; Narayanan et al. 2021 (Table 1) report 43-52% of peak end to end",
)


def _node(name: str, gpu: str, gpus: int, intra: Link, inter: Link, host: Link, memory_gib: int) -> Cluster:
    """A one-node preset of ``gpus`` x ``gpu`` whose HBM holds ``memory_gib`` GiB (the module docstring)."""
    accelerator = replace(_spec(gpu), memory_bytes=memory_gib * GiB)
    # 200 GB/s: the host memory bandwidth of a two-socket server (assumed), what a CPU Adam streams through
    return Cluster(name, accelerator, gpus, 1, intra, inter, *_EFFICIENCY, host, 200 * GB, _LATENCY_NOTE)


CLUSTERS: dict[str, Cluster] = {
    "a100": _node("a100", "A100 SXM 80GB", 1, NVLINK3, HDR, PCIE4, 80),  # one GPU in a server
    "dgx-a100": _node("dgx-a100", "A100 SXM 80GB", 8, NVLINK3, HDR, PCIE4, 80),
    "dgx-h100": _node("dgx-h100", "H100 SXM", 8, NVLINK4, NDR, PCIE5, 80),
}


def cluster(name: str, nodes: int | None = None, *, inter: Link | None = None) -> Cluster:
    """A preset (``CLUSTERS``), optionally with ``nodes`` nodes and another inter-node link (e.g. ``ETHERNET``)."""
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster {name!r}; presets: {', '.join(CLUSTERS)}")
    base = CLUSTERS[name]
    changes = {}
    if nodes is not None:
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be a positive int, got {nodes!r}")
        changes["nodes"] = nodes
        changes["name"] = f"{nodes}x {name}"
    if inter is not None:
        changes["inter"] = inter
        changes["name"] = f"{changes.get('name', name)}, {inter.name}"
    return replace(base, **changes)


def _check(kind: str, nbytes: float, p: int) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; one of {COLLECTIVES}")
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"group size must be a positive int, got {p!r}")
    if nbytes < 0:
        raise ValueError(f"bytes must be >= 0, got {nbytes}")


def bytes_sent(kind: str, nbytes: float, p: int) -> float:
    """Bytes one rank sends in a ring ``kind`` over ``p`` ranks on a buffer of ``nbytes`` (see the table above)."""
    _check(kind, nbytes, p)
    if kind == "send":
        return float(nbytes)
    steps = 2 * (p - 1) if kind == "all_reduce" else p - 1
    return steps * nbytes / p


def collective_time(kind: str, nbytes: float, p: int, link: Link) -> float:
    """Seconds for a ring ``kind`` (or one ``send``) of ``nbytes`` over ``p`` ranks on ``link``: alpha-beta."""
    _check(kind, nbytes, p)
    if p == 1 and kind != "send":
        return 0.0
    steps = 1 if kind == "send" else 2 * (p - 1) if kind == "all_reduce" else p - 1
    return steps * link.latency + bytes_sent(kind, nbytes, p) / link.bandwidth


def all_reduce_time(nbytes: float, p: int, link: Link) -> tuple[float, str]:
    """The faster of a ring and a (double binary) tree all-reduce, and which one it was."""
    ring = collective_time("all_reduce", nbytes, p, link)
    if p == 1:
        return ring, "ring"
    tree = 2 * math.ceil(math.log2(p)) * link.latency + 2 * nbytes / link.bandwidth
    return (tree, "tree") if tree < ring else (ring, "ring")
