"""What a GPU user sees: the rounding rules of PyTorch's CUDA caching allocator, applied to a list of tensors.

On a GPU, PyTorch does not call ``cudaMalloc`` for every tensor. Its caching allocator
(``c10/cuda/CUDACachingAllocator.cpp``; PyTorch's documentation, "CUDA semantics", section "Memory
management") asks the driver for *segments* and cuts them into *blocks*:

* every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``): a block.
  ``torch.cuda.memory_allocated()`` is the sum of the live blocks;
* a block of at most 1 MiB (``kSmallSize``) comes from the small pool, whose segments are 2 MiB
  (``kSmallBuffer``); a larger one comes from the large pool, where a request under 10 MiB
  (``kMinLargeAlloc``) gets a 20 MiB segment (``kLargeBuffer``) and a larger one a segment rounded up to
  2 MiB (``kRoundLarge``);
* a new request first takes the smallest free block of its pool that fits (best fit), split when the rest
  is at least 512 bytes (small pool) or more than 1 MiB (large pool).
  ``torch.cuda.memory_reserved()`` is the sum of the segments.

``allocate`` replays a sequence of allocations under these rules. What it leaves out: frees and the reuse of
freed blocks (so fragmentation, which depends on the order of frees), streams, ``PYTORCH_CUDA_ALLOC_CONF``
options (``max_split_size_mb``, ``roundup_power2_divisions``, expandable segments), memory that neither
counter includes (the CUDA context and the kernels' code), and the libraries' workspaces, which ATen takes from
this same allocator: cuBLAS's (``CublasHandlePool.cpp``, ``getNewWorkspace``) stays allocated, one per handle
and stream (pytorch/pytorch#95668), and cuDNN's, so both show in ``memory_reserved`` and ``memory_allocated``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIN_BLOCK", "SMALL_SIZE", "SMALL_SEGMENT", "block_bytes", "segment_bytes", "Pools", "allocate"]

MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: the largest block of the small pool
SMALL_SEGMENT = 2 << 20  # kSmallBuffer: the segments of the small pool
LARGE_SEGMENT = 20 << 20  # kLargeBuffer: the segment of a large request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests get a segment of their own, rounded up to this


def _check_bytes(nbytes) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"a tensor's size in bytes must be an int >= 0, got {nbytes!r}")


def block_bytes(nbytes: int) -> int:
    """The block a request of ``nbytes`` occupies (what ``memory_allocated`` adds): at least 512, a multiple of 512."""
    _check_bytes(nbytes)
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_bytes(block: int) -> int:
    """The segment ``cudaMalloc``'d when no cached block fits a block of ``block`` bytes."""
    _check_bytes(block)
    if block <= SMALL_SIZE:
        return SMALL_SEGMENT
    if block < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-block // ROUND_LARGE) * ROUND_LARGE


@dataclass
class Pools:
    """After a sequence of allocations: the counters a GPU user reads, and the free blocks left in the segments."""

    requested: int  # the tensors' own bytes (what the tracker counts on a CPU)
    allocated: int  # torch.cuda.memory_allocated()
    reserved: int  # torch.cuda.memory_reserved()
    segments: int  # how many cudaMalloc calls
    free_blocks: list[int]  # cached but unused: reserved - allocated, as blocks


def allocate(sizes: list[int]) -> Pools:
    """Allocate tensors of ``sizes`` bytes in order, none freed, as the caching allocator would."""
    free = {True: [], False: []}  # small pool?, then the sizes of its free blocks
    requested = allocated = reserved = segments = 0
    for nbytes in sizes:
        block = block_bytes(nbytes)
        small = block <= SMALL_SIZE
        fits = [b for b in free[small] if b >= block]
        if fits:
            chosen = min(fits)  # best fit
            free[small].remove(chosen)
        else:
            chosen = segment_bytes(block)
            reserved, segments = reserved + chosen, segments + 1
        rest = chosen - block
        if (small and rest >= MIN_BLOCK) or (not small and rest > SMALL_SIZE):
            free[small].append(rest)  # split: the rest stays cached for later requests
        else:
            block = chosen  # too small a rest to split: the whole block is handed out
        requested, allocated = requested + nbytes, allocated + block
    return Pools(requested, allocated, reserved, segments, sorted(free[True] + free[False]))
