"""This CPU's theoretical peak FLOP/s, from its datasheet facts, beside the best matmul it measures.

A datasheet peak, the flat roof of Williams, Waterman & Patterson's roofline (CACM 52(4), 2009), is a
product of three numbers:

    peak = cores x clock (cycles/s) x FLOP per cycle per core

and the last one is the vector width times the FMA pipes times 2 (an FMA is a multiply and an add):

* AMD Zen 2, Zen 3 and Zen 4: two 256-bit FMA pipes, 2 x 8 fp32 lanes x 2 = 32 fp32 FLOP/cycle. Zen 4
  runs AVX-512 (flag ``avx512f``) but splits a 512-bit op over two 256-bit halves ("double-pumped"), so
  its fp32 peak is the same 32. Zen 5 (family 26) has 512-bit pipes in desktop and server parts (64) but
  256-bit ones in mobile parts (32), and cpuinfo does not say which: ``PeakUnknown``.
* Intel cores with AVX2 and FMA (Haswell onward): two 256-bit FMA units, 32; the E-cores of hybrid parts
  and of E-core-only parts (Gracemont, Crestmont) have two 128-bit units, 16. Intel AVX-512 with two 512-bit
  FMA units, 64: Sapphire, Emerald and Granite Rapids, Ice Lake Xeon, and on Skylake/Cascade Lake Xeon the
  Platinum and Gold 6xxx parts and Gold 5122; with one unit, 32: Xeon Silver, Bronze and Gold 5xxx, and the
  Ice, Tiger and Rocket Lake client cores (Intel ARK: "# of AVX-512 FMA Units"). Others: ``PeakUnknown``.
* bf16: ``avx512_bf16`` (VDPBF16PS) does two bf16 products per fp32 lane, twice the fp32 rate; Intel's
  AMX tiles (``amx_bf16``) do 1024 bf16 FLOP/cycle/core. fp16: ``avx512_fp16`` at twice the fp32 rate,
  ``amx_fp16`` as AMX bf16.

What it reads: /proc/cpuinfo (vendor, family, model, flags, the cores this process may use, and a clock).
The clock is the nominal base clock: the "@ 2.60GHz" of an Intel model name, else the kernel's
``base_frequency`` (or amd-pstate's ``amd_pstate_nominal_freq``), else, in a VM (flag ``hypervisor``),
cpuinfo's "cpu MHz" (the TSC clock the hypervisor reports, about the base clock). On bare metal "cpu MHz"
is the clock of the moment, not the base: ``PeakUnknown``. Boost clocks run higher, so a measured matmul
can beat this "peak at base clock" (``PeakSpec.implied_clock_hz`` gives the clock a measurement implies);
under all-core AVX-512 load, clocks can run lower.

What it leaves out: boost and AVX frequency offsets, SMT (two hardware threads share one core's pipes, so
it counts physical cores), CPUs it has no table row for (it raises ``PeakUnknown`` naming what it could not
read or match; it never guesses), and GPUs (their peaks are in ``specs.py``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .probe import Measurement, as_dtype, measure_matmul_flops
from .specs import si

__all__ = ["PeakSpec", "PeakUnknown", "MatmulPeak", "datasheet_peak", "best_matmul_peak"]


class PeakUnknown(ValueError):
    """This CPU's datasheet peak cannot be computed; the message names what could not be read or matched."""


@dataclass(frozen=True)
class PeakSpec:
    """A theoretical peak and the three factors it is the product of."""

    dtype: str  # "fp32", "bf16" or "fp16"
    cores: int  # physical cores this process may run on
    clock_hz: float  # the nominal base clock
    clock_source: str  # where the clock was read, e.g. "'cpu MHz' in /proc/cpuinfo"
    flop_per_cycle: int  # per core, in this dtype
    core_kind: str  # e.g. "AMD Zen 4: two 256-bit FMA pipes, 512-bit ops double-pumped"
    cpu: str  # the model name

    @property
    def flops(self) -> float:
        """cores x clock x FLOP/cycle/core, in FLOP/s: the peak at the base clock."""
        return self.cores * self.clock_hz * self.flop_per_cycle

    def implied_clock_hz(self, measured_flops: float) -> float:
        """The clock at which these cores, at full FLOP/cycle, would do ``measured_flops``: a lower bound on
        the clock they ran at (a measurement above the base-clock peak means boost)."""
        return measured_flops / (self.cores * self.flop_per_cycle)

    def __str__(self) -> str:
        return (
            f"{self.cores} cores x {self.clock_hz / 1e9:.2f} GHz x {self.flop_per_cycle} {self.dtype} FLOP/cycle "
            f"= {si(self.flops, 'FLOP/s')} at base clock ({self.core_kind}; clock: {self.clock_source})"
        )


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _processors(cpuinfo: str) -> list[dict[str, str]]:
    """/proc/cpuinfo as one dict per logical CPU."""
    blocks = []
    for block in cpuinfo.strip().split("\n\n"):
        fields = {}
        for line in block.splitlines():
            if ":" in line:
                key, value = line.split(":", 1)
                fields[key.strip()] = value.strip()
        if "processor" in fields:
            blocks.append(fields)
    return blocks


_INTEL_TWO_FMA = {
    143: "Sapphire Rapids",
    207: "Emerald Rapids",
    173: "Granite Rapids",
    174: "Granite Rapids",
    106: "Ice Lake Xeon",
}
_INTEL_ONE_FMA = {
    102: "Cannon Lake",
    125: "Ice Lake",
    126: "Ice Lake",
    140: "Tiger Lake",
    141: "Tiger Lake",
    167: "Rocket Lake",
}
_INTEL_HYBRID = {151, 154, 170, 172, 183, 186, 189, 191, 197, 198}  # Alder, Meteor, Raptor, Lunar, Arrow Lake
_INTEL_E_CORE_ONLY = {175: "Sierra Forest (Crestmont)", 190: "Alder Lake-N (Gracemont)"}


def _skylake_xeon_units(name: str) -> int | None:
    """512-bit FMA units of a Skylake/Cascade Lake Xeon (model 85), from its model name; None if not listed."""
    if re.search(r"Platinum|Gold 6\d{3}|Gold 5122", name):
        return 2
    if re.search(r"Silver|Bronze|Gold 5\d{3}", name):
        return 1
    return None


def _core_kind(vendor: str, family: int, model: int, flags: set[str], name: str = "") -> tuple[str, int]:
    """(description, fp32 FLOP/cycle/core), or PeakUnknown naming what is unknown."""
    if vendor == "AuthenticAMD" and "fma" in flags and "avx2" in flags:
        if family == 23:
            if model < 0x30:
                return "AMD Zen 1: two 128-bit FMA pipes", 16
            return "AMD Zen 2: two 256-bit FMA pipes", 32
        if family == 25:
            if "avx512f" in flags:
                return "AMD Zen 4: two 256-bit FMA pipes, 512-bit ops double-pumped", 32
            return "AMD Zen 3: two 256-bit FMA pipes", 32
        if family == 26:
            raise PeakUnknown(
                f"AMD family 26 (Zen 5), model {model}: desktop and server parts have 512-bit FMA pipes (64 fp32 "
                "FLOP/cycle), mobile parts 256-bit ones (32), and /proc/cpuinfo does not say which this is"
            )
    if vendor == "GenuineIntel" and "fma" in flags and "avx2" in flags:
        if "hybrid_cpu" in flags or model in _INTEL_HYBRID:
            raise PeakUnknown(
                f"Intel model {model} is a hybrid CPU: its P-cores do 32 fp32 FLOP/cycle, its E-cores 16, and "
                "the peak needs how many of the cores this process may use are of each kind"
            )
        if model in _INTEL_E_CORE_ONLY:
            return f"Intel {_INTEL_E_CORE_ONLY[model]} E-cores: two 128-bit FMA units", 16
        if "avx512f" not in flags:
            return "Intel AVX2: two 256-bit FMA units", 32
        units = 2 if model in _INTEL_TWO_FMA else 1 if model in _INTEL_ONE_FMA else None
        if model == 85:
            units = _skylake_xeon_units(name)
        if units is not None:
            return f"Intel AVX-512: {['one', 'two'][units - 1]} 512-bit FMA unit{'s' * (units - 1)}", 32 * units
        raise PeakUnknown(
            f"Intel model {model} ({name!r}) with AVX-512: it has one or two 512-bit FMA units (32 or 64 fp32 "
            "FLOP/cycle), which /proc/cpuinfo does not say and the table does not list; Intel ARK gives "
            "'# of AVX-512 FMA Units' for each part"
        )
    raise PeakUnknown(
        f"no FLOP/cycle table row for vendor {vendor!r}, family {family}, model {model} with flags "
        f"{sorted(flags & {'fma', 'avx2', 'avx512f'})} (of fma, avx2, avx512f): the peak needs the core's "
        "FMA width and pipe count, which /proc/cpuinfo does not say; look them up for this CPU"
    )


def _per_cycle(dtype: str, fp32: int, flags: set[str], kind: str) -> tuple[int, str]:
    if dtype == "fp32":
        return fp32, kind
    matrix = {"bf16": "amx_bf16", "fp16": "amx_fp16"}[dtype]
    vector = {"bf16": "avx512_bf16", "fp16": "avx512_fp16"}[dtype]
    if matrix in flags:
        return 1024, f"{kind}; AMX tiles ({matrix})"
    if vector in flags:
        return 2 * fp32, f"{kind}; {vector}: two {dtype} products per fp32 lane"
    raise PeakUnknown(
        f"this CPU has neither {matrix} nor {vector}, so it has no native {dtype} arithmetic: a {dtype} "
        "matmul converts to fp32 and its peak is not a datasheet figure; ask for dtype=torch.float32"
    )


def _clock(first: dict[str, str], flags: set[str]) -> tuple[float, str]:
    found = re.search(r"@\s*([\d.]+)\s*GHz", first.get("model name", ""))
    if found:
        return float(found.group(1)) * 1e9, "the base clock in the model name"
    for name in ("base_frequency", "amd_pstate_nominal_freq"):  # kHz
        base = _read(f"/sys/devices/system/cpu/cpu0/cpufreq/{name}")
        if base and base.strip().isdigit():
            return int(base) * 1e3, f"the kernel's cpufreq {name}"
    if "cpu MHz" in first and "hypervisor" in flags:
        return float(first["cpu MHz"]) * 1e6, "'cpu MHz' in a VM's /proc/cpuinfo (the TSC clock, about the base)"
    raise PeakUnknown(
        "no base clock found: the model name has no '@ x.xxGHz', cpufreq has neither base_frequency nor "
        "amd_pstate_nominal_freq, and /proc/cpuinfo's 'cpu MHz' is, on bare metal, the clock of the moment, "
        "not the base" + ("" if "cpu MHz" in first else " (and it has no 'cpu MHz' line either)")
    )


def datasheet_peak(dtype: str | torch.dtype = torch.float32, *, cpuinfo: str | None = None, cpus=None) -> PeakSpec:
    """This CPU's theoretical ``dtype`` peak: physical cores x base clock x FLOP/cycle/core (see the module).

    ``cpuinfo`` is /proc/cpuinfo's text (read when None) and ``cpus`` the logical CPUs to count (this
    process's affinity when None). Raises ``PeakUnknown``, naming what it could not read, on a CPU it has
    no table row for, where it finds no clock, or for a dtype the CPU has no native arithmetic for.
    """
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[as_dtype(dtype)]
    text = cpuinfo if cpuinfo is not None else _read("/proc/cpuinfo")
    if not text:
        raise PeakUnknown("cannot read /proc/cpuinfo (not Linux?): the peak needs its vendor, family and flags")
    processors = _processors(text)
    if not processors:
        raise PeakUnknown("/proc/cpuinfo lists no 'processor' entries")
    first = processors[0]
    missing = [key for key in ("vendor_id", "cpu family", "model", "flags") if key not in first]
    if missing:
        raise PeakUnknown(f"/proc/cpuinfo has no {missing} for CPU 0 (an x86 Linux field); cannot name the core")
    flags = set(first["flags"].split())
    if not (first["cpu family"].isdigit() and first["model"].isdigit()):
        raise PeakUnknown(
            f"/proc/cpuinfo's cpu family {first['cpu family']!r} and model {first['model']!r} are not numbers"
        )
    model = first.get("model name", "unknown model")
    kind, fp32 = _core_kind(first["vendor_id"], int(first["cpu family"]), int(first["model"]), flags, model)
    per_cycle, kind = _per_cycle(name, fp32, flags, kind)
    clock_hz, source = _clock(first, flags)
    allowed = set(cpus) if cpus is not None else os.sched_getaffinity(0)
    cores = {
        (p.get("physical id", "0"), p.get("core id", p["processor"]))
        for p in processors
        if int(p["processor"]) in allowed
    }
    if not cores:
        raise PeakUnknown(f"none of the CPUs {sorted(allowed)} is listed in /proc/cpuinfo")
    return PeakSpec(name, len(cores), clock_hz, source, per_cycle, kind, model)


@dataclass(frozen=True)
class MatmulPeak:
    """The best of a size sweep of matmuls: ``best`` is the size whose median is highest, ``sweep`` all sizes."""

    best: Measurement
    sweep: tuple[Measurement, ...]

    @property
    def flops(self) -> float:
        """The best median, in FLOP/s."""
        return self.best.median

    @property
    def spread(self) -> tuple[float, float]:
        """(slowest, fastest) repeat of the best size, in FLOP/s."""
        return self.best.spread

    def __str__(self) -> str:
        return f"best of {len(self.sweep)} sizes: {self.best}"


def best_matmul_peak(
    sizes=(256, 512, 1024, 2048), dtype: str | torch.dtype = torch.float32, *, repeats: int = 5, device=None
) -> MatmulPeak:
    """The highest median FLOP/s of (n, n) @ (n, n) matmuls over ``sizes``, with every size's measurement.

    Small sizes fit in cache but pay a per-call overhead; large ones stream from memory; the best lies
    between, so one size alone under- or over-states the flat roof.
    """
    sizes = tuple(sizes)
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise ValueError(f"sizes must be positive ints, got {sizes!r}")
    sweep = tuple(measure_matmul_flops(dtype, n, device=device, repeats=repeats) for n in sizes)
    return MatmulPeak(max(sweep, key=lambda m: m.median), sweep)
