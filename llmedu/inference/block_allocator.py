"""The block allocator of PagedAttention: a free list and reference counts, as in an OS's page allocator.

vLLM (Kwon et al. 2023, sec. 4.1-4.3) cuts the KV cache into fixed-size blocks, each holding the keys
and values of ``block_size`` tokens, and gives them to sequences one at a time as they grow, the way
an operating system hands out pages of physical memory:

* ``allocate()`` pops a block off the free list (``OutOfBlocks`` when it is empty: the scheduler
  must then wait, or preempt a sequence).
* ``share(block)`` adds a reference: a forked sequence (parallel sampling, beam search) points to
  its parent's blocks instead of copying them.
* ``free(block)`` drops a reference; the block returns to the free list when the last one goes.

A block is either free (reference count 0, on the free list exactly once) or in use (count >= 1,
not on the list); ``check()`` asserts that invariant, which the tests run after every workload.

Left out: vLLM's hashing of full blocks for automatic prefix caching across requests, and the
second pool of CPU blocks that preempted sequences are swapped out to.
"""

from __future__ import annotations

__all__ = ["BlockAllocator", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """Every block is in use: free a sequence, or preempt one, before asking again."""


class BlockAllocator:
    """Hands out block numbers 0 .. num_blocks - 1 and counts who holds each."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        """A free block, now held once."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use; finish or preempt a sequence first")
        block = self._free.pop()
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> int:
        """One more holder of ``block`` (a forked sequence reading the same keys and values)."""
        self._check_in_use(block, "share")
        self.ref_counts[block] += 1
        return block

    def free(self, block: int) -> None:
        """One holder fewer; the block is free again when nobody holds it."""
        self._check_in_use(block, "free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)

    def is_shared(self, block: int) -> bool:
        self._check_in_use(block, "look up")
        return self.ref_counts[block] > 1

    def _check_in_use(self, block: int, action: str) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise IndexError(f"cannot {action} block {block!r}: blocks are numbered 0..{self.num_blocks - 1}")
        if self.ref_counts[block] == 0:
            raise ValueError(f"cannot {action} block {block}: it is free (a double free, or a stale block table)")

    def check(self) -> None:
        """Assert the invariant: each block is free (count 0, listed once) or in use (count >= 1, unlisted)."""
        listed = set(self._free)
        if len(listed) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for block, count in enumerate(self.ref_counts):
            if count < 0 or (count == 0) != (block in listed):
                raise AssertionError(
                    f"block {block} has reference count {count} but is {'' if block in listed else 'not '}on the free list"
                )
