"""Start a rank in a tenth of a second, not seconds, without forking a live PyTorch: a fork server.

``launch`` needs one new process per rank. A fresh interpreter costs the import of PyTorch, about 2 s of
CPU here, in every rank of every launch: on an idle 2-core machine, four ranks that join a group and leave
took 4.5 s with ``torch.multiprocessing.spawn`` (a fresh interpreter each), 0.5 s forked from this server
(``benchmarks/bench_launch.py``). Forking the launcher would be instant, but the launcher is a live
PyTorch: its OpenMP (or CUDA) threads may hold a lock at the moment of the fork, and the child, which
inherits the lock but not the thread that would release it, can wait forever.

A fork server is the middle road (Python's ``multiprocessing`` calls it the "forkserver" start method; it is
written out here so that the launcher decides what the server imports and where each rank's output goes).
Once per launcher, a fresh interpreter imports PyTorch, and then never runs a kernel, so it has no pool of
threads that could hold a lock. For each rank asked for, it forks a copy of itself: a clean interpreter with
PyTorch already imported. The copy makes itself the process ``torchrun`` would start (its environment,
import path and working folder, its output to a file the launcher reads) and runs ``launch_rank.main``.
The server imports nothing of ``llmedu``: each rank imports it afresh, as a fresh interpreter would.

The two talk in lines of JSON over the server's stdin and stdout::

    launcher -> server   {"rank": 0, "folder": ..., "env": {...}, "path": [...], "cwd": ...}   start a rank
    server -> launcher   {"rank": 0, "pid": 4242}                                             it started
    server -> launcher   {"pid": 4242, "code": -9}       it exited (as subprocess says it: -N for signal N)

Only the server can reap its ranks (they are its children), so it reports each exit; ``Rank`` gives the
launcher the part of ``subprocess.Popen`` it uses (``poll``, ``wait``, ``returncode``, signals) from those
reports. When its stdin ends (the launcher closed it, or died, and the kernel closed it) the server kills
its ranks and exits; on Linux each rank is also killed by the kernel if the server dies
(``processes.exit_with_parent``).

Left out: Windows, which has no fork.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


# -- the server: run as a script (``python fork_server.py``), a fresh interpreter of its own ------------------
def serve() -> None:
    """Import PyTorch once, then fork a rank per request until stdin ends; report each rank's exit."""
    del sys.path[0]  # this file's folder (llmedu/parallel) is not a place to import from
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is for the launcher and its ranks
    import cloudpickle  # noqa: F401 -- what every rank needs first: imported once, here
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    me, ranks, pending = os.getpid(), set(), b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the launcher is gone, or done with us
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become_rank(request, server=me)  # never returns
                ranks.add(pid)
                _say({"rank": request["rank"], "pid": pid})
        for pid in list(ranks):  # reap the ranks that exited
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ranks.discard(pid)
                _say({"pid": pid, "code": os.waitstatus_to_exitcode(status)})
    for pid in ranks:  # nobody is left to collect their results
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _say(message: dict) -> None:
    os.write(1, json.dumps(message).encode() + b"\n")


def _become_rank(request: dict, server: int) -> None:
    """In the forked copy: become the process torchrun would start, run the rank, never return."""
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests are the server's, not ours
        output = os.open(Path(request["folder"]) / f"output{request['rank']}.txt", os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(output, 1)  # print() and tracebacks go to the file the launcher relays
        os.dup2(output, 2)
        os.close(output)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)  # as PYTHONUNBUFFERED would
        os.environ.clear()
        os.environ.update(request["env"], LLMEDU_PARENT_PID=str(server))
        sys.path[:] = request["path"]
        os.chdir(request["cwd"])
        from llmedu.parallel.launch_rank import main

        main(Path(request["folder"]))  # ends in os._exit
    except BaseException:
        import traceback

        traceback.print_exc()
    os._exit(1)


# -- the launcher's side --------------------------------------------------------------------------------------
class ForkServer:
    """A running server, started with the import path ``path`` and the environment ``env``."""

    def __init__(self, path: list[str], env: dict[str, str]):
        self.owner = os.getpid()  # a process forked from the launcher must start its own server
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # silent unless it fails to start: then it is the error we show
            env={**env, "PYTHONPATH": os.pathsep.join(path)},
            cwd=Path(__file__).parent,
        )
        self.running: set[int] = set()  # pids of ranks started and not yet reported exited
        self.exits: dict[int, int] = {}  # pid -> exit code, as the server reported them
        self.lock = threading.Lock()  # one conversation at a time
        self.gone = False  # its stdout ended: it exited, or was killed
        self._pending = b""

    def alive(self) -> bool:
        return not self.gone and self.process.poll() is None and self.owner == os.getpid()

    def start(self, rank: int, folder: Path, env: dict[str, str], path: list[str]) -> Rank:
        """Fork rank ``rank`` with environment ``env`` and import path ``path``; its output goes to folder."""
        request = {"rank": rank, "folder": str(folder), "env": env, "path": path, "cwd": os.getcwd()}
        with self.lock:
            try:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                self.process.stdin.flush()
            except BrokenPipeError:
                pass  # it is gone: reading says so
            while not self.gone:  # the reply comes at once (a fork); exits of earlier ranks may come before it
                for message in self._read(wait=None):
                    if message.get("rank") == rank:
                        self.running.add(message["pid"])
                        return Rank(message["pid"], self)
        said = self.process.stderr.read().decode(errors="replace").strip()
        raise RuntimeError(
            f"the fork server of launch (pid {self.process.pid}) exited with code {self.process.wait()}: {said}"
        )

    def reports(self) -> None:
        """Take in the exits the server has reported since the last look."""
        with self.lock:
            self._read(wait=0)

    def _read(self, wait: float | None) -> list[dict]:
        """Messages that arrived within ``wait`` s (None: until one does); exits are recorded as they come."""
        fd = self.process.stdout.fileno()
        messages: list[dict] = []
        while not messages and not self.gone and select.select([fd], [], [], wait)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the server is gone, and its ranks with it: the kernel kills them (exit_with_parent)
                self.gone = True
                self.exits.update(dict.fromkeys(self.running, -signal.SIGKILL))
                self.running.clear()
            *lines, self._pending = (self._pending + chunk).split(b"\n")
            messages += [json.loads(line) for line in lines]
        for message in messages:
            if "code" in message:
                self.exits[message["pid"]] = message["code"]
                self.running.discard(message["pid"])
        return messages


class Rank:
    """A rank forked by the server: the part of ``subprocess.Popen``'s interface that ``launch`` uses."""

    def __init__(self, pid: int, server: ForkServer):
        self.pid, self.server, self.returncode = pid, server, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.reports()
            self.returncode = self.server.exits.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        give_up = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if give_up is not None and time.monotonic() > give_up:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # reaped a moment ago; the server's report is on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_server: ForkServer | None = None


def fork_server(path: list[str], env: dict[str, str]) -> ForkServer:
    """This launcher's server, started on first use (about as long as one fresh interpreter takes)."""
    global _server
    if _server is None or not _server.alive():
        _server = ForkServer(path, env)
    return _server


def server_pid() -> int | None:
    """The pid of this process's fork server, if one runs: the one process of ours that outlives a launch."""
    return _server.process.pid if _server is not None and _server.alive() else None


if __name__ == "__main__":
    serve()
