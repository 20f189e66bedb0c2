"""launch() faults: a module planted in the working folder never runs in the ranks; a rank that skips
collectives is the one named, not the peer that timed out waiting for it."""

import sys

import psutil
import pytest
import torch
import torch.distributed as dist

from llmedu.parallel import WorkerError, launch
from llmedu.parallel.forked_ranks import server_pids


@pytest.fixture(autouse=True)
def no_process_left_behind():
    yield
    servers = server_pids()  # the launcher's fork servers outlive a launch by design; their ranks must not
    family = psutil.Process().children(recursive=True)
    left = [p for p in family if p.status() != psutil.STATUS_ZOMBIE and p.pid not in servers]
    assert not left, f"processes left running: {left}"


def test_a_module_planted_in_the_working_folder_does_not_run_in_the_ranks(tmp_path, monkeypatch):
    marker = tmp_path / "planted-code-ran"
    for name in ("cloudpickle", "torch", "llmedu", "sitecustomize"):  # what a rank imports first
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n")
    (tmp_path / "helper_for_ranks.py").write_text(
        "import torch.distributed as dist\n\ndef worker():\n    return dist.get_rank() * 10\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), *sys.path])  # as a notebook's kernel has it
    from helper_for_ranks import worker  # a notebook's helper beside it: still works in the ranks

    assert launch(worker, 2, echo=False) == [0, 10]
    assert not marker.exists(), f"planted modules ran in the ranks: {marker.read_text()}"
    monkeypatch.delitem(sys.modules, "helper_for_ranks")


@pytest.mark.timeout(120)
def test_a_rank_that_skips_two_all_reduces_is_named_not_the_peer_that_waited():
    def worker():
        t = torch.ones(3)
        for _ in range(5 if dist.get_rank() != 1 else 3):  # rank 1 skips two
            dist.all_reduce(t)
        return t.tolist()

    with pytest.raises(WorkerError, match="rank 1 fell behind its peers") as info:
        launch(worker, 2, timeout=3, echo=False)
    assert info.value.rank == 1
    assert "it called 3 collectives where rank 0 called 4" in str(info.value)
    assert "Rank 0's error:\nTraceback" in str(info.value)  # what rank 0 saw comes with it


@pytest.mark.timeout(120)
def test_with_three_ranks_the_one_that_skipped_is_named():
    def worker():
        t = torch.ones(3)
        for _ in range(5 if dist.get_rank() != 2 else 3):
            dist.all_reduce(t)

    with pytest.raises(WorkerError, match="rank 2 fell behind its peers") as info:
        launch(worker, 3, timeout=3, echo=False)
    assert "it called 3 collectives where rank" in str(info.value) and "rank 2: 3)" in str(info.value)
