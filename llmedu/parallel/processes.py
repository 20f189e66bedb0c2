"""The operating-system side of ``launch``: rank processes that never outlive their launcher.

``launch`` starts one Python process per rank (forked by a fork server, ``fork_server.py``). Four things
can go wrong at the level of processes rather than of PyTorch, and each has its answer here:

* **The launcher dies** (its kernel is restarted, the OOM killer picks it). Its ranks would be
  re-parented to PID 1 and run on forever. Each fork server reads end-of-file on its stdin (the kernel
  closes the launcher's end of that pipe, however the launcher died), kills its ranks and exits; and a
  rank dies with its server in any case (``fork_server.die_with``).
* **The launcher's temporary folder leaks** when it dies. Folders are named with the
  launcher's PID (``llmedu-launch-<pid>-...``); ``job_folder`` removes those whose PID is no
  longer alive before it makes a new one.
* **A rank dies without a word** (SIGKILL, ``os._exit``): ``describe_exit`` turns its exit
  status into words (``killed by signal 9 (SIGKILL)``).
* **A rank is stuck** and we want to know where: each rank registers ``faulthandler`` on
  SIGUSR1, and ``stacks`` asks the stuck ones for their Python stacks before they are stopped.

``blame`` decides, when something failed, which rank to name and what to say about it.

``stop`` terminates what still runs, kills what does not listen, and waits for every process. The processes
are ``forked_ranks.Rank``s: each answers ``poll``, ``wait``, ``terminate``, ``kill`` as ``subprocess.Popen`` does.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from ..runtime import process_alive

__all__ = [
    "Relay",
    "job_folder",
    "describe_exit",
    "watch_for_stack_requests",
    "stacks",
    "not_started",
    "stop",
    "blame",
    "check_arguments",
    "TIMEOUT_HINT",
]

_PREFIX = "llmedu-launch-"
TIMEOUT_HINT = "A collective waited longer than timeout="  # how a rank's timeout error begins


# -- in the launcher ---------------------------------------------------------------------------
def check_arguments(worker, world_size, backend, timeout, deadline, startup) -> None:
    """``launch``'s guards: each bad argument is an error that names it."""
    if not callable(worker):
        raise TypeError(f"worker must be a function, got {type(worker).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    if deadline is not None and deadline <= 0:
        raise ValueError(f"deadline must be positive seconds or None, got {deadline!r}")
    if startup <= 0:
        raise ValueError(f"startup must be positive seconds, got {startup!r}")
    if backend not in (None, "gloo", "nccl", "cpu:gloo,cuda:nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or 'cpu:gloo,cuda:nccl', got {backend!r}")


def job_folder() -> Path:
    """A new temporary folder named after this process; folders of dead launchers are removed."""
    for old in Path(tempfile.gettempdir()).glob(_PREFIX + "*"):
        pid = old.name[len(_PREFIX) :].split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)  # another user's folder stays: not ours to remove
    return Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))


def describe_exit(code: int) -> str:
    """An exit status in words: ``killed by signal 9 (SIGKILL)`` or ``exited with code 3``."""
    if code < 0:  # subprocess reports death by signal N as -N
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        hint = ", as the out-of-memory killer does" if -code == signal.SIGKILL else ""
        return f"killed by signal {-code} ({name}{hint})"
    return f"exited with code {code}"


def stacks(procs: dict, folder: Path, wait: float = 2.0) -> dict[int, str]:
    """Ask each running rank for its Python stacks (SIGUSR1); what came back within ``wait`` s."""
    asked = {}
    for rank, p in procs.items():
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
            asked[rank] = folder / f"stack{rank}.txt"
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(f.exists() and f.stat().st_size for f in asked.values()):
        time.sleep(0.05)  # faulthandler writes from the signal handler, within microseconds of delivery
    return {rank: f.read_text() for rank, f in asked.items() if f.exists() and f.stat().st_size}


def stop(procs: list, grace: float = 5.0) -> None:
    """Terminate whatever is still running, kill what did not exit within ``grace`` s, wait for all.

    What the processes wrote before they stopped stays in their output files, to be read.
    """
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:  # its server does not answer: closing it ends its ranks
                p.server.close()


class Relay:
    """Each rank's output (a file the rank writes), line by line, echoed with a ``[rank r]`` prefix; the last lines kept."""

    def __init__(self, files: list[Path], echo: bool):
        self.files, self.echo = files, echo
        self.streams: list = [None] * len(files)  # each opened once its rank has made it
        self.partial = [b""] * len(files)
        self.tails: list[list[str]] = [[] for _ in files]  # last 20 lines of each rank

    def pump(self, final: bool = False) -> None:
        """Relay the lines the ranks wrote since the last call; ``final``: each rank's unfinished last line too."""
        for rank, path in enumerate(self.files):
            if self.streams[rank] is None and path.exists():
                self.streams[rank] = open(path, "rb")  # noqa: SIM115 -- read as it grows; closed by close()
            chunk = self.streams[rank].read() if self.streams[rank] else b""
            if final and (chunk or self.partial[rank]) and not chunk.endswith(b"\n"):
                chunk += b"\n"
            *lines, self.partial[rank] = (self.partial[rank] + chunk).split(b"\n")  # the last: unfinished
            for line in lines:
                text = line.decode(errors="replace")
                self.tails[rank] = (self.tails[rank] + [text])[-20:]
                if self.echo:
                    print(f"[rank {rank}] {text}", flush=True)

    def close(self) -> None:
        for stream in self.streams:
            if stream is not None:
                stream.close()


# -- in each rank ------------------------------------------------------------------------------
def watch_for_stack_requests(path: Path) -> None:
    """On SIGUSR1, write every thread's Python stack to ``path`` (read by ``stacks``)."""
    stream = open(path, "w")  # noqa: SIM115 -- stays open for the life of the process
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)


def blame(
    procs, folder: Path, failed: list[int], deadline: float | None, timeout: float
) -> tuple[int, str, str | None]:
    """The rank to blame, a headline, and its traceback (None if it left none).

    A rank that died without a traceback (SIGKILL, ``os._exit``, a crash in C++) comes first:
    its peers fail moments later only because their connection to it closed. Otherwise the
    first traceback written is the cause, unless a rank that returned its result (or timed out) had
    called fewer collectives than the rank that wrote it: that rank skipped some (or fell behind), and
    its peers failed waiting for it (a timeout, or its connection closed when it exited). When the failure is a hang, the ranks still
    running are asked where they are.
    """
    running = [r for r, p in enumerate(procs) if p.poll() is None]
    reports = {int(f.stem[len("error") :]): f for f in folder.glob("error*.txt")}
    silent = [r for r in failed if r not in reports]
    if silent:
        return (
            silent[0],
            f"died, {describe_exit(procs[silent[0]].returncode)}, leaving no traceback and no result.",
            None,
        )
    if reports:
        rank = min(reports, key=lambda r: reports[r].stat().st_mtime_ns)
        detail = reports[rank].read_text()
        if TIMEOUT_HINT in detail and running:
            detail += _where(procs, running, folder, "still running when it gave up")
        calls = {int(f.stem[len("calls") :]): f.read_text() for f in folder.glob("calls*.txt")}
        calls = {r: int(n) for r, n in calls.items() if n.isdigit()}
        behind = min(calls, key=lambda r: (calls[r], r), default=rank)
        skipped = rank in calls and calls[behind] < calls[rank] and (behind not in reports or TIMEOUT_HINT in detail)
        if skipped:
            counts = ", ".join(f"rank {r}: {calls[r]}" for r in sorted(calls))
            return (
                behind,
                "fell behind its peers:",
                (
                    f"it called {calls[behind]} collectives where rank {rank} called {calls[rank]} ({counts}): it "
                    f"skipped some, or stopped calling them, and rank {rank} failed waiting for it. Rank {rank}'s error:\n"
                    + detail
                ),
            )
        return rank, "failed:", detail
    if deadline is not None:
        detail = (
            f"deadline={deadline:g} s after start-up reached with {_ranks(running)} still running; all were stopped."
        )
    else:
        detail = (
            f"{_ranks(running)} still running {timeout:g} s (timeout) after another rank finished with its "
            "result; all were stopped."
        )
    return running[0], "did not finish in time:", detail + _where(procs, running, folder, "still running")


def not_started(procs, folder: Path, absent: list[int], startup: float) -> str:
    """Why launch gave up before the ranks joined: who never arrived, and where they are."""
    detail = (
        f"{_ranks(absent)} had not reached the start-up barrier {startup:g} s (startup) after launch; "
        "all were stopped. Start-up is the child's import of the worker and its modules: one that blocks "
        "at import time (waits for input, a lock, a server) shows in the stack below."
    )
    return detail + _where(procs, absent, folder, "still starting")


def _where(procs, ranks: list[int], folder: Path, what: str) -> str:
    """Where the running ``ranks`` are, as the Python stacks they report."""
    found = stacks({r: procs[r] for r in ranks}, folder)
    lines = [f"\n\n{_ranks(ranks).capitalize()} {'was' if len(ranks) == 1 else 'were'} {what}:"]
    for r in ranks:
        lines += [f"[rank {r}] {line}" for line in found.get(r, "(no stack came back)").strip().splitlines()]
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
