"""The launcher's side of its fork servers (``fork_server.py`` is the server's side, and tells the story).

``fork_servers(n, path, environ)`` gives the servers of ranks 0..n-1, started on first use and replaced when
what a starting interpreter reads has changed. ``ForkServer`` is a handle on one: ``ask`` for a rank,
``started`` waits for its pid, and ``Rank`` is the forked process as the launcher sees it, the part of
``subprocess.Popen``'s interface that ``launch`` uses (``poll``, ``wait``, ``returncode``, signals), built
from what the server reports. A conversation interrupted midway (Ctrl-C) closes that server: what it says
next could not be trusted, and closing it ends its ranks.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from .fork_server import split_lines

SERVER = Path(__file__).resolve().parent / "fork_server.py"
# what an interpreter reads when it starts, or PyTorch and its libraries when imported: a server started with
# other values would not be the process a fresh interpreter would be. The thread counts are not among them: each
# rank sets its own (torch.set_num_threads), and numpy's BLAS has one thread in every server.
READ_AT_START = ("PYTHON", "PYTORCH", "TORCH", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "MALLOC_", "GLIBC_TUNABLES",
                 "LC_", "LANG")  # fmt: skip
SET_BY_EACH_RANK = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


class ForkServer:
    """A running server, started with the environment ``env`` (its import path in ``PYTHONPATH``)."""

    def __init__(self, env: dict[str, str]):
        env = {**env, "OPENBLAS_NUM_THREADS": "1"}  # numpy's BLAS, loaded with PyTorch: no thread pool to fork
        self.env, self.owner = env, os.getpid()  # a process forked from the launcher starts its own servers
        self.errors = tempfile.TemporaryFile()  # its stderr: silent unless something fails
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            env=env,
            cwd=SERVER.parent,
        )
        self.ids = itertools.count()
        self.pids: dict[int, int] = {}  # request id -> pid, as the server replied
        self.exits: dict[int, int] = {}  # request id -> exit code, as the server reported
        self.refused: dict[int, str] = {}  # request id -> why the server could not fork it
        self.chatter: list[str] = []  # lines on its stdout that are not replies (a .pth file that prints...)
        self._last_words = ""  # the end of its stderr, once closed
        self.gone = False  # the server exited, was killed, or was closed by us
        self.lock = threading.RLock()  # one conversation at a time
        self._pending = b""

    def alive(self) -> bool:
        return not self.gone and self.process.poll() is None and self.owner == os.getpid()

    def running(self) -> int:
        """How many of its ranks have not been reported exited."""
        return len(self.pids.keys() - self.exits.keys())

    def ask(self, rank: int, folder: Path, env: dict[str, str]) -> int:
        """Ask for rank ``rank`` with environment ``env``, its output in ``folder``; the request's id."""
        request_id = next(self.ids)
        self._send({"id": request_id, "rank": rank, "folder": str(folder), "env": env, "cwd": os.getcwd()})
        return request_id

    def started(self, request_id: int, by: float) -> Rank:
        """The rank of request ``request_id``, once the server has forked it (waiting until ``by``, monotonic)."""
        while request_id not in self.pids and request_id not in self.refused and not self.gone:
            if time.monotonic() > by:
                self.process.send_signal(signal.SIGUSR1)  # its stack, to its stderr
                time.sleep(1)
                self.close()
                raise RuntimeError(f"the fork server (pid {self.process.pid}) did not answer: {self.said()}")
            with self._talking():  # a moment at a time: other threads may be watching their ranks meanwhile
                self._take(wait=min(0.5, max(0.0, by - time.monotonic())))
        if request_id in self.refused:
            raise RuntimeError(f"the fork server (pid {self.process.pid}): {self.refused[request_id]}")
        if request_id not in self.pids:
            raise RuntimeError(f"the fork server (pid {self.process.pid}) exited: {self.said()}")
        return Rank(request_id, self.pids[request_id], self)

    def reports(self) -> None:
        """Take in what the server has said since the last look."""
        with self._talking():
            self._take(wait=0)

    def signal(self, request_id: int, sig: int) -> None:
        self._send({"id": request_id, "signal": int(sig)})

    def said(self) -> str:
        """The end of what the server wrote to stderr (why it failed to start, or where it hung), and any chatter."""
        if not self.errors.closed:
            size = os.fstat(self.errors.fileno()).st_size  # pread: the server's own offset in the file stays put
            self._last_words = os.pread(self.errors.fileno(), 4000, max(0, size - 4000)).decode(errors="replace")
        return "\n".join([*self.chatter, self._last_words.strip()]).strip() or "(it wrote nothing)"

    def close(self) -> None:
        """End the server: it kills its ranks and exits (killed if it does not within 10 s)."""
        with self.lock:
            if self.gone and self.process.stdin.closed:
                return
            self.gone = True
            try:
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
            self.process.stdout.close()
            self.said()  # its last words, kept
            self.errors.close()

    @contextmanager
    def _talking(self):
        with self.lock:
            try:
                yield
            except BaseException:  # interrupted midway: what the server says next cannot be trusted
                self.close()
                raise

    def _send(self, message: dict) -> None:
        with self._talking():
            if self.gone:
                return
            try:
                self.process.stdin.write(json.dumps(message).encode() + b"\n")
                self.process.stdin.flush()
            except BrokenPipeError:
                self.gone = True

    def _take(self, wait: float) -> None:
        """Read what arrives within ``wait`` s and record it: a started rank's pid, or an exit."""
        if self.gone or not select.select([self.process.stdout], [], [], wait)[0]:
            return
        chunk = os.read(self.process.stdout.fileno(), 1 << 16)
        if not chunk:  # it exited: its ranks died with it
            self.gone = True
            return
        lines, self._pending = split_lines(self._pending + chunk)
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:  # printed by something else before the server took its stdout for replies
                self.chatter.append(line.decode(errors="replace"))
                continue
            if "pid" in message:
                self.pids[message["id"]] = message["pid"]
            elif "error" in message:
                self.refused[message["id"]] = message["error"]
            else:
                self.exits[message["id"]] = message["code"]


class Rank:
    """A rank forked by a server: the part of ``subprocess.Popen``'s interface that ``launch`` uses."""

    def __init__(self, request_id: int, pid: int, server: ForkServer):
        self.id, self.pid, self.server, self.returncode = request_id, pid, server, None
        self.lost = False  # it ended because its server did

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.reports()
            gone = self.server.gone  # first: its exit may be reported just before the server's end
            if self.id in self.server.exits:
                self.returncode = self.server.exits[self.id]
            elif gone:  # the server's end is its ranks' end: it kills them, or the kernel does
                self.returncode, self.lost = -signal.SIGKILL, True
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
            self.server.signal(self.id, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_servers: dict[int, ForkServer] = {}  # rank index -> its server, in this launcher
_retired: list[ForkServer] = []  # replaced, but with ranks of a launch still running: closed when they are done
_servers_lock = threading.Lock()


def fork_servers(world_size: int, path: list[str], environ: dict[str, str]) -> list[ForkServer]:
    """The servers of ranks 0..world_size-1, started on first use, and again when what a starting interpreter
    reads (``READ_AT_START``, the import path ``path``) differs from what they started with."""
    env = {**environ, "PYTHONPATH": os.pathsep.join(path)}
    with _servers_lock:
        for server in [s for s in _retired if not s.alive() or not s.running()]:
            _retired.remove(server)
            server.close()
        for index in range(world_size):
            server = _servers.get(index)
            if server is None or not server.alive() or _at_start(server.env) != _at_start(env):
                if server is not None and server.alive():
                    _retired.append(server)  # another thread's launch may still be using it
                elif server is not None:
                    server.close()  # gone already: only its pipes and stderr file are left to close
                _servers[index] = ForkServer(env)
        return [_servers[index] for index in range(world_size)]


def _at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START) and k not in SET_BY_EACH_RANK}


def server_pids() -> set[int]:
    """The pids of this process's running fork servers: the processes of ours that outlive a launch."""
    return {s.process.pid for s in [*_servers.values(), *_retired] if s.alive()}


@atexit.register
def _close_servers() -> None:
    for server in [*_servers.values(), *_retired]:
        server.close()
