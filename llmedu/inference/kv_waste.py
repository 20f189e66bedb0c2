"""Where the KV-cache memory goes: paged blocks against contiguous reservations, on one schedule.

vLLM (Kwon et al. 2023, sec. 3 and Fig. 2) sorts the slots of a contiguous KV cache into:

    used                      slots holding the keys/values of tokens that exist
    reservation               slots kept for tokens the sequence will generate later
    internal fragmentation    slots reserved (up to the maximum length) that it will never use
    external fragmentation    free memory between reservations, in holes too small for a request

These functions replay the schedule a ``ContinuousBatcher`` recorded (which sequences were alive
at each step, and how long they were) under two policies for a contiguous cache, and measure the
paged cache that actually ran. Waste is counted in slot-steps (slots x steps they were held), so
a long-lived waste weighs more than a brief one.

Left out: the memory of activations and of the model; the contiguous caches are replayed on the
paged run's schedule, not scheduled on their own (a real contiguous server would admit fewer).
"""

from __future__ import annotations

__all__ = ["paged_waste", "final_lengths", "contiguous_breakdown", "FirstFitArena", "external_fragmentation"]


def paged_waste(history: list[dict]) -> float:
    """Fraction of allocated slot-steps of the paged run that held no token (half-empty last blocks)."""
    allocated = sum(r["allocated"] for r in history)
    return 1 - sum(r["filled"] for r in history) / allocated if allocated else 0.0


def final_lengths(history: list[dict]) -> dict[int, int]:
    """The longest each sequence ever got in the cache (its length when it finished)."""
    final: dict[int, int] = {}
    for record in history:
        for seq, length in record["lengths"].items():
            final[seq] = max(final.get(seq, 0), length)
    return final


def contiguous_breakdown(history: list[dict], reserve: dict[int, int] | int) -> dict[str, float]:
    """Fractions of a contiguous cache's slot-steps that are used, reserved, and fragmented inside.

    ``reserve``: slots held per sequence: one number (the model's maximum length) or, per sequence,
    its prompt + max_new_tokens. Every sequence stores its own copy of a shared prompt.
    """
    final = final_lengths(history)
    used = reserved_later = never = 0
    for record in history:
        for seq, length in record["lengths"].items():
            size = reserve if isinstance(reserve, int) else reserve[seq]
            if final[seq] > size:
                raise ValueError(f"sequence {seq} reached {final[seq]} tokens, more than the {size} reserved for it")
            used += length
            reserved_later += final[seq] - length
            never += size - final[seq]
    total = used + reserved_later + never
    return {"used": used / total, "reservation": reserved_later / total, "internal fragmentation": never / total}


class FirstFitArena:
    """One contiguous buffer of ``capacity`` slots, handed out first-fit as [start, start + size)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.chunks: dict[int, tuple[int, int]] = {}  # owner -> (start, size)

    def holes(self) -> list[int]:
        """Sizes of the free gaps, in address order."""
        edges = sorted(self.chunks.values()) + [(self.capacity, 0)]
        gaps, cursor = [], 0
        for start, size in edges:
            if start > cursor:
                gaps.append(start - cursor)
            cursor = start + size
        return gaps

    def allocate(self, owner: int, size: int) -> bool:
        """Place ``size`` slots in the first gap that holds them; False if no gap does."""
        cursor = 0
        for start, length in sorted(self.chunks.values()) + [(self.capacity, 0)]:
            if start - cursor >= size:
                self.chunks[owner] = (cursor, size)
                return True
            cursor = start + length
        return False

    def free(self, owner: int) -> None:
        del self.chunks[owner]


def external_fragmentation(history: list[dict], reserve: dict[int, int], capacity: int) -> dict[str, float]:
    """Replay the schedule in a first-fit arena of ``capacity`` slots with exact reservations.

    Each sequence asks for ``reserve[seq]`` slots (its prompt + max_new_tokens) when it appears and
    asks again at every step until it gets them. Returns the share of sequences that were refused at
    least once although the free slots together would have held them (refused for fragmentation
    alone), and the mean share of the arena that was free but stranded in too-small gaps then.
    """
    arena, refused, stranded = FirstFitArena(capacity), set(), []
    for record in history:
        alive = set(record["lengths"])
        for seq in [s for s in arena.chunks if s not in alive]:
            arena.free(seq)
        for seq in sorted(alive - set(arena.chunks)):
            if not arena.allocate(seq, reserve[seq]):
                free = capacity - sum(size for _, size in arena.chunks.values())
                if free >= reserve[seq]:
                    refused.add(seq)
                    stranded.append(free / capacity)
    return {
        "sequences refused for fragmentation": len(refused) / len(reserve) if reserve else 0.0,
        "free memory stranded then": sum(stranded) / len(stranded) if stranded else 0.0,
    }
