"""Settings for every test and every notebook run by pytest: fast mode, and never any network.

This file sits at the repository root so that it also applies to `pytest notebooks/NN.ipynb`.
"""

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Set before anything imports llmedu (llmedu.runtime reads it once) and before nbval starts
# notebook kernels, which inherit this environment.
os.environ.setdefault("LLMEDU_FAST", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


# -- Workers sharing the cores ---------------------------------------------------------------------
# pytest-xdist runs the suite on several worker processes (pyproject.toml: -n auto). Each worker, and every
# kernel and rank it starts, gets its share of the cores as PyTorch threads: more threads than cores would make
# every kernel wait for threads that have no core to run on. A test marked `alone` times something: it waits
# until no other worker is inside a test, keeps the others out while it runs, and has every core.
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set by xdist before it loads this file
USER_THREADS = os.environ.get("OMP_NUM_THREADS")
SHARE = int(USER_THREADS or max(1, CORES // WORKERS))
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(SHARE)  # read by torch when it is imported, by kernels and by ranks
LOCKS = "LLMEDU_PYTEST_LOCKS"  # the folder of the workers' lock files (below)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4 (each may start a kernel and a few ranks of its own)."""
    return min(CORES, 4)


@contextlib.contextmanager
def _turn(folder: Path, alone: bool):
    """A readers-writer lock between the workers, on two files. Every test holds ``share`` shared; an
    ``alone`` test holds it exclusively. ``gate`` is a turnstile: an ``alone`` test that is waiting holds it, so
    that the other workers' next tests queue behind it instead of keeping ``share`` busy for ever."""
    import fcntl  # POSIX only, as is the launcher of our ranks

    with open(folder / "gate", "a") as gate, open(folder / "share", "a") as share:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(share, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the files releases both locks


@contextlib.contextmanager
def _every_core():
    """While a test runs alone: every core for PyTorch in this worker and in what it starts."""
    os.environ.pop("OMP_NUM_THREADS")
    if USER_THREADS:
        os.environ["OMP_NUM_THREADS"] = USER_THREADS
    if torch := sys.modules.get("torch"):
        torch.set_num_threads(int(USER_THREADS or CORES))
    try:
        yield
    finally:
        os.environ["OMP_NUM_THREADS"] = str(SHARE)
        if torch := sys.modules.get("torch"):  # perhaps imported by the test
            torch.set_num_threads(SHARE)


def pytest_configure(config):
    """The workers' lock files live in a folder that the main process makes and removes."""
    if not hasattr(config, "workerinput") and (config.getoption("numprocesses", None) or 0) > 1:
        os.environ[LOCKS] = tempfile.mkdtemp(prefix="llmedu-pytest-")  # the workers inherit it


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and LOCKS in os.environ:
        shutil.rmtree(os.environ.pop(LOCKS), ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not (hasattr(item.config, "workerinput") and LOCKS in os.environ):  # one process runs every test
        return (yield)
    alone = item.get_closest_marker("alone") is not None
    with _turn(Path(os.environ[LOCKS]), alone), _every_core() if alone else contextlib.nullcontext():
        return (yield)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of many tiny ops: on a busy 2-core CPU, two threads wait on
    each other. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch  # here, so that the environment above is set before anything heavy is imported

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
