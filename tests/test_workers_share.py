"""conftest.py's sharing of the cores between pytest-xdist's workers: the lock that lets a test marked ``alone``
run with no other test beside it, and the threads it gets meanwhile.

flock's locks belong to an open file, so two opens in one process contend as two workers would.
"""

import fcntl
import os
from pathlib import Path

import pytest


@pytest.fixture
def root(request):
    """The repository's conftest.py, as pytest loaded it (a plugin)."""
    path = str(Path(__file__).resolve().parents[1] / "conftest.py")
    return next(p for p in request.config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == path)


def can_lock(path: Path, how: int) -> bool:
    """Whether another worker could take ``how`` on ``path`` now (without waiting)."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, how | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def test_tests_share_the_machine_and_a_test_alone_keeps_every_other_out(root, tmp_path):
    with root._turn(tmp_path, alone=False):
        assert can_lock(tmp_path / "share", fcntl.LOCK_SH)  # another worker's test runs beside it
        assert not can_lock(tmp_path / "share", fcntl.LOCK_EX)  # a test alone waits for it to end
        assert can_lock(tmp_path / "gate", fcntl.LOCK_EX)  # the gate is free again once it is in
    with root._turn(tmp_path, alone=True):
        assert not can_lock(tmp_path / "share", fcntl.LOCK_SH)  # no test beside it
        assert not can_lock(tmp_path / "gate", fcntl.LOCK_EX)  # and the next ones queue at the gate
    assert can_lock(tmp_path / "share", fcntl.LOCK_EX) and can_lock(tmp_path / "gate", fcntl.LOCK_EX)


def test_a_test_alone_has_every_core_then_the_worker_has_its_share_again(root, monkeypatch):
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setattr(root, "SHARE", 1)
    monkeypatch.setattr(root, "USER_THREADS", None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        with root._every_core():
            assert "OMP_NUM_THREADS" not in os.environ  # a kernel or rank started now sizes itself
            assert torch.get_num_threads() == root.CORES
        assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_auto_gives_one_worker_per_core_at_most_four(root):
    assert root.pytest_xdist_auto_num_workers(None) == min(root.CORES, 4)


@pytest.mark.alone
def test_a_test_marked_alone_runs_with_every_core(root):
    import torch

    if os.environ.get(root.LOCKS):  # under xdist, with its lock folder (else nothing is shared)
        assert torch.get_num_threads() == int(root.USER_THREADS or root.CORES)
        assert os.environ.get("OMP_NUM_THREADS") == root.USER_THREADS  # what the user set, or unset
