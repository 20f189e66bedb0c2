"""Many processes, one model: the distributed arc of the course.

    launch          N real processes from a notebook cell (or torchrun), each rank's result back
    collectives     broadcast, reduce, gather, scatter, all-gather, reduce-scatter, ring all-reduce,
                    built from nothing but send and recv, with the bytes each rank sends counted
    data_parallel   naive data parallelism and DDP from scratch (buckets, overlap, no_sync)
"""

from .collectives import (
    all_gather,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    ring_all_reduce,
    scatter,
    traffic,
)
from .launch import WorkerError, launch

__all__ = [
    "launch",
    "WorkerError",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_gather",
    "reduce_scatter",
    "ring_all_reduce",
    "traffic",
]
