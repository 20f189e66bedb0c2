"""launch(): real processes, results in rank order, failures and hangs reported, nothing left behind.

Workers are defined inside the tests, as they would be in a notebook cell: launch must serialise
them by value. The same worker file also runs under torchrun.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from llmedu.parallel import WorkerError, launch


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _pids(folder):
    return [int(p.read_text()) for p in sorted(folder.glob("pid*"))]


def test_results_come_back_in_rank_order_with_prefixed_output(capsys):
    offset = 10  # captured by value from the enclosing scope, as a notebook global would be

    def worker(scale, *, label):
        rank = dist.get_rank()
        print(f"{label} here")
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        return {
            "rank": rank,
            "world": dist.get_world_size(),
            "value": scale * rank + offset,
            "total": total.item(),
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
        }

    results = launch(worker, 3, 2, label="worker")
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["world"] for r in results] == [3, 3, 3]
    assert [r["value"] for r in results] == [10, 12, 14]
    assert [r["total"] for r in results] == [3.0, 3.0, 3.0]
    assert len({r["pid"] for r in results} | {os.getpid()}) == 4  # three new processes
    assert all(_gone(r["pid"]) for r in results)
    out = capsys.readouterr().out
    for rank in range(3):
        assert f"[rank {rank}] worker here" in out


def test_world_of_one_and_bad_world_sizes():
    assert launch(lambda: dist.get_world_size(), 1, echo=False) == [1]
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises((ValueError, TypeError), match="world_size"):
            launch(lambda: None, bad)
    with pytest.raises(TypeError, match="worker must be a function"):
        launch("not a function", 2)


@pytest.mark.timeout(30)
def test_a_crashing_rank_raises_its_traceback_and_leaves_no_process(tmp_path):
    def worker(folder):
        rank = dist.get_rank()
        (folder / f"pid{rank}").write_text(str(os.getpid()))
        if rank == 2:
            time.sleep(0.5)
            raise ValueError("rank two cannot go on")
        dist.barrier()  # the others would wait here forever

    with pytest.raises(WorkerError, match="rank 2 failed") as info:
        launch(worker, 3, tmp_path, timeout=60, echo=False)
    assert info.value.rank == 2
    assert "ValueError: rank two cannot go on" in str(info.value)
    pids = _pids(tmp_path)
    assert len(pids) == 3 and all(_gone(p) for p in pids)


@pytest.mark.timeout(30)
def test_a_hung_collective_times_out_with_a_clear_message(tmp_path):
    def worker(folder):
        (folder / f"pid{dist.get_rank()}").write_text(str(os.getpid()))
        if dist.get_rank() == 0:
            time.sleep(60)  # never sends
        else:
            dist.recv(torch.empty(3), src=0)

    with pytest.raises(WorkerError, match="rank 1 failed") as info:
        launch(worker, 2, tmp_path, timeout=2, echo=False)
    assert "waited longer than timeout=2 s" in str(info.value)
    assert all(_gone(p) for p in _pids(tmp_path))


def test_the_same_worker_runs_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import torch, torch.distributed as dist
        from llmedu.parallel import launch, ring_all_reduce

        def worker(n):
            x = torch.full((n,), float(dist.get_rank() + 1))
            return ring_all_reduce(x).tolist()

        if __name__ == "__main__":
            results = launch(worker, 2, 3)
            print(f"rank {dist.get_rank() if dist.is_initialized() else '-'} got {results}")
    """)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("got [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]") == 2, proc.stdout
