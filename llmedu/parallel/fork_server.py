"""Start ranks in a fraction of a second without forking a live PyTorch: fork servers.

``launch`` needs one new process per rank. A fresh interpreter costs the import of PyTorch, about 2 s of
CPU here, in every rank of every launch (``benchmarks/bench_launch.py`` measures it). Forking the launcher
would be instant, but the launcher is a live PyTorch: a thread of its OpenMP pool may hold a lock at the
moment of the fork, and the child, which inherits the lock but not the thread that would release it, can
wait forever; a launcher that has touched CUDA cannot give CUDA to a forked child at all.

A fork server is the middle road (Python's ``multiprocessing`` "forkserver" start method, written out so that
the launcher decides what the server imports and where output goes): a fresh interpreter imports PyTorch,
checks (on Linux) that it is still one thread, never runs a kernel or touches CUDA, and forks a copy of
itself for each rank. The copy makes itself the process ``torchrun`` would start (environment, working
folder, unbuffered output into a file the launcher reads) and runs ``launch_rank.main``, importing ``llmedu``
afresh. **One server per rank index** keeps the ranks of a launch as different from each other as separate
interpreters are: each has its own string-hash seed and memory layout, so a ``set`` of names iterates in
another order on each rank, as under torchrun, where code relying on that order would hang. (Rank r of one
launch and rank r of the next share them; numpy's random state is reseeded in every rank.) What an
interpreter reads only at its start (``PYTHON*``, ``LD_*``, ``TORCH*``...) is the launcher's at the
server's start: when it changes, or the import path does, the servers are replaced. numpy's BLAS runs on
one thread in the ranks (a thread pool in the server would be copied mid-flight). Each server holds an
imported PyTorch, about 220 MB here, for the launcher's life.

They talk in lines of JSON over the server's stdin and a private copy of its stdout (a stray print cannot
garble it)::

    launcher -> server   {"id": 7, "rank": 0, "folder": ..., "env": {...}, "cwd": ...}   start a rank
    server -> launcher   {"id": 7, "pid": 4242}                      it started (or {"id": 7, "error": ...})
    launcher -> server   {"id": 7, "signal": 15}                                    signal it, if still running
    server -> launcher   {"id": 7, "code": -9}     it exited (as subprocess says it: -N for signal N)

Only the server can reap its ranks, so it signals them (never a pid that could by now be another process's)
and reports their exits (the launcher's side of all this is ``forked_ranks.py``). When its stdin
ends (the launcher closed it, or died) the server kills its ranks and exits; a rank dies with its server
(``die_with``). A conversation interrupted midway (Ctrl-C) cannot be trusted: that server is closed.

Left out: Windows, which has no fork. Every rank shows in ``ps`` as ``python .../fork_server.py``.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import io
import json
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent


# -- the server: run as a script (``python fork_server.py``), a fresh interpreter of its own ------------------
def serve() -> None:
    """Import PyTorch once, then fork a rank per request until stdin ends; report each rank's exit."""
    replies, woken = _prepare()
    ranks: dict[int, int] = {}  # request id -> pid of the rank, until it is reaped
    pending = b""  # an unfinished line of requests
    while True:
        ready = select.select([0, woken], [], [])[0]
        if woken in ready:  # a rank exited (SIGCHLD)
            os.read(woken, 1 << 16)
        if 0 in ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the launcher is gone, or done with us
                break
            lines, pending = split_lines(pending + chunk)
            for request in map(json.loads, lines):
                if "signal" in request:
                    _signal(ranks, request)
                else:
                    _start(ranks, request, replies, keep_out=(replies, woken))
        _reap(ranks, replies)
    for pid in ranks.values():  # nobody is left to collect their results
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _prepare() -> tuple[int, int]:
    """Import what every rank needs, check that nothing runs beside us, set up the two pipes of the loop:
    replies to the launcher (a private copy of stdout), and one that a rank's exit (SIGCHLD) writes a byte to."""
    if sys.path and os.path.realpath(sys.path[0]) == str(_HERE):
        del sys.path[0]  # this file's folder (llmedu/parallel) is not a place to import from
    replies = os.dup(1)
    os.dup2(2, 1)  # anything printed from now on goes to stderr, not into our replies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is for the launcher and its ranks
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, if it never answers
    import cloudpickle  # noqa: F401 -- imported once, here, for every rank
    import torch.distributed  # noqa: F401

    if sys.platform.startswith("linux"):  # elsewhere there is no cheap way to count a process's threads
        threads = [Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
        if len(threads) != 1:
            sys.exit(f"the fork server runs {len(threads)} threads after importing PyTorch ({', '.join(threads)}):"
                     " a fork could copy a lock one of them holds")  # fmt: skip
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return replies, woken


def _start(ranks: dict[int, int], request: dict, replies: int, keep_out: tuple[int, int]) -> None:
    """Fork the rank of ``request``; tell the launcher its pid (or why there is none)."""
    server = os.getpid()
    try:
        pid = os.fork()
    except OSError as err:  # out of memory, or of processes: say so, and stay up for the others
        _say(replies, {"id": request["id"], "error": f"fork failed: {err}"})
        return
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in keep_out:
            os.close(fd)
        _become_rank(request, server)  # never returns
    ranks[request["id"]] = pid
    _say(replies, {"id": request["id"], "pid": pid})


def _signal(ranks: dict[int, int], request: dict) -> None:
    """Signal a rank that is still running: not reaped, its pid is still our child's, not a stranger's."""
    if request["id"] in ranks:
        os.kill(ranks[request["id"]], request["signal"])


def _reap(ranks: dict[int, int], replies: int) -> None:
    """Collect the ranks that exited, and report each one's exit code."""
    for request_id, pid in list(ranks.items()):
        reaped, status = os.waitpid(pid, os.WNOHANG)
        if reaped:
            del ranks[request_id]
            _say(replies, {"id": request_id, "code": os.waitstatus_to_exitcode(status)})


def split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines in ``data``, and the unfinished rest (to be continued by the next read)."""
    *lines, rest = data.split(b"\n")
    return lines, rest


def _say(replies: int, message: dict) -> None:
    try:
        os.write(replies, json.dumps(message).encode() + b"\n")
    except BrokenPipeError:  # the launcher is gone: its end of stdin will tell the loop
        pass


def _become_rank(request: dict, server: int) -> None:
    """In the forked copy: become the process torchrun would start, run the rank, never return."""
    try:
        die_with(server)
        faulthandler.unregister(signal.SIGUSR1)  # the server's; the rank registers its own (launch_rank)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # meanwhile a stack request must not kill it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        nothing = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nothing, 0)  # the requests are the server's, not ours
        os.close(nothing)
        output = os.open(Path(request["folder"]) / f"output{request['rank']}.txt", os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(output, 1)  # print() and tracebacks go to the file the launcher relays
        os.dup2(output, 2)
        os.close(output)
        sys.stdout, sys.stderr = (_unbuffered(fd) for fd in (1, 2))  # as python -u has them
        if "numpy.random" in sys.modules:  # imported with PyTorch; unlike Python's random, not reseeded by fork
            sys.modules["numpy.random"].seed()
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        importlib.invalidate_caches()  # files written since the server listed the folders on the path
        from llmedu.parallel.launch_rank import main

        main(Path(request["folder"]))  # ends in os._exit
    except BaseException:
        import traceback

        traceback.print_exc()
    os._exit(1)


def _unbuffered(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True, errors="backslashreplace")


def die_with(parent: int) -> None:
    """Make this process die when ``parent`` (its server) dies: on Linux the kernel kills it
    (``prctl(PR_SET_PDEATHSIG)``); elsewhere a thread notices that it has been re-parented."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG, from <linux/prctl.h>
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=exit_when_orphaned, args=(parent,), name="die-with-server", daemon=True).start()
    if os.getppid() != parent:  # it died before we asked: nobody will tell us
        os._exit(1)


def exit_when_orphaned(parent: int, every: float = 0.5) -> None:
    """Exit once this process has another parent than ``parent``: it died, and we were re-parented."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(1)  # the work is orphaned: nobody is left to collect its result


if __name__ == "__main__":
    serve()
