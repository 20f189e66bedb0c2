"""N real processes from a notebook cell: ``launch(worker, world_size, *args, **kwargs)``.

Distributed training runs one process per device. ``torchrun`` starts them from a shell; a
lesson wants to start them from a cell and get each rank's answer back as a list. Two things
stand in the way, and this file is how they are solved:

* A function **defined in a notebook cell** cannot be pickled by reference: ``spawn`` looks it
  up by name in ``__main__`` and the kernel's ``__main__`` is not a file. We serialise the
  function *by value* with ``cloudpickle``, for the ranks to read.
* ``fork`` would avoid pickling, but a child forked from a process whose OpenMP/CUDA threads are
  running can deadlock; a fresh interpreter per rank costs PyTorch's import, seconds, in every rank of every
  launch. So the launcher keeps **fork servers** (``fork_server.py``), one per rank index: fresh
  interpreters that import PyTorch once and never run it, and fork a copy of themselves for each rank.
  We never fork a live PyTorch. The ranks get the parent's import path less the working folder: a
  ``cloudpickle.py`` (or ``torch.py``) lying there must not run in every rank. A worker from a module in
  the working folder (a notebook's helper file) travels by value instead.

Each rank gets the environment ``torchrun`` would give it (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and joins the group with ``env://``, so the
worker cannot tell the two launchers apart. As torchrun's agent does, the launcher itself hosts
the rendezvous store on a port the OS picks while binding it, so two launches never race for a
port. Under ``torchrun`` itself, ``launch`` notices the environment and runs the worker in the
current process instead of starting new ones::

    # train.py, run as  torchrun --nproc-per-node 2 train.py
    def worker(steps):
        ...
    if __name__ == "__main__":
        print(launch(worker, 2, steps=10))   # same list on every rank

The backend is gloo, for tensors on the CPU, joined by NCCL for CUDA tensors when every rank on this
machine can have its own GPU (``"cpu:gloo,cuda:nccl"``): the lessons' workers, which keep their tensors on
the CPU, then run unchanged on a GPU node, and a worker that moves its tensors to ``cuda:LOCAL_RANK`` gets NCCL.

What happens when something goes wrong (every rank is stopped and reaped before ``launch``
raises ``WorkerError``, which names the rank to blame):

* A rank **raises**: its traceback, at once. When several raise, the first to do so is the
  cause; the others usually only lost their connection to it.
* A rank **dies without a traceback** (SIGKILL from the out-of-memory killer, ``os._exit``,
  a crash in C++): it is blamed, with its exit status and last lines of output, ahead of the
  survivors whose collectives then failed.
* A rank **skips collectives**: its peers wait for calls it never makes and fail (a timeout, or a
  closed connection once it exits). Each rank leaves the number of collectives it called, and the
  rank that called fewer is named, not the peer that failed waiting.
* A rank **hangs**: a collective that waits longer than ``timeout`` seconds (default 30) fails
  in the ranks that wait, and the ranks still running are asked where they are (their Python
  stacks). A rank still running ``timeout`` seconds (and a few) after a peer finished with its result is
  stuck too (the ranks run one program): every rank is stopped and the stuck ones are named,
  with their stacks. A rank stalled while every peer is busy elsewhere can only be caught by
  ``deadline``: seconds, counted once every rank has started, after which ``launch`` stops every
  rank and names those still running. It is off by default, as a training run may rightly take days.
* The **launcher dies** (a restarted kernel): its fork servers and ranks die with it, and its temporary
  folder is removed by the next launch (``processes.py``). A fork server that dies is named, and replaced
  at the next launch.
* A rank **never starts**: importing the worker's modules on a busy machine may take a while, so
  start-up does not count against ``timeout``; it has its own bound, ``startup`` (default 300 s), after
  which the ranks that have not reached the start-up barrier are named, with their stacks (a deadlocked
  import, a worker module that blocks at import time). A rank that dies meanwhile is noticed at once.

Left out: several machines (use ``torchrun``), restarts on failure (torchelastic), Windows.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from .forked_ranks import Rank, fork_servers
from .launch_rank import EVERYONE_STARTED, STARTED, bind_gpu, join_group
from .processes import (
    Relay,
    blame,
    check_arguments,
    describe_exit,
    job_folder,
    not_started,
    stop,
)

__all__ = ["launch", "WorkerError"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_BOTH = "cpu:gloo,cuda:nccl"  # one group, each collective routed by its tensors' device
_GRACE = 3.0  # seconds past `timeout` before a rank still running after a peer's result is stopped


class WorkerError(RuntimeError):
    """A rank failed: raised in the parent with the rank to blame and what it left behind."""

    def __init__(self, rank: int, detail: str, headline: str = "failed:"):
        self.rank = rank
        super().__init__(f"rank {rank} {headline}\n{detail}")


def launch(
    worker: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 30.0,
    deadline: float | None = None,
    startup: float = 300.0,
    echo: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``worker(*args, **kwargs)`` on ``world_size`` processes; return each rank's result.

    Inside the worker, ``torch.distributed`` is initialised: ``dist.get_rank()`` and
    ``dist.get_world_size()`` say who it is. Return values travel back pickled, so return CPU
    tensors or plain Python. ``backend`` is ``"gloo"``, ``"nccl"`` or both, ``"cpu:gloo,cuda:nccl"``
    (default: ``default_backend``, the two when every rank on this machine has a GPU of its own, with all of the
    machine's GPUs visible to each as torchrun leaves them, else gloo). Inside a group that already exists it is
    ignored: the worker runs in that group. ``timeout`` bounds every collective, in seconds. ``deadline``, if given,
    bounds the worker's run, in seconds from when every rank has started (new processes only). ``startup``
    bounds the start of the new processes, up to the moment every rank is ready to join the group. ``echo``
    prints each rank's output prefixed by ``[rank r]``. The names ``backend``, ``timeout``, ``deadline``,
    ``startup`` and ``echo`` are therefore not passed on to the worker.
    """
    check_arguments(worker, world_size, backend, timeout, deadline, startup)
    if dist.is_initialized():  # the group exists (its backend is the caller's): run the worker in it
        return _run_in_this_process(worker, world_size, args, kwargs, backend, timeout)
    under_torchrun = all(v in os.environ for v in _TORCHRUN_VARS)
    if under_torchrun and "LOCAL_WORLD_SIZE" not in os.environ and backend is None and torch.cuda.is_available():
        raise ValueError(
            "RANK and WORLD_SIZE are set but not LOCAL_WORLD_SIZE (another launcher than torchrun?), so how many "
            "ranks share this machine's GPUs is unknown: pass backend= ('gloo', 'nccl') or set LOCAL_WORLD_SIZE"
        )
    # the ranks that share this machine's GPUs: torchrun says how many it started here
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun else world_size
    if backend in ("nccl", _BOTH) and torch.cuda.device_count() < local_ranks:
        raise ValueError(
            f"backend={backend!r} needs a GPU for each of the {local_ranks} ranks on this machine, which has "
            f"{torch.cuda.device_count()}: use backend='gloo' (or leave it unset)"
        )
    backend = backend or default_backend(local_ranks)
    if under_torchrun:
        return _run_in_this_process(worker, world_size, args, kwargs, backend, timeout)
    return _run_in_new_processes(worker, world_size, args, kwargs, backend, timeout, deadline, startup, echo)


def default_backend(local_ranks: int) -> str:
    """gloo for CPU tensors, joined by NCCL for CUDA tensors when each of ``local_ranks`` has its own GPU.

    One group then carries both (``"cpu:gloo,cuda:nccl"``: PyTorch routes each collective by the device
    of its tensors). NCCL cannot put two ranks on one GPU, so with fewer GPUs than ranks it is gloo alone.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks:
        return _BOTH
    return "gloo"


# -- inside torchrun (or inside an initialised world): run here, share the results ------------
def _run_in_this_process(worker, world_size, args, kwargs, backend, timeout) -> list[Any]:
    we_initialised = not dist.is_initialized()
    if we_initialised:
        bind_gpu(backend)
        join_group(backend, timeout)
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


# -- from a notebook: fork the ranks from a clean interpreter -------------------------------------------------
def _run_in_new_processes(worker, world_size, args, kwargs, backend, timeout, deadline, startup, echo) -> list[Any]:
    folder = job_folder()
    # the rendezvous point, hosted here as torchrun's agent hosts it: binding port 0 lets the OS
    # pick a free port and hold it for us, where "find a free port, let rank 0 bind it later"
    # races with every other program on the machine that opens a socket meanwhile
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs: list[Rank] = []
    try:
        path, left_out = _import_path()
        (folder / "job.pkl").write_bytes(_dumps((worker, args, kwargs), left_out))
        env = _child_environment(world_size, backend, timeout, store.port)
        servers = fork_servers(world_size, path, dict(os.environ))  # PyTorch imported, ready to fork
        start_by, asked = time.monotonic() + startup, []
        try:
            for rank, server in enumerate(servers):
                asked.append(server.ask(rank, folder, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
            for server, request in zip(servers, asked):
                procs.append(server.started(request, start_by))
        except BaseException:  # a rank asked for but not in procs would run unwatched: closing its server ends it
            for server in servers[len(procs) : len(asked)]:
                server.close()
            raise
        _watch(procs, folder, echo, deadline, timeout, store, startup, start_by)
        return [cloudpickle.loads((folder / f"result{rank}.pkl").read_bytes()) for rank in range(world_size)]
    finally:
        stop(procs)
        del store
        shutil.rmtree(folder, ignore_errors=True)


def _import_path() -> tuple[list[str], list[str]]:
    """The parent's import path for the ranks (absolute), less the working folder ('' or its path): what
    lies there is not code the ranks should import; and the folders left out."""
    here = os.path.realpath(os.getcwd())
    path = [os.path.abspath(p) for p in sys.path]
    return [p for p in path if os.path.realpath(p) != here], [p for p in path if os.path.realpath(p) == here]


def _dumps(job, left_out: list[str]) -> bytes:
    """cloudpickle the job; a worker from a module in a left-out folder travels by value, as it could not
    be imported there (a notebook's helper file beside it)."""
    module = sys.modules.get(getattr(job[0], "__module__", None) or "")
    file = getattr(module, "__file__", None)
    by_value = module is not None and file is not None and os.path.dirname(os.path.abspath(file)) in left_out
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(job)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def _child_environment(world_size: int, backend: str, timeout: float, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the store runs in the launcher: every rank is a client
        LLMEDU_BACKEND=backend,
        LLMEDU_TIMEOUT=str(timeout),
        PYTHONUNBUFFERED="1",  # for the processes a worker starts: each line reaches the notebook when printed
    )
    # N processes share the cores: cores / N intra-op threads each (at least one), unless the user
    # set OMP_NUM_THREADS; more would make every kernel wait for threads that have no core to run on
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env


def _watch(
    procs: list[Rank], folder: Path, echo: bool, deadline: float | None, timeout: float, store, startup, start_by
):
    """Relay output until every rank has exited with a result; on a failure, stop all and raise.

    Until every rank has reached the start-up barrier, the wait is bounded by ``start_by`` (monotonic
    seconds, ``startup`` after the launch began); past it the ranks that have not arrived are named, with their stacks.

    The ``deadline`` counts from the moment every rank has started (the start-up barrier in
    ``store`` is passed): it bounds the worker, however long start-up took on a busy machine.
    Once a rank has finished with its result, the others get ``timeout`` seconds (and a few more) to finish too:
    the ranks run the same program, so one still running long after a peer returned is stuck.
    """
    relay = Relay([folder / f"output{rank}.txt" for rank in range(len(procs))], echo)
    try:
        give_up, first_done, started = None, None, False
        while True:
            time.sleep(0.02)
            relay.pump()
            started = started or store.check([EVERYONE_STARTED])
            if deadline is not None and give_up is None and started:
                give_up = time.monotonic() + deadline
            if not started and time.monotonic() > start_by and all(p.poll() is None for p in procs):
                absent = [r for r in range(len(procs)) if not store.check([f"{STARTED}/{r}"])]
                detail = not_started(procs, folder, absent, startup)
                stop(procs)
                raise WorkerError(absent[0], detail, "did not start in time:")
            failed = _failed(procs, folder)
            if failed:  # a rank's failure ends its peers' moments later: let their exits come in, then judge
                time.sleep(0.1)
                failed = _failed(procs, folder)
            lost = [r for r in failed if procs[r].lost]
            if lost:  # a server died (or was killed), and its rank with it
                stop(procs)
                server = procs[lost[0]].server
                raise WorkerError(
                    lost[0],
                    f"The server (pid {server.process.pid}) {describe_exit(server.process.wait())}, and the rank "
                    f"died with it; the next launch starts another. The server's last words: {server.said()}",
                    "lost its fork server:",
                )
            exited = [r for r, p in enumerate(procs) if p.poll() is not None]
            if exited and first_done is None and not failed:
                first_done = time.monotonic()
            running = any(p.poll() is None for p in procs)
            late = give_up is not None and time.monotonic() > give_up and running
            # a little past `timeout`: a rank waiting in a collective for the one that returned reports first
            straggling = first_done is not None and time.monotonic() - first_done > timeout + _GRACE and running
            if failed or late or straggling:
                rank, headline, detail = blame(procs, folder, failed, deadline if late else None, timeout)
                stop(procs)
                relay.pump(final=True)  # what the ranks wrote before they stopped
                if detail is None:  # no traceback came back: the rank's last words are all there is
                    tail = "\n".join(relay.tails[rank]).strip()
                    detail = f"Its last output:\n{tail}" if tail else "It printed nothing."
                raise WorkerError(rank, detail, headline)
            if not running:
                break
        relay.pump(final=True)
    finally:
        relay.close()


def _failed(procs: list[Rank], folder: Path) -> list[int]:
    """The ranks that exited without leaving a result."""
    return [r for r, p in enumerate(procs) if p.poll() is not None and not (folder / f"result{r}.pkl").exists()]
