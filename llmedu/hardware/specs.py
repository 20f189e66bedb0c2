"""Spec sheets of the accelerators that train large models: NVIDIA GPUs, Google TPUs, a Graphcore IPU.

Every row carries the document its numbers come from. The figures are the vendors' *peak* numbers:
no real kernel reaches them, and lesson 00 measures how far from them this machine's own kernels
land. Conventions:

* ``peak_flops_16bit`` is dense (no 2:4 structured sparsity) 16-bit matrix throughput, in the
  16-bit format the chip multiplies in (``format_16bit``: bf16, or fp16 where the chip has no
  bf16). NVIDIA's H100 datasheet prints the sparse figure; the dense one, half of it, is used.
* ``peak_flops_fp32`` is plain (non-tensor-core, non-TF32) fp32. ``None`` where the cited
  document gives no figure; nothing is filled in from elsewhere.
* ``memory_bytes`` and ``memory_bandwidth`` are the chip's main memory: HBM on GPUs and TPUs, the
  on-chip SRAM (In-Processor-Memory) on the IPU, whose off-chip Streaming Memory is left out.
* ``link_bandwidth`` is the chip's fast chip-to-chip interconnect (NVLink, TPU ICI, IPU-Links),
  both directions together, as the vendors print it; ``link`` says how far that fast domain reaches
  and what joins the domains, with ``link_source``.

What is left out: link latency and topology effects (lessons 10-15 measure collectives), power,
price, fp8/int8 figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Accelerator", "ACCELERATORS", "accelerator", "spec_table", "interconnect_table", "si"]

TERA = 1e12
GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    """One chip: peak compute, memory size and memory bandwidth, and where those numbers come from."""

    name: str
    kind: str  # "GPU", "TPU", "IPU", or "CPU"/"GPU" for a measured machine
    peak_flops_16bit: float | None  # FLOP/s, dense
    format_16bit: str  # "bf16" or "fp16"
    peak_flops_fp32: float | None  # FLOP/s
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    source: str
    notes: str = ""
    link_bandwidth: float | None = None  # bytes/s per chip, both directions together
    link: str = ""
    link_source: str = ""

    @property
    def ridge_point(self) -> float:
        """FLOP per byte needed to reach the 16-bit peak (the roofline's corner)."""
        if self.peak_flops_16bit is None:
            raise ValueError(f"{self.name} has no 16-bit peak in its source")
        return self.peak_flops_16bit / self.memory_bandwidth


ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator(
        "V100 SXM2 32GB",
        "GPU",
        125 * TERA,
        "fp16",
        15.7 * TERA,
        32 * GB,
        900 * GB,
        source="NVIDIA, 'NVIDIA Tesla V100 GPU Accelerator' datasheet (2018), V100 for NVLink column",
        notes="Volta has no bf16: the 16-bit figure is fp16 on tensor cores (fp32 accumulate).",
        link_bandwidth=300 * GB,
        link="NVLink 2 between the 8 GPUs of a DGX-1 node (hybrid cube mesh); InfiniBand between nodes",
        link_source="V100 datasheet (as above); NVIDIA DGX-1 datasheet",
    ),
    Accelerator(
        "A100 SXM 80GB",
        "GPU",
        312 * TERA,
        "bf16",
        19.5 * TERA,
        80 * GB,
        2039 * GB,
        source="NVIDIA, 'NVIDIA A100 Tensor Core GPU' datasheet (2021), A100 80GB SXM column",
        notes="312 TFLOP/s dense bf16/fp16 (the datasheet's 624 is with 2:4 sparsity).",
        link_bandwidth=600 * GB,
        link="NVLink 3 through NVSwitch among the 8 GPUs of an HGX/DGX A100 node; InfiniBand between nodes",
        link_source="A100 datasheet (as above); NVIDIA DGX A100 datasheet",
    ),
    Accelerator(
        "H100 SXM",
        "GPU",
        989 * TERA,
        "bf16",
        67 * TERA,
        80 * GB,
        3350 * GB,
        source="NVIDIA, 'NVIDIA H100 Tensor Core GPU' datasheet (2023), H100 SXM column",
        notes="The datasheet prints 1,979 TFLOP/s bf16 'with sparsity'; dense is half of it.",
        link_bandwidth=900 * GB,
        link="NVLink 4 through NVSwitch among the 8 GPUs of an HGX/DGX H100 node (up to 256 GPUs with the NVLink Switch System); between nodes InfiniBand at 400 Gb/s (50 GB/s) per GPU in a DGX H100",
        link_source="H100 datasheet (as above); NVIDIA DGX H100 datasheet",
    ),
    Accelerator(
        "TPU v4",
        "TPU",
        275 * TERA,
        "bf16",
        None,
        32 * GiB,
        1200 * GB,
        source="Google Cloud, 'TPU v4' system architecture page; Jouppi et al., 'TPU v4: An Optically "
        "Reconfigurable Supercomputer for Machine Learning with Hardware Support for Embeddings', ISCA 2023",
        notes="Per chip (2 TensorCores). No fp32 figure in the cited table. Memory 32 GiB HBM2.",
        link_bandwidth=None,
        link="ICI: a 3D torus of up to 4,096 chips per pod, 64-chip cubes joined by optical circuit switches",
        link_source="Google Cloud 'TPU v4' page; Jouppi et al., ISCA 2023 (the page gives no per-chip ICI figure)",
    ),
    Accelerator(
        "TPU v5e",
        "TPU",
        197 * TERA,
        "bf16",
        None,
        16 * GB,
        819 * GB,
        source="Google Cloud, 'TPU v5e' system architecture page",
        notes="Per chip (1 TensorCore). No fp32 figure in the cited table.",
        link_bandwidth=400 * GB,
        link="ICI: a 2D torus of up to 256 chips per pod; the data-center network between pods",
        link_source="Google Cloud 'TPU v5e' system architecture page",
    ),
    Accelerator(
        "TPU v5p",
        "TPU",
        459 * TERA,
        "bf16",
        None,
        95 * GB,
        2765 * GB,
        source="Google Cloud, 'TPU v5p' system architecture page",
        notes="Per chip (2 TensorCores). No fp32 figure in the cited table. Versions of the page "
        "write the 95 of memory as GB or GiB.",
        link_bandwidth=1200 * GB,
        link="ICI: a 3D torus of up to 8,960 chips per pod; the data-center network (50 Gb/s per chip) between slices",
        link_source="Google Cloud 'TPU v5p' system architecture page",
    ),
    Accelerator(
        "IPU GC200 (Colossus MK2)",
        "IPU",
        250 * TERA,
        "fp16",
        62.5 * TERA,
        900e6,
        47.5 * TERA,
        source="Graphcore, 'Colossus MK2 GC200 IPU' product page and IPU-M2000 launch (July 2020)",
        notes="Memory is 900 MB of on-chip SRAM at 47.5 TB/s; a model that does not fit streams from "
        "off-chip DRAM at a far lower rate (not listed: no datasheet figure pinned down). The 16-bit "
        "figure is fp16 with fp16 accumulation ('FP16.16'); the IPU has no bf16.",
        link_bandwidth=320 * GB,
        link="10 IPU-Links per chip; 4 IPUs per IPU-M2000, whose IPU-Gateway joins machines over IPU-Fabric at 2.8 Tb/s per machine",
        link_source="Graphcore GC200 product page; Graphcore IPU-M2000 datasheet",
    ),
)


def accelerator(name: str) -> Accelerator:
    """Look a row up by name, ignoring case: ``accelerator("h100 sxm")``."""
    for row in ACCELERATORS:
        if row.name.lower() == name.strip().lower():
            return row
    raise KeyError(f"no accelerator named {name!r}; known: {', '.join(r.name for r in ACCELERATORS)}")


def si(value: float | None, unit: str, digits: int = 3) -> str:
    """``si(9.89e14, "FLOP/s") -> '989 TFLOP/s'``: a number with an SI prefix."""
    if value is None:
        return "-"
    if value == 0 or not math.isfinite(value):
        return f"{value:g} {unit}"
    prefixes = ["", "k", "M", "G", "T", "P", "E", "Z", "Y"]
    power = min(max(int(math.floor(math.log10(abs(value)) / 3)), 0), len(prefixes) - 1)
    return f"{value / 1000**power:.{digits}g} {prefixes[power]}{unit}"


def spec_table(rows: tuple[Accelerator, ...] | list[Accelerator] = ACCELERATORS) -> str:
    """The rows as a fixed-width text table (peaks in TFLOP/s, memory in GB, bandwidth in TB/s)."""
    header = (
        f"{'accelerator':<26}{'type':<5}{'16-bit TFLOP/s':>16}{'fp32 TFLOP/s':>14}"
        f"{'memory GB':>11}{'TB/s':>8}{'ridge FLOP/B':>14}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        half = "-" if r.peak_flops_16bit is None else f"{r.peak_flops_16bit / TERA:.4g} {r.format_16bit}"
        fp32 = "-" if r.peak_flops_fp32 is None else f"{r.peak_flops_fp32 / TERA:.4g}"
        ridge = "-" if r.peak_flops_16bit is None else f"{r.ridge_point:.3g}"
        lines.append(
            f"{r.name:<26}{r.kind:<5}{half:>16}{fp32:>14}{r.memory_bytes / GB:>11.3g}"
            f"{r.memory_bandwidth / TERA:>8.3g}{ridge:>14}"
        )
    return "\n".join(lines)


def interconnect_table(rows: tuple[Accelerator, ...] | list[Accelerator] = ACCELERATORS) -> str:
    """Each chip's fast link (GB/s per chip, both directions), how far it reaches, and the source."""
    lines = [f"{'accelerator':<26}{'link GB/s':>10}  reach of the fast link, and beyond", "-" * 100]
    for r in rows:
        bw = "-" if r.link_bandwidth is None else f"{r.link_bandwidth / GB:,.0f}"
        lines.append(f"{r.name:<26}{bw:>10}  {r.link}")
    return "\n".join(lines)
