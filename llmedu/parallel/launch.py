"""N real processes from a notebook cell: ``launch(worker, world_size, *args, **kwargs)``.

Distributed training runs one process per device. ``torchrun`` starts them from a shell; a
lesson wants to start them from a cell and get each rank's answer back as a list. Two things
stand in the way, and this file is how they are solved:

* A function **defined in a notebook cell** cannot be pickled by reference: ``spawn`` looks it
  up by name in ``__main__`` and the kernel's ``__main__`` is not a file. We serialise the
  function *by value* with ``cloudpickle`` and start fresh interpreters that read it.
* ``fork`` would avoid pickling, but a child forked from a process whose OpenMP/CUDA threads are
  running can deadlock. Fresh interpreters have no such state; we never fork a live PyTorch.

Each child gets the environment ``torchrun`` would give it (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and joins the group with ``env://``, so the
worker cannot tell the two launchers apart. Under ``torchrun`` itself, ``launch`` notices the
environment and runs the worker in the current process instead of starting new ones::

    # train.py, run as  torchrun --nproc-per-node 2 train.py
    def worker(steps):
        ...
    if __name__ == "__main__":
        print(launch(worker, 2, steps=10))   # same list on every rank

The backend is NCCL when every rank can have its own GPU, gloo otherwise. A rank that raises
makes ``launch`` raise at once with that rank's traceback (the other ranks are killed); a
collective that waits longer than ``timeout`` seconds fails with a message that says so.

Left out: several machines (use ``torchrun``), restarts on failure (torchelastic), Windows.
"""

from __future__ import annotations

import datetime
import gc
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

__all__ = ["launch", "WorkerError"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class WorkerError(RuntimeError):
    """A rank failed: raised in the parent with the rank number and its traceback."""

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        super().__init__(f"rank {rank} failed:\n{detail}")


def launch(
    worker: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 60.0,
    echo: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``worker(*args, **kwargs)`` on ``world_size`` processes; return each rank's result.

    Inside the worker, ``torch.distributed`` is initialised: ``dist.get_rank()`` and
    ``dist.get_world_size()`` say who it is. Return values travel back pickled, so return CPU
    tensors or plain Python. ``backend`` is ``"nccl"`` or ``"gloo"`` (default: nccl if there
    is a GPU per rank). ``timeout`` bounds every collective, in seconds. ``echo`` prints each
    rank's output prefixed by ``[rank r]``. The names ``backend``, ``timeout`` and ``echo`` are
    therefore not passed on to the worker.
    """
    if not callable(worker):
        raise TypeError(f"worker must be a function, got {type(worker).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")

    if dist.is_initialized() or all(v in os.environ for v in _TORCHRUN_VARS):
        # torchrun gives each local rank its own GPU (possibly across machines): NCCL if there are GPUs
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        return _run_in_this_process(worker, world_size, args, kwargs, backend, timeout)
    return _run_in_new_processes(
        worker, world_size, args, kwargs, backend or default_backend(world_size), timeout, echo
    )


def default_backend(world_size: int) -> str:
    """NCCL when this machine has one GPU per rank, else gloo (CPU)."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


# -- inside torchrun (or inside an initialised world): run here, share the results ------------
def _run_in_this_process(worker, world_size, args, kwargs, backend, timeout) -> list[Any]:
    we_initialised = not dist.is_initialized()
    if we_initialised:
        _join_group(backend, timeout)
    if dist.get_world_size() != world_size:
        raise ValueError(
            f"launch(..., world_size={world_size}) inside a world of {dist.get_world_size()} processes "
            "(set by torchrun --nproc-per-node): make them agree"
        )
    try:
        result = worker(*args, **kwargs)
        results: list[Any] = [None] * world_size
        dist.all_gather_object(results, result)  # every rank gets the same list, as in the notebook
        return results
    finally:
        if we_initialised:
            dist.destroy_process_group()


def _join_group(backend: str, timeout: float) -> None:
    """``env://`` initialisation from the variables torchrun (or our parent) set."""
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout))


# -- from a notebook: start fresh interpreters -------------------------------------------------
def _run_in_new_processes(worker, world_size, args, kwargs, backend, timeout, echo) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="llmedu-launch-") as tmp:
        folder = Path(tmp)
        (folder / "job.pkl").write_bytes(cloudpickle.dumps((worker, args, kwargs)))
        env = _child_environment(world_size, backend, timeout)
        code = "from llmedu.parallel.launch import _child_main; _child_main()"
        procs = []
        try:
            for rank in range(world_size):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", code, str(folder)],
                        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
            _watch(procs, folder, echo)
        finally:
            _stop(procs)
        return [cloudpickle.loads((folder / f"result{rank}.pkl").read_bytes()) for rank in range(world_size)]


def _child_environment(world_size: int, backend: str, timeout: float) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        LLMEDU_BACKEND=backend,
        LLMEDU_TIMEOUT=str(timeout),
        PYTHONUNBUFFERED="1",  # so that each print reaches the notebook when it happens
        # the parent's import path, so that the worker's module (a test file, say) imports there too
        PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path),
    )
    # N processes share the cores: cores / N intra-op threads each (at least one), unless the user
    # set OMP_NUM_THREADS; more would make every kernel wait for threads that have no core to run on
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env


def _free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it; rank 0's store binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch(procs: list[subprocess.Popen], folder: Path, echo: bool) -> None:
    """Relay output line by line, prefixed by rank, until every rank has exited; raise on failure."""
    selector = selectors.DefaultSelector()
    for rank, p in enumerate(procs):
        os.set_blocking(p.stdout.fileno(), False)
        selector.register(p.stdout, selectors.EVENT_READ, rank)
    partial = [b""] * len(procs)
    tails: list[list[str]] = [[] for _ in procs]  # last lines of each rank, for a crash report
    while True:
        for key, _ in selector.select(timeout=0.1):
            rank = key.data
            chunk = key.fileobj.read()
            if not chunk:  # end of file: the process closed its output
                selector.unregister(key.fileobj)
                chunk = b"\n" if partial[rank] else b""
            *lines, partial[rank] = (partial[rank] + chunk).split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                tails[rank] = (tails[rank] + [text])[-20:]
                if echo:
                    print(f"[rank {rank}] {text}", flush=True)
        failed = [rank for rank, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            # When one rank dies, its peers fail moments later with "connection closed by peer".
            # Give them a moment to do so, then blame the rank whose error came first: the cause.
            _wait_for_exit(procs, seconds=2.0)
            _stop(procs)
            rank = _first_failure(folder, failed)
            code = procs[rank].returncode
            error = folder / f"error{rank}.txt"
            how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            detail = (
                error.read_text()
                if error.exists()
                else (f"{how} and no Python traceback; its last output:\n" + "\n".join(tails[rank]))
            )
            raise WorkerError(rank, detail)
        if all(p.poll() is not None for p in procs) and not selector.get_map():
            return


def _wait_for_exit(procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _first_failure(folder: Path, failed: list[int]) -> int:
    """The rank whose error report was written first (else the first rank seen to fail)."""
    reports = {int(f.stem[len("error") :]): f.stat().st_mtime_ns for f in folder.glob("error*.txt")}
    return min(reports, key=reports.get) if reports else failed[0]


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate whatever is still running, then kill what did not listen; reap everything."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()


def _child_main() -> None:
    """Entry point of each child: join the group, run the worker, leave the result in a file."""
    folder = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    timeout = float(os.environ["LLMEDU_TIMEOUT"])
    try:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        _join_group(os.environ["LLMEDU_BACKEND"], timeout)
        worker, args, kwargs = cloudpickle.loads((folder / "job.pkl").read_bytes())
        result = worker(*args, **kwargs)
        payload = cloudpickle.dumps(result)
        del worker, args, kwargs, result
        gc.collect()  # free what the worker left (a DistributedDataParallel...) while its group lives
        dist.destroy_process_group()
    except BaseException as err:  # every failure, even KeyboardInterrupt, goes back to the parent
        detail = traceback.format_exc()
        if "timed out" in str(err).lower() or "timeout" in type(err).__name__.lower():
            detail += (
                f"\nA collective waited longer than timeout={timeout:g} s. Usually the ranks did not "
                "call the same collectives in the same order (or one rank stopped calling them)."
            )
        (folder / f"error{rank}.txt").write_text(detail)
        sys.stdout.flush()
        os._exit(1)  # skip atexit handlers that could wait forever on a broken group
    (folder / f"result{rank}.pkl").write_bytes(payload)
    sys.stdout.flush()
    # the work is done: skip the interpreter's teardown, where C++ threads of the communication
    # library can abort the process if destroyed in the wrong order
    os._exit(0)
