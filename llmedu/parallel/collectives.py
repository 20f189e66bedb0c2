"""Collectives built from nothing but point-to-point ``send`` and ``recv``.

Every collective of ``torch.distributed`` can be written with two primitives: "send this buffer
to rank j" and "receive a buffer from rank i". How the messages are arranged decides the cost.
In the alpha-beta model a message of ``b`` bytes takes ``alpha + b / beta`` seconds, so:

* ``broadcast`` and ``reduce`` use a binomial tree: ``ceil(log2 N)`` rounds. In a broadcast every
  rank that has the data sends the whole tensor once a round, so the root sends it ``ceil(log2 N)``
  times; a reduce runs the tree backwards, so every rank but the root sends its partial result once
  and the root only receives. Few rounds: good for small tensors.
* ``gather`` and ``scatter`` are linear: the root exchanges one message with every other rank.
* ``reduce_scatter`` and ``all_gather`` go around a ring in ``N - 1`` steps; each step a rank
  sends one ``1/N`` chunk to its right neighbour and receives one from its left.
* ``ring_all_reduce`` is reduce-scatter followed by all-gather (Patarasuk & Yuan, 2009): each rank
  sends ``2 (N - 1) / N`` times the tensor, which grows with N but stays below 2, and no all-reduce
  sends less (bandwidth-optimal); its ``2 (N - 1)`` steps make the latency grow with N.
* ``all_to_all`` is a transpose across ranks: rank r sends piece j of its tensor to rank j, in
  ``N - 1`` pairwise steps (step s: send to ``r + s``, receive from ``r - s``), ``(N - 1) / N`` of
  its tensor, none of which another rank has (mixture-of-experts and Ulysses use it).

Chunks are ``torch.tensor_split`` pieces, so sizes need not divide. Messages go through ``p2p.py``
(``with traffic() as t:`` counts the bytes and messages this rank sends) or, for ``ring_all_reduce``,
over a ``Link`` (``link.py``: gloo moves the data, the alpha-beta model sets the time); ``trace``
records what a rank holds after every ring step. Each collective first checks (uncounted) that all
ranks passed the same shape and dtype, so a mistake raises on every rank instead of hanging.

Left out: process groups other than the whole world, pipelining chunks within a step (gloo's
``ring_chunked`` overlaps the additions with the transfers), and topology-aware algorithms
(NCCL's trees across nodes, double binary trees).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .p2p import Traffic, _exchange, _recv, _send, count_sent, traffic

if TYPE_CHECKING:
    from .link import Link

__all__ = [
    "tree_schedule",
    "ring_all_reduce_bytes",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_gather",
    "reduce_scatter",
    "ring_all_reduce",
    "all_to_all",
    "all_to_all_bytes",
    "traffic",
    "Traffic",
]

_COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add,
    "prod": torch.mul,
    "max": torch.maximum,
    "min": torch.minimum,
}


# -- the cost model ------------------------------------------------------------------------------
def ring_all_reduce_bytes(numel: int, world_size: int, element_size: int = 4) -> list[int]:
    """Bytes each rank sends in ``ring_all_reduce`` of ``numel`` elements: the cost model.

    Rank r sends every chunk but its own in the reduce-scatter, and every chunk but its right
    neighbour's (it has that one already) in the all-gather. With equal chunks that is ``2 (N - 1) / N`` of the tensor.
    """
    if world_size == 1:
        return [0]
    small, extra = divmod(numel, world_size)  # torch.tensor_split: the first `extra` chunks get one more
    sizes = [small + (r < extra) for r in range(world_size)]
    return [element_size * ((numel - sizes[r]) + (numel - sizes[(r + 1) % world_size])) for r in range(world_size)]


def all_to_all_bytes(rows: int, row_numel: int, world_size: int, element_size: int = 4) -> list[int]:
    """Bytes each rank sends in ``all_to_all`` of a (rows, ...) tensor with ``row_numel`` elements a row.

    Rank r keeps its own piece r (``tensor_split`` along dim 0) and sends every other piece once.
    """
    small, extra = divmod(rows, world_size)
    sizes = [small + (r < extra) for r in range(world_size)]
    return [element_size * row_numel * (rows - sizes[r]) for r in range(world_size)]


# -- rings on lists of chunks (views of one flat buffer) ------------------------------------------
def _step(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, count: bool, link: Link | None) -> None:
    """One ring step: ``_exchange``, or the same two messages over ``link``, which end when its model says."""
    if link is None:
        return _exchange(send, dst, recv, src, count)
    sends, recvs = [(send, dst)] if send.numel() else [], [(recv, src)] if recv.numel() else []
    if sends and count:
        count_sent(send.numel() * send.element_size(), 1)
    for work in link.post(sends, recvs):
        work.wait()


def _ring_reduce_scatter(chunks: list[torch.Tensor], combine: Callable, count=True, link=None, trace=None) -> None:
    """After N - 1 steps, ``chunks[rank]`` holds the reduction over all ranks of that chunk."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    scratch = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device)
    for step in range(n - 1):
        sent, got = (rank - step - 1) % n, (rank - step - 2) % n
        out, into = chunks[sent], chunks[got]
        incoming = scratch[: into.numel()].view_as(into)
        _step(out, right, incoming, left, count, link)
        combine(into, incoming, out=into)  # in place; the partial result travels right next step
        if trace is not None:
            trace.append(dict(phase="reduce-scatter", step=step, sent=sent, received=got, held=torch.cat(chunks)))


def _ring_all_gather(chunks: list[torch.Tensor], count: bool = True, link=None, trace=None) -> None:
    """``chunks[rank]`` is this rank's; after N - 1 steps every chunk is everywhere."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        sent, got = (rank - step) % n, (rank - step - 1) % n
        _step(chunks[sent], right, chunks[got], left, count, link)
        if trace is not None:
            trace.append(dict(phase="all-gather", step=step, sent=sent, received=got, held=torch.cat(chunks)))


# -- the collectives -------------------------------------------------------------------------------
def ring_all_reduce(
    tensor: torch.Tensor, op="sum", *, check=True, link: Link | None = None, trace=None
) -> torch.Tensor:
    """Every rank gets the reduction of every rank's ``tensor``: reduce-scatter, then all-gather.

    ``link``: send over this ``Link`` (timed by its alpha-beta model) instead of plain gloo. ``trace``: a
    list; after every step, append the phase, step, chunks sent and received, and what this rank holds.
    """
    combine = _combiner(op)
    if check:
        _shapes_everywhere(tensor, "ring_all_reduce")
    n = dist.get_world_size()
    result = tensor.detach().clone().contiguous()
    chunks = list(result.view(-1).tensor_split(n))  # N views of the flat result, sizes differ by <= 1
    _ring_reduce_scatter(chunks, combine, link=link, trace=trace)  # chunks[rank] is now complete here
    _ring_all_gather(chunks, link=link, trace=trace)  # and now every chunk is complete everywhere
    return result


def reduce_scatter(tensor: torch.Tensor, op: str = "sum", *, check: bool = True) -> torch.Tensor:
    """Rank r gets piece r (``tensor_split`` along dim 0) of the reduction of every rank's tensor."""
    combine = _combiner(op)
    if check:
        _shapes_everywhere(tensor, "reduce_scatter")
    _need_dims(tensor, "reduce_scatter")
    pieces = tensor.detach().clone().contiguous().tensor_split(dist.get_world_size(), dim=0)
    _ring_reduce_scatter(list(pieces), combine)
    return pieces[dist.get_rank()]


def all_gather(tensor: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order, on every rank.

    Sizes along dim 0 may differ between ranks (the shape check tells everyone the sizes);
    with ``check=False`` every rank must pass the same shape.
    """
    _need_dims(tensor, "all_gather")
    n = dist.get_world_size()
    shapes = _shapes_everywhere(tensor, "all_gather", dim0_may_differ=True) if check else [tensor.shape] * n
    rows = [s[0] for s in shapes]
    result = torch.empty((sum(rows), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    pieces = list(result.split(rows, dim=0))  # views, contiguous because dim 0 is outermost
    pieces[dist.get_rank()].copy_(tensor)
    _ring_all_gather(pieces)
    return result


def tree_schedule(world_size: int, root: int = 0) -> list[list[tuple[int, int]]]:
    """The rounds of a binomial-tree broadcast from ``root``: in each, a list of (sender, receiver).

    With ranks renumbered so that ``root`` is 0, in the round of ``mask`` (1, 2, 4, ...) every
    rank below ``mask`` already has the data and sends it to ``rank + mask``: the number of
    ranks that have it doubles each round, so ``ceil(log2 N)`` rounds reach everyone.
    """
    rounds, mask = [], 1
    while mask < world_size:
        rounds.append(
            [
                ((me + root) % world_size, (me + mask + root) % world_size)
                for me in range(mask)
                if me + mask < world_size
            ]
        )
        mask *= 2
    return rounds


def broadcast(tensor: torch.Tensor, src: int = 0, *, check: bool = True) -> torch.Tensor:
    """Every rank gets ``src``'s tensor (the others pass a buffer of the same shape and dtype)."""
    _root(src, "broadcast")
    if check:
        _shapes_everywhere(tensor, "broadcast")
    rank = dist.get_rank()
    result = tensor.detach().clone().contiguous()
    for pairs in tree_schedule(dist.get_world_size(), src):
        for sender, receiver in pairs:
            if rank == sender:
                _send(result, receiver)
            elif rank == receiver:
                _recv(result, sender)
    return result


def reduce(tensor: torch.Tensor, dst: int = 0, op: str = "sum", *, check: bool = True) -> torch.Tensor | None:
    """``dst`` gets the reduction of every rank's tensor (other ranks get None).

    The broadcast tree run backwards: each rank first collects the partial results of the ranks
    it would have sent to, then sends its own partial result to the rank it would have heard from.
    """
    combine = _combiner(op)
    _root(dst, "reduce")
    if check:
        _shapes_everywhere(tensor, "reduce")
    rank = dist.get_rank()
    partial = tensor.detach().clone().contiguous()
    incoming = torch.empty_like(partial)
    for pairs in reversed(tree_schedule(dist.get_world_size(), dst)):
        for parent, child in pairs:
            if rank == child:
                _send(partial, parent)
                return None  # this rank's contribution is on its way up the tree
            if rank == parent:
                _recv(incoming, child)
                combine(partial, incoming, out=partial)
    return partial


def gather(tensor: torch.Tensor, dst: int = 0, *, check: bool = True) -> list[torch.Tensor] | None:
    """``dst`` gets the list of every rank's tensor, in rank order (other ranks get None)."""
    _root(dst, "gather")
    if check:
        _shapes_everywhere(tensor, "gather")
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank != dst:
        _send(tensor.detach().contiguous(), dst)
        return None
    received = [torch.empty_like(tensor) for _ in range(n)]
    received[dst] = tensor.detach().clone()
    for other in range(n):
        if other != dst:
            _recv(received[other], other)
    return received


def scatter(tensor: torch.Tensor, src: int = 0, *, check: bool = True) -> torch.Tensor:
    """Rank r gets piece r (``tensor_split`` along dim 0) of ``src``'s tensor.

    Every rank passes a tensor of the full shape (only ``src``'s values are read), so that each
    knows the size of its piece even when the rows do not divide by the number of ranks.
    """
    _root(src, "scatter")
    _need_dims(tensor, "scatter")
    if check:
        _shapes_everywhere(tensor, "scatter")
    rank, n = dist.get_rank(), dist.get_world_size()
    pieces = tensor.detach().contiguous().tensor_split(n, dim=0)
    if rank == src:
        for other in range(n):
            if other != src:
                _send(pieces[other], other)
        return pieces[src].clone()
    mine = torch.empty_like(pieces[rank])
    _recv(mine, src)
    return mine


def all_to_all(tensor: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Piece r (``tensor_split`` along dim 0) of every rank's tensor, concatenated in rank order, on rank r.

    Every rank passes the same shape. Rank r's result is (sum over ranks of piece r's rows, ...):
    with rows divisible by N, the same shape as the input.
    """
    _need_dims(tensor, "all_to_all")
    if check:
        _shapes_everywhere(tensor, "all_to_all")
    rank, n = dist.get_rank(), dist.get_world_size()
    pieces = tensor.detach().contiguous().tensor_split(n, dim=0)  # pieces[j] goes to rank j
    received = [torch.empty_like(pieces[rank]) for _ in range(n)]  # received[q]: rank q's piece for me
    received[rank].copy_(pieces[rank])
    for step in range(1, n):  # pairwise: everyone sends and receives once per step, no rank idles
        to, frm = (rank + step) % n, (rank - step) % n
        _exchange(pieces[to].contiguous(), to, received[frm], frm)
    return torch.cat(received, dim=0)


# -- checks that fail on every rank at once ----------------------------------------------------------
_DTYPE_NAMES = "float32 float64 float16 bfloat16 int64 int32 int16 int8 uint8 bool complex64 complex128".split()
_DTYPES = [getattr(torch, name) for name in _DTYPE_NAMES]  # a dtype travels as its index in this list
_MAX_DIMS = 16


def _shapes_everywhere(tensor: torch.Tensor, what: str, dim0_may_differ: bool = False) -> list[torch.Size]:
    """Every rank's shape (in rank order), after checking that the ranks agree.

    Each rank encodes ``[ndim, dtype, *shape, -1 padding]`` in a small int64 tensor and the ring
    all-gathers them; every rank then sees the same table and raises the same error.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not dist.is_initialized():
        raise RuntimeError(f"{what}: torch.distributed is not initialised (run it through llmedu.parallel.launch)")
    n, width = dist.get_world_size(), 2 + _MAX_DIMS
    table = torch.full((n, width), -1, dtype=torch.int64, device=tensor.device)
    mine = table[dist.get_rank()]
    mine[0] = tensor.dim() if tensor.dim() <= _MAX_DIMS else -2
    mine[1] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    mine[2 : 2 + min(tensor.dim(), _MAX_DIMS)] = torch.tensor(tensor.shape[:_MAX_DIMS], dtype=torch.int64)
    _ring_all_gather(list(table), count=False)
    rows = table.tolist()
    if any(r[0] == -2 for r in rows):
        raise ValueError(f"{what}: tensors of more than {_MAX_DIMS} dimensions are not supported")
    shapes = [torch.Size(r[2 : 2 + r[0]]) for r in rows]
    described = ", ".join(f"rank {i} has {tuple(s)} {_dtype_name(r[1])}" for i, (s, r) in enumerate(zip(shapes, rows)))
    key = [(r[0], r[1], tuple(s[1:]) if dim0_may_differ else tuple(s)) for r, s in zip(rows, shapes)]
    if len(set(key)) > 1:
        rule = "the same dtype and shape except along dim 0" if dim0_may_differ else "the same shape and dtype"
        raise ValueError(f"{what}: every rank must pass {rule}, but {described}")
    return shapes


def _dtype_name(code: int) -> str:
    return _DTYPE_NAMES[code] if code < len(_DTYPES) else "another dtype"


def _combiner(op: str) -> Callable:
    if op not in _COMBINE:
        raise ValueError(f"op must be one of {sorted(_COMBINE)}, got {op!r}")
    return _COMBINE[op]


def _root(root: int, what: str) -> None:
    n = dist.get_world_size()
    if not isinstance(root, int) or not 0 <= root < n:
        raise ValueError(f"{what}: the root rank must be in 0..{n - 1}, got {root!r}")


def _need_dims(tensor: torch.Tensor, what: str) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{what}: needs a tensor with at least one dimension to split along dim 0")
