"""Where code runs, how it is seeded, and how long it takes.

Every lesson starts here:

* ``device()`` picks the best accelerator present: CUDA, then Apple's MPS, then the CPU.
* ``autocast_dtype(device)`` is the low-precision type worth using there (bf16 where the
  hardware has it, fp16 on older GPUs).
* ``seed_everything(seed)`` seeds Python, NumPy and PyTorch (every device) in one call.
* ``FAST`` says whether lessons run their small configs (about a minute each on two CPU cores) or
  their full ones. ``LLMEDU_FAST=1``/``0`` decides; unset, the mode follows the machine: fast
  without a CUDA GPU (a laptop finishes a lesson in minutes), full with one. ``mode_banner()`` is
  the line each lesson prints first, saying which mode it is in and how to switch, followed by
  ``machine()``: the CPU model, its cores and caches, or the GPU, so that "this machine" in a
  lesson means one thing.
* ``Timer`` measures wall-clock time, synchronising the accelerator so that asynchronous
  kernels are counted where they run, not where they were launched.
* ``sigterm_as_interrupt()`` makes SIGTERM (a job scheduler's "stop now") raise KeyboardInterrupt,
  as Ctrl-C does, so that long work can save its state on either.

Nothing here is clever; it exists so that the same cell runs unchanged on a laptop, in CI and
on a GPU node.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "FAST",
    "fast_mode",
    "mode_banner",
    "machine",
    "git_commit",
    "shown_command",
    "cpu_model",
    "device",
    "autocast_dtype",
    "seed_everything",
    "synchronize",
    "Timer",
    "sigterm_as_interrupt",
    "process_alive",
]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def fast_mode(value: str | None = None, *, has_cuda: bool | None = None) -> bool:
    """Parse ``LLMEDU_FAST`` (or ``value``): 1/true/yes/on or 0/false/no/off, any case.

    Unset or empty, the machine decides: fast mode unless a CUDA GPU is present (``has_cuda``
    overrides the probe), so that a lesson opened on a laptop finishes in minutes, not hours.
    Anything else is an error rather than a silent default: a typo in CI must not quietly run
    the full-size lessons for hours.
    """
    raw = os.environ.get("LLMEDU_FAST", "") if value is None else value
    key = raw.strip().lower()
    if key in _TRUE:
        return True
    if key in _FALSE:
        return False
    if key == "":
        return not (torch.cuda.is_available() if has_cuda is None else has_cuda)
    raise ValueError(
        f"LLMEDU_FAST={raw!r} is not understood; use 1/true/yes/on for the fast mode, 0/false/no/off for the "
        "full mode, or leave it unset to let the machine decide (fast without a CUDA GPU, full with one)."
    )


FAST: bool = fast_mode()


def mode_banner() -> str:
    """The top of a lesson: which mode runs, why, and how to switch; then the machine it runs on."""
    return f"{_mode_line()}\nmachine: {machine()}"


def git_commit() -> str:
    """The commit a recorded study ran from: HEAD, marked when files under llmedu/ differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "llmedu"], capture_output=True, text=True)
        return head + (" (llmedu/ modified)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def shown_command(command: str) -> str:
    """A recorded study's command as a reader sees it: each absolute path cut to its file name, since it names a
    folder of the machine that recorded it (``--out /home/me/run.json`` -> ``--out run.json``)."""
    return " ".join(os.path.basename(word) if word.startswith("/") else word for word in command.split(" "))


def machine() -> str:
    """The machine a lesson's measurements come from, in one line.

    The CPU's model, its logical CPUs and the threads torch uses, and its data caches per level (from
    Linux's sysfs; absent elsewhere); with a CUDA GPU, also the GPU's name and memory.
    """
    cpu = cpu_model()
    line = f"{cpu}, {os.cpu_count()} logical CPUs ({torch.get_num_threads()} torch threads)"
    caches = _cpu_caches()
    if caches:
        line += ", caches " + " / ".join(f"{level} {size}" for level, size in caches)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        line += f"; GPU {props.name}, {props.total_memory / 2**30:.0f} GiB"
    return line


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (``platform`` where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            for text in f:
                if text.startswith("model name"):
                    return text.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def _cpu_caches() -> list[tuple[str, str]]:
    """[("L1d", "32K"), ("L2", "1024K"), ("L3", "32768K")] for CPU 0, sizes as the kernel writes them."""
    from pathlib import Path

    found = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if kind == "Instruction":
            continue
        found.append((f"L{level}" + ("d" if kind == "Data" else ""), size))
    return found


def _mode_line() -> str:
    raw = os.environ.get("LLMEDU_FAST", "").strip()
    why = (
        f"LLMEDU_FAST={raw}"
        if raw
        else ("LLMEDU_FAST unset, a CUDA GPU present" if not FAST else "LLMEDU_FAST unset, no CUDA GPU")
    )
    if FAST:
        return (
            f"fast mode ({why}): small configs, seconds to a minute a cell on 2 CPU cores. For the full "
            "experiments put `%env LLMEDU_FAST=0` above the imports and restart the kernel."
        )
    return (
        f"full mode ({why}): the full-size experiments (the lesson's header says how long). For small "
        "configs put `%env LLMEDU_FAST=1` above the imports and restart the kernel."
    )


def device(prefer: str | None = None) -> torch.device:
    """The device to compute on: ``cuda`` > ``mps`` > ``cpu``.

    ``prefer`` (or the ``LLMEDU_DEVICE`` environment variable) forces a choice; asking for a
    device that is not present is an error, not a quiet fall back to the CPU. An accelerator comes
    with its index (``cuda:0``), as a tensor reports its own, so that ``x.device == device()`` holds
    and the device can key a dict of per-device figures.
    """
    name = prefer or os.environ.get("LLMEDU_DEVICE")
    if name:
        available = {
            "cpu": True,
            "cuda": torch.cuda.is_available(),
            "mps": torch.backends.mps.is_available(),
        }
        kind = str(name).split(":")[0]
        if kind not in available:
            raise ValueError(f"unknown device {name!r}: llmedu runs on {', '.join(available)}")
        if not available[kind]:
            raise RuntimeError(f"device {name!r} was requested but is not available on this machine")
        return _indexed(torch.device(name))
    if torch.cuda.is_available():
        return _indexed(torch.device("cuda"))
    if torch.backends.mps.is_available():
        return _indexed(torch.device("mps"))
    return torch.device("cpu")


def _indexed(dev: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, ``mps`` -> ``mps:0``; the CPU and indexed devices as they are."""
    if dev.index is not None or dev.type == "cpu":
        return dev
    return torch.device(dev.type, torch.cuda.current_device() if dev.type == "cuda" else 0)


def autocast_dtype(dev: torch.device | str | None = None) -> torch.dtype:
    """The low-precision dtype for autocast on ``dev``: bf16 unless a GPU only does fp16 well."""
    dev = torch.device(dev) if dev is not None else device()
    if dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16  # Volta/Turing: no bf16 tensor cores
    return torch.bfloat16


def seed_everything(seed: int) -> torch.Generator:
    """Seed ``random``, NumPy and PyTorch (CPU and every GPU); return a seeded CPU generator.

    The returned generator is for code that wants its own random stream (a data sampler, say)
    without disturbing the global one.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return torch.Generator().manual_seed(seed)


def synchronize(dev: torch.device | str | None = None) -> None:
    """Wait until ``dev`` has finished the work queued on it (a no-op on the CPU)."""
    dev = torch.device(dev) if dev is not None else device()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


@dataclass
class Timer:
    """Wall-clock timer that synchronises the device before reading the clock.

    >>> with Timer() as t:
    ...     _ = sum(range(1000))
    >>> t.seconds >= 0
    True

    Used as a context manager it times one block; ``lap()`` records intervals in ``laps``.
    """

    device: torch.device | str | None = "cpu"
    seconds: float = 0.0
    laps: list[float] = field(default_factory=list)

    def __enter__(self) -> Timer:
        synchronize(self.device)
        self._start = self._last = time.perf_counter()
        return self

    def lap(self) -> float:
        synchronize(self.device)
        now = time.perf_counter()
        self.laps.append(now - self._last)
        self._last = now
        return self.laps[-1]

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._start


@contextmanager
def sigterm_as_interrupt():
    """While training, SIGTERM (a scheduler's "stop now") raises KeyboardInterrupt, as Ctrl-C does, so
    that both save the last finished step. Only the main thread can set signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def process_alive(pid: int) -> bool:
    """Does process ``pid`` still exist? (Used to clean up what dead processes left behind.)"""
    try:
        os.kill(pid, 0)  # signal 0 delivers nothing: it only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists but belongs to someone else
    return True
