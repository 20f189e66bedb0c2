"""A throwaway JupyterLab server on loopback, for driving lessons in a real browser.

    with JupyterLab(root_dir=tmp / "notebooks", home=tmp / "lab") as lab:
        page.goto(lab.url("lab/tree/00_hardware.ipynb"))

The server is isolated from whoever runs the tests: it listens on 127.0.0.1 only, on a free port,
behind a random token; its configuration, runtime, settings, workspace and IPython directories are
fresh ones under ``home``, so nothing in ``~/.jupyter`` changes what is tested and nothing is left
there. Its kernels run this checkout's ``llmedu`` (the repository root leads ``PYTHONPATH``) in
fast mode (``LLMEDU_FAST=1``), with the Hugging Face hub offline.

Shutting down never leaves a process behind: the server is asked to stop (which shuts its kernels
down), then terminated, then killed, and any of its descendants still alive after that (a kernel
runs in a session of its own, so it is not in the server's process group) are killed one by one.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]

# User settings that make the page deterministic: every cell is attached to the DOM (the default
# windowing leaves cells outside the viewport unrendered, so their outputs could not be checked),
# and JupyterLab neither asks about nor fetches news.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}


def free_loopback_port() -> int:
    """A TCP port that nothing listens on at 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """One JupyterLab server process serving ``root_dir``; a context manager."""

    def __init__(self, root_dir: Path, home: Path, startup_timeout: float = 60.0):
        if not Path(root_dir).is_dir():
            raise NotADirectoryError(f"root_dir {root_dir} is not a directory")
        self.root_dir = Path(root_dir)
        self.home = Path(home)
        self.startup_timeout = startup_timeout
        self.port = free_loopback_port()
        self.token = secrets.token_hex(24)
        self.log_path = self.home / "jupyterlab.log"
        self.process: subprocess.Popen | None = None

    def url(self, path: str = "lab") -> str:
        """The address of ``path`` on this server, with the token (the browser keeps it as a cookie)."""
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}?token={self.token}"

    def api(self, path: str, method: str = "GET", timeout: float = 5.0):
        """Call the server's REST API; returns the decoded JSON (None for an empty answer)."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/api/{path.lstrip('/')}",
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        return json.loads(body) if body else None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> JupyterLab:
        for name in ("config", "data", "runtime", "settings", "workspaces", "ipython"):
            (self.home / name).mkdir(parents=True, exist_ok=True)
        for name, values in SETTINGS.items():
            path = self.home / "settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))

        env = dict(os.environ)
        env.update(
            LLMEDU_FAST="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            JUPYTER_CONFIG_DIR=str(self.home / "config"),
            JUPYTER_DATA_DIR=str(self.home / "data"),
            JUPYTER_RUNTIME_DIR=str(self.home / "runtime"),
            JUPYTER_PLATFORM_DIRS="1",
            JUPYTERLAB_SETTINGS_DIR=str(self.home / "settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(self.home / "workspaces"),
            IPYTHONDIR=str(self.home / "ipython"),
        )
        command = [
            sys.executable, "-m", "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--ServerApp.root_dir={self.root_dir}",
            f"--IdentityProvider.token={self.token}",
            "--ServerApp.allow_remote_access=False",
            "--ServerApp.allow_root=True",  # CI containers often run as root; harmless otherwise
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, cwd=self.root_dir, env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"JupyterLab exited with status {self.process.returncode} before it was ready; "
                    f"its log ends with:\n{self.log_tail()}"
                )
            try:
                self.api("status", timeout=2.0)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"JupyterLab did not answer on port {self.port} within {self.startup_timeout:.0f} s; "
            f"its log ends with:\n{self.log_tail()}"
        )

    def stop(self) -> list[str]:
        """Stop the server and every process it started. Returns what had to be killed (for a report)."""
        if self.process is None:
            return []
        process, self.process = self.process, None
        try:
            family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        forced = []
        if process.poll() is None:
            try:
                self.api("shutdown", method="POST")  # shuts the kernels down, then the server
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not answering: the signals below still stop it
            for sig, grace in ((None, 15.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                if sig is not None:
                    forced.append(f"server ({sig.name})")
                    try:
                        os.killpg(process.pid, sig)
                    except ProcessLookupError:
                        pass  # it exited between the wait and the signal
                try:
                    process.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        process.wait()  # reap it, whatever happened above
        _, alive = psutil.wait_procs([p for p in family if p.pid != process.pid], timeout=10.0)
        for leftover in alive:
            try:
                forced.append(f"pid {leftover.pid} ({' '.join(leftover.cmdline()[:4])})")
                leftover.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5.0)
        return forced

    def __enter__(self) -> JupyterLab:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
