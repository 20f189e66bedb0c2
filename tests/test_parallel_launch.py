"""launch(): real processes, results in rank order, failures and hangs reported, nothing left behind.

Workers are defined inside the tests, as they would be in a notebook cell: launch must serialise
them by value. The same worker file also runs under torchrun. Each fault test injects the fault
(an exception, SIGKILL, ``os._exit``, a rank that stalls, a launcher that is killed) and checks
that the error names the rank to blame and that no process of ours survives it.
"""

import inspect
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import cloudpickle
import psutil
import pytest
import torch
import torch.distributed as dist

from llmedu.parallel import WorkerError, forked_ranks, launch
from llmedu.parallel.forked_ranks import ForkServer, server_pids
from llmedu.parallel.launch import default_backend


@pytest.fixture(autouse=True)
def no_process_left_behind():
    yield
    servers = server_pids()  # the launcher's fork servers outlive a launch by design; their ranks must not
    family = psutil.Process().children(recursive=True)
    left = [p for p in family if p.status() != psutil.STATUS_ZOMBIE and p.pid not in servers]
    assert not left, f"processes left running: {left}"


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


def test_the_backend_fits_the_gpus(monkeypatch):
    # NCCL cannot put two ranks on one GPU: asked for anyway, a clear error before any process starts
    gpus = torch.cuda.device_count()
    with pytest.raises(
        ValueError, match=f"needs a GPU for each of the {gpus + 1} ranks on this machine, which has {gpus}"
    ):
        launch(lambda: None, gpus + 1, backend="nccl")
    with pytest.raises(ValueError, match=f"{gpus + 1} ranks on this machine, which has {gpus}"):
        launch(lambda: None, gpus + 1, backend="cpu:gloo,cuda:nccl")  # the default's string, given explicitly
    with pytest.raises(ValueError, match="backend must be 'gloo', 'nccl' or 'cpu:gloo,cuda:nccl'"):
        launch(lambda: None, 2, backend="mpi")
    # the default: gloo for CPU tensors, with NCCL beside it for CUDA tensors only when each rank has a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert default_backend(2) == "cpu:gloo,cuda:nccl"
    assert default_backend(3) == "gloo"
    # a launcher that sets RANK and WORLD_SIZE but not LOCAL_WORLD_SIZE: no guess at how many ranks share the GPUs
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="not LOCAL_WORLD_SIZE.*pass backend="):
        launch(lambda: None, 2)


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "death, words",
    [("sigkill", "died, killed by signal 9 (SIGKILL"), ("exit", "died, exited with code 3, leaving no traceback")],
)
def test_a_rank_that_dies_without_a_traceback_is_blamed_not_the_survivor(tmp_path, death, words):
    def worker(folder):
        if dist.get_rank() == 1:
            print("about to die")
            (folder / "died_at").write_text(str(time.time()))
            if death == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
            os._exit(3)
        dist.barrier()  # rank 0 then fails with "connection closed by peer": a consequence

    with pytest.raises(WorkerError) as info:
        launch(worker, 2, tmp_path, echo=False)
    reported = time.time() - float((tmp_path / "died_at").read_text())
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 " + words), str(info.value)
    assert "Its last output:\nabout to die" in str(info.value)
    assert reported < 10  # noticed when it happened, not when a collective timed out


def test_the_default_collective_timeout_is_30_seconds():
    assert inspect.signature(launch).parameters["timeout"].default == 30.0


@pytest.mark.timeout(60)
def test_a_rank_stalled_outside_collectives_is_shown_where_it_stalls(tmp_path):
    def worker():
        if dist.get_rank() == 1:
            time.sleep(1e6)  # stalls outside any collective: only its peer's timeout can tell
        dist.barrier()

    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 0 failed") as info:
        launch(worker, 2, timeout=2, echo=False)
    message = str(info.value)
    assert "waited longer than timeout=2 s" in message
    assert "Rank 1 was still running when it gave up:" in message
    assert "time.sleep(1e6)" not in message and "in worker" in message  # its Python stack
    assert time.monotonic() - start < 40


@pytest.mark.timeout(60)
def test_a_deadline_stops_ranks_that_never_finish_and_names_them():
    def worker():
        if dist.get_rank() > 0:
            time.sleep(1e6)  # rank 0 returns; nobody waits for the others, so no timeout fires
        return dist.get_rank()

    with pytest.raises(WorkerError, match="rank 1 did not finish in time") as info:
        launch(worker, 3, deadline=4, echo=False)
    assert "deadline=4 s after start-up reached with ranks 1, 2 still running" in str(info.value)
    assert "[rank 2]" in str(info.value) and "in worker" in str(info.value)
    with pytest.raises(ValueError, match="deadline"):
        launch(worker, 2, deadline=0)


@pytest.mark.timeout(60)
def test_a_rank_still_running_long_after_its_peers_returned_is_stopped_and_named():
    """No deadline, no collective: a rank that sleeps after rank 0 returned is caught by default,
    ``timeout`` seconds after the first result (the ranks run one program)."""

    def worker():
        if dist.get_rank() == 1:
            time.sleep(1e6)
        return dist.get_rank()

    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 did not finish in time") as info:
        launch(worker, 2, timeout=3, echo=False)
    assert "rank 1 still running 3 s (timeout) after another rank finished with its result" in str(info.value)
    assert "in worker" in str(info.value)  # its stack
    assert time.monotonic() - start < 40


@pytest.mark.timeout(90)
def test_ranks_die_with_their_launcher_and_the_next_launch_removes_its_folder(tmp_path):
    script = textwrap.dedent(f"""
        import os, time
        from pathlib import Path
        from llmedu.parallel import launch

        def worker():
            Path({str(tmp_path)!r}, f"pid{{os.environ['RANK']}}").write_text(str(os.getpid()))
            time.sleep(1e6)

        launch(worker, 2)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL)
    while len(list(tmp_path.glob("pid*"))) < 2:  # both ranks are running the worker
        assert launcher.poll() is None, "the launcher exited early"
        time.sleep(0.1)
    ranks = [psutil.Process(pid) for pid in _pids(tmp_path)]
    (folder,) = Path(tempfile.gettempdir()).glob(f"llmedu-launch-{launcher.pid}-*")
    launcher.kill()  # as a restarted kernel or the OOM killer would: no cleanup runs
    launcher.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"ranks outlived their launcher: {alive}"
    # its folder is left behind until the next launch (any launch on this machine) removes it
    assert launch(lambda: 7, 1, echo=False) == [7]
    assert not folder.exists()


@pytest.mark.timeout(60)
def test_without_prctl_a_rank_exits_when_its_server_is_gone(tmp_path):
    # the portable fallback of die_with: a thread notices that the rank was re-parented
    child_code = (
        "import sys, threading, time\n"
        "from llmedu.parallel.fork_server import exit_when_orphaned\n"
        "threading.Thread(target=exit_when_orphaned, args=(int(sys.argv[1]), 0.05), daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "time.sleep(1e6)\n"
    )
    parent_code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {child_code!r}, str(os.getpid())], stdout=subprocess.PIPE)
        assert child.stdout.readline() == b"ready\\n"
        open({str(tmp_path / "child")!r}, "w").write(str(child.pid))
        time.sleep(1e6)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    while not (tmp_path / "child").exists():
        time.sleep(0.05)
    child = psutil.Process(int((tmp_path / "child").read_text()))
    parent.kill()  # the child is re-parented; nobody will ever read its result
    parent.wait()
    gone, alive = psutil.wait_procs([child], timeout=20)
    assert not alive or child.status() == psutil.STATUS_ZOMBIE, "an orphaned rank kept running"


@pytest.mark.timeout(90)
def test_a_fork_server_killed_mid_launch_is_named_and_the_next_launch_starts_another(tmp_path):
    def worker():
        Path(tmp_path, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
        dist.barrier()
        if dist.get_rank() == 1:
            os.kill(os.getppid(), signal.SIGKILL)  # rank 1's fork server, as the out-of-memory killer would pick it
        time.sleep(1e6)

    with pytest.raises(WorkerError, match=r"rank 1 lost its fork server:\nThe server \(pid \d+\) killed by signal 9"):
        launch(worker, 2, echo=False)
    gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in _pids(tmp_path) if not _gone(pid)], timeout=10)
    assert not alive, f"ranks outlived the launch: {alive}"
    assert launch(lambda: dist.get_rank(), 2, echo=False) == [0, 1]


def _asking_a_server_that_imports_from(folder):
    """A fork server whose import path starts with ``folder`` (where a test puts a stub PyTorch), asked for rank 0."""
    server = ForkServer({**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *sys.path])})
    return server, server.ask(0, folder, dict(os.environ))


@pytest.mark.timeout(60)
def test_a_fork_server_that_cannot_start_says_why(tmp_path):
    (tmp_path / "torch.py").write_text("raise ImportError('this torch is broken')\n")
    server, request = _asking_a_server_that_imports_from(tmp_path)
    with pytest.raises(RuntimeError, match="(?s)fork server .* exited: .*this torch is broken"):
        server.started(request, time.monotonic() + 30)
    server.close()


@pytest.mark.timeout(60)
def test_a_fork_server_with_a_thread_running_refuses_to_fork(tmp_path):
    (tmp_path / "torch").mkdir()  # a PyTorch whose import starts a thread, as a BLAS pool would
    (tmp_path / "torch" / "__init__.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(1e6,), daemon=True).start()\n"
    )
    (tmp_path / "torch" / "distributed.py").write_text("")
    server, request = _asking_a_server_that_imports_from(tmp_path)
    with pytest.raises(RuntimeError, match="runs 2 threads after importing PyTorch"):
        server.started(request, time.monotonic() + 30)
    server.close()


@pytest.mark.timeout(60)
def test_a_fork_server_that_never_answers_is_named_with_its_stack(tmp_path):
    (tmp_path / "torch.py").write_text("import time\ntime.sleep(1e6)  # an import that never ends\n")
    server, request = _asking_a_server_that_imports_from(tmp_path)
    with pytest.raises(RuntimeError, match="(?s)fork server .* did not answer: .*torch.py"):
        server.started(request, time.monotonic() + 5)
    assert server.process.poll() is not None


def test_a_users_blas_threads_do_not_stop_the_servers(monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")  # common on shared machines; the servers keep theirs at 1
    assert launch(lambda: dist.get_rank(), 2, echo=False) == [0, 1]


@pytest.mark.timeout(60)
def test_a_fork_server_whose_stdin_ends_stops_its_ranks_and_exits(tmp_path):
    server = ForkServer({**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    (tmp_path / "job.pkl").write_bytes(cloudpickle.dumps((time.sleep, (1e6,), {})))
    # rank 0 of 2: it waits at the start-up barrier for a rank 1 that never comes
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "LLMEDU_BACKEND": "gloo", "LLMEDU_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}  # fmt: skip
    rank = psutil.Process(server.started(server.ask(0, tmp_path, env), time.monotonic() + 30).pid)
    store.wait(["llmedu/started/0"])
    server.process.stdin.close()  # what the kernel does when the launcher dies
    assert server.process.wait(timeout=20) == 0
    gone, alive = psutil.wait_procs([rank], timeout=10)
    assert not alive or rank.status() == psutil.STATUS_ZOMBIE
    server.process.stdout.close()
    del store


@pytest.mark.timeout(90)
def test_ranks_differ_as_separate_interpreters_and_see_settings_changed_between_launches(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)

    def worker():  # its server is its parent
        return hash("a string"), str(dist.get_debug_level()), os.getppid()

    first = launch(worker, 2, echo=False)
    assert first[0][0] != first[1][0], "ranks share a string-hash seed, as no two torchrun ranks do"
    servers = {server for *_, server in first}
    assert len(servers) == 2 and all(psutil.Process(pid).num_threads() == 1 for pid in servers)  # idle at a fork
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # read when torch.distributed is imported
    again = launch(worker, 2, echo=False)
    assert [debug for _, debug, _ in again] == ["DebugLevel.DETAIL"] * 2
    assert not servers & {server for *_, server in again}, "servers that imported PyTorch before the change"


@pytest.mark.timeout(90)
def test_an_interrupted_start_closes_the_server_and_the_next_launch_works(monkeypatch):
    assert launch(lambda: 1, 2, echo=False) == [1, 1]
    take = forked_ranks.ForkServer._take

    def interrupted(self, wait):  # Ctrl-C while waiting for a server's reply
        monkeypatch.setattr(forked_ranks.ForkServer, "_take", take)
        raise KeyboardInterrupt

    monkeypatch.setattr(forked_ranks.ForkServer, "_take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch(lambda: 2, 2, echo=False)
    assert launch(lambda: dist.get_rank(), 2, echo=False) == [0, 1]


@pytest.mark.timeout(90)
def test_launches_from_two_threads_at_once_each_get_their_own_results():
    results = {}

    def launching(value):
        results[value] = launch(lambda: value * 10 + dist.get_rank(), 2, echo=False)

    threads = [threading.Thread(target=launching, args=(v,)) for v in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {1: [10, 11], 2: [20, 21]}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_rank_that_never_starts_is_named_with_its_stack(tmp_path, monkeypatch):
    """Start-up has its own bound: a worker module that blocks at import time in one rank (only the
    children have RANK set, so the launcher itself imports it at once) is caught after ``startup`` s. 20 s:
    rank 0 must get through importing torch meanwhile, even on a loaded 2-core machine."""
    (tmp_path / "blocks_in_rank_1.py").write_text(
        "import os, time\n"
        "if os.environ.get('RANK') == '1':\n"
        "    time.sleep(1e6)  # a lock, a prompt, a server that never answers\n"
        "def worker():\n"
        "    return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from blocks_in_rank_1 import worker

    with pytest.raises(WorkerError, match="rank 1 did not start in time") as info:
        launch(worker, 2, startup=20, echo=False)
    message = str(info.value)
    assert "rank 1 had not reached the start-up barrier 20 s (startup) after launch" in message
    assert "[rank 1]" in message and "blocks_in_rank_1.py" in message  # its stack points at the import
    with pytest.raises(ValueError, match="startup"):
        launch(worker, 2, startup=0)
