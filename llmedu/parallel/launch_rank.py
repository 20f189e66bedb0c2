"""What each rank that ``launch`` starts runs: join the group, run the worker, leave the result in a file.

``launch`` (the launcher's side, and the whole story) has its fork server start ``main`` in a copy of a
clean interpreter, one per rank (``fork_server.py``). Besides the result, or the traceback, each rank leaves the number
of collectives it called, so that the launcher can name a rank that skipped some (``processes.blame``).
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import traceback
from pathlib import Path

import cloudpickle
import torch
import torch.distributed as dist

from .processes import TIMEOUT_HINT, watch_for_stack_requests

STARTED = "llmedu/started"  # each rank sets {STARTED}/{rank} on reaching the start-up barrier
EVERYONE_STARTED = "llmedu/everyone started"  # key of the start-up barrier in the launcher's store


def bind_gpu(backend: str) -> None:
    """With NCCL in the group, this rank's GPU is ``cuda:LOCAL_RANK``: made current before anything touches CUDA."""
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


def join_group(backend: str, timeout: float) -> None:
    """``env://`` initialisation from the variables torchrun (or our parent) set; the GPU is bound already."""
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout))


def _write(path: Path, data: bytes) -> None:
    """Write whole or not at all, so that the launcher never reads half a report."""
    part = path.with_suffix(".part")
    part.write_bytes(data)
    os.replace(part, path)


def main(folder: Path) -> None:
    """Entry point of each rank: join the group, run the worker, leave the result in ``folder``."""
    rank = int(os.environ["RANK"])
    watch_for_stack_requests(folder / f"stack{rank}.txt")
    timeout = float(os.environ["LLMEDU_TIMEOUT"])
    try:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        bind_gpu(os.environ["LLMEDU_BACKEND"])  # before unpickling: CUDA tensors in the job land on this GPU
        worker, args, kwargs = cloudpickle.loads((folder / "job.pkl").read_bytes())  # imports happen here
        _wait_for_every_rank()
        join_group(os.environ["LLMEDU_BACKEND"], timeout)
        result = worker(*args, **kwargs)
        _write(folder / f"calls{rank}.txt", _collectives_called())
        payload = cloudpickle.dumps(result)
        del worker, args, kwargs, result
        gc.collect()  # free what the worker left (a DistributedDataParallel...) while its group lives
        dist.destroy_process_group()
    except BaseException as err:  # every failure, even KeyboardInterrupt, goes back to the parent
        detail = traceback.format_exc()
        _write(folder / f"calls{rank}.txt", _collectives_called())
        if "timed out" in str(err).lower() or "timeout" in type(err).__name__.lower():
            detail += (
                f"\n{TIMEOUT_HINT}{timeout:g} s. Usually the ranks did not call the same "
                "collectives in the same order (or one rank stopped calling them)."
            )
        _write(folder / f"error{rank}.txt", detail.encode())
        sys.stdout.flush()
        os._exit(1)  # skip atexit handlers that could wait forever on a broken group
    _write(folder / f"result{rank}.pkl", payload)
    sys.stdout.flush()
    # the work is done: skip the interpreter's teardown, where C++ threads of the communication
    # library can abort the process if destroyed in the wrong order
    os._exit(0)


def _collectives_called() -> bytes:
    """How many collectives this rank has called in the default group (for ``blame``); b'' if unknown."""
    try:
        return str(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()).encode()
    except Exception:  # no group yet, or a backend that keeps no count
        return b""


def _wait_for_every_rank() -> None:
    """A start-up barrier on the launcher's store, without time limit: a rank still importing the
    worker's modules on a busy machine is worth waiting for, and the launcher notices one that dies."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=datetime.timedelta(days=1)
    )
    store.set(f"{STARTED}/{os.environ['RANK']}", "")
    if store.add(STARTED, 1) == int(os.environ["WORLD_SIZE"]):
        store.set(EVERYONE_STARTED, "")
    store.wait([EVERYONE_STARTED])
