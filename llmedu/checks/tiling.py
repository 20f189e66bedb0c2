"""Graders of lesson 17's tiled exercises: a logsumexp read block by block, attention tile by tile.

check_online_logsumexp(fn)   fn(x, block) -> logsumexp over the last dim, one pass over blocks of `block` columns
check_tiled_attention(fn)    fn(q, k, v, block) -> softmax(q k^T / sqrt(D)) v, tile by tile, one pass over the keys

Both grade the method as well as the value. Every ATen op the function runs is recorded
(``torch.utils._python_dispatch.TorchDispatchMode``): the shapes it reads and makes, the elements a reduction
folds into each result, and which elements of the inputs (x; q, k and v) it reads, found from the storage
offsets of its arguments. A copy, a cast, a padding, a concatenation or a stack of inputs or of slices of them
(k and v packed together too), and an elementwise op of a whole input, are followed: what they make holds those
elements, each tagged with its input, and reading it reads them.
A one-pass answer reads each row's blocks (each query tile's key tiles) in order, and reads value tile j before
key tile j + 1. The docstrings say which ops, shapes and read orders fail. Not seen: values carried out of a
slice by arithmetic (``x_j * 1.0`` kept for later) or out of tensors (``.tolist()``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .core import Grader

__all__ = ["check_online_logsumexp", "check_tiled_attention"]

# reductions: inputs per output element; scans (cumsum, ...): the length of the scanned dim (args[1])
_REDUCTIONS = {"amax", "amin", "max", "min", "sum", "mean", "prod", "nansum", "argmax", "argmin", "logsumexp"}
_REDUCTIONS |= {"norm", "linalg_vector_norm", "all", "any", "var", "std", "median", "aminmax", "sort", "topk"}
_SCANS = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}
# ops that only move or copy data: they may touch the whole input (a clone, padding to a multiple of the block)
_COPIES = ("aten.clone", "aten._to_copy", "aten.copy_", "aten.constant_pad_nd", "aten.cat", "aten.stack", "aten.detach")
# ops that only allocate (empty_like(q) reads q's shape, not its values)
_ALLOCS = ("aten.empty", "aten.zeros", "aten.ones", "aten.full", "aten.new_", "aten.fill", "aten.zero_")
_ALLOCS += ("aten.scalar_tensor", "aten.lift_fresh", "aten.arange")
# ops that do the merge of two logsumexps themselves: the exercises ask for it written out
_MERGES = ("aten.logsumexp", "aten.logaddexp")
_FUSED_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


class _Call(NamedTuple):
    func: object  # the ATen op
    is_view: bool
    ins: list  # input shapes
    outs: list  # output shapes
    folded: int  # input elements folded into each result (reductions, scans), else 1
    reads: list  # (input name, {group: (first position read, positions read)}): rows of x, heads of q, k, v


class _OpRecorder(TorchDispatchMode):
    """Records every ATen op, and which elements of the ``sources`` (name -> (tensor, axis)) it reads.

    A source's position runs along ``axis`` (x: its columns, -1; q, k, v: their tokens, -2) and its group is
    everything before that axis (x: the row; q, k, v: the batch and head)."""

    def __init__(self, sources: dict):
        super().__init__()
        self.calls: list[_Call] = []
        self.tracked: dict[int, tuple] = {}  # storage address -> (element ids held, tensors kept alive)
        self.geometry = {name: (t.shape[axis], t.stride(axis)) for name, (t, axis) in sources.items()}
        self.ranges, first = {}, 0  # each source's elements get ids of their own: first, first + 1, ...
        for name, (t, _) in sources.items():
            self.ranges[name], first = (first, t.numel()), first + t.numel()
            self._track(t, torch.arange(first - t.numel(), first, dtype=torch.float64).view(t.shape))

    def _track(self, t: torch.Tensor, ids: torch.Tensor) -> None:
        """Mark ``t``'s elements as holding the source elements ``ids`` (kept alive: its address stays its own)."""
        key = t.untyped_storage().data_ptr()
        if key not in self.tracked:
            self.tracked[key] = (torch.full((t.untyped_storage().nbytes() // t.element_size(),), -1.0).double(), [])
        store, alive = self.tracked[key]
        store.as_strided(t.shape, t.stride(), t.storage_offset()).copy_(ids.expand(t.shape))
        alive.append(t)

    def _ids(self, t) -> torch.Tensor | None:
        """The source element each element of ``t`` holds (-1 for none), or None."""
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.untyped_storage().data_ptr() == 0:
            return None
        found = self.tracked.get(t.untyped_storage().data_ptr())
        try:
            return None if found is None else found[0].as_strided(t.shape, t.stride(), t.storage_offset())
        except RuntimeError:  # a view in another dtype: not followed
            return None

    def _split(self, ids: torch.Tensor) -> dict:
        """{source name: its own element ids} of the ids held, for the sources held."""
        parts = {name: ids[(ids >= first) & (ids < first + n)] - first for name, (first, n) in self.ranges.items()}
        return {name: part for name, part in parts.items() if part.numel()}

    def _positions(self, name: str, ids: torch.Tensor) -> dict:
        """{group: (the first position read, how many positions)} of the source elements ``ids``."""
        size, stride = self.geometry[name]
        e = ids.long()
        group, position = e // (size * stride), (e // stride) % size
        mine = [position[group == g] for g in group.unique().tolist()]
        return {g: (int(p.min()), p.unique().numel()) for g, p in zip(group.unique().tolist(), mine)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name, op = func.overloadpacket.__name__, str(func)
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        ins = [tuple(t.shape) for t in leaves]
        folded = math.prod(ins[0]) // max(1, math.prod(outs[0].shape)) if name in _REDUCTIONS and ins and outs else 1
        if name in _SCANS and ins and ins[0]:
            folded = ins[0][args[1] if len(args) > 1 else kwargs["dim"]]
        sourced = [(t, ids) for t in leaves if (ids := self._ids(t)) is not None]
        reads = []
        if op.startswith(("aten.copy_", "aten.fill_", "aten.zero_")):  # the destination is written, not read
            sourced = [(t, ids) for t, ids in sourced if t is not args[0]]
            if (ids := self._ids(args[0])) is not None:
                ids.fill_(-1.0)  # it holds no source now; a copy_ of one marks it again below
        if not func.is_view and not op.startswith(_ALLOCS) and sourced:
            held = self._split(torch.cat([ids.flatten() for _, ids in sourced]))  # one read per source
            reads = [(src, self._positions(src, ids)) for src, ids in held.items()]
            self._follow_copies(func, args, kwargs, out, sourced)
        self.calls.append(_Call(func, func.is_view, ins, [tuple(t.shape) for t in outs], folded, reads))
        return out

    def _follow_copies(self, func, args, kwargs, out, sourced) -> None:
        """A copy, a cast, a padding, a concatenation or a stack of sources (whole, or slices of them, k and v
        together too), and an elementwise op of a whole source, hold the sources' elements: reading them later
        reads those. (An elementwise op of a slice is not followed: it may be a running state,
        ``torch.maximum(m, x_j)``, that the next block reads.)"""
        op = str(func)
        if op.startswith(("aten.cat", "aten.stack")) and isinstance(out, torch.Tensor):
            ids = [i if (i := self._ids(t)) is not None else torch.full(t.shape, -1.0).double() for t in args[0]]
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            self._track(out, getattr(torch, func.overloadpacket.__name__)(ids, dim))  # torch.cat or torch.stack
            return
        for _, ids in sourced:
            if op.startswith("aten.constant_pad_nd") and isinstance(out, torch.Tensor):
                self._track(out, F.pad(ids, args[1], value=-1.0))
            elif op.startswith("aten.copy_"):
                self._track(args[0], ids)
            elif isinstance(out, torch.Tensor) and out.shape == ids.shape:
                copy = op.startswith(("aten.clone", "aten._to_copy", "aten.detach", "aten.alias"))
                parts = self._split(ids[ids >= 0])  # k * scale whole, not torch.maximum(m, x_j)
                whole = parts and all(part.unique().numel() == self.ranges[name][1] for name, part in parts.items())
                if copy or (whole and torch.Tag.pointwise in func.tags):
                    self._track(out, ids)


def _recorded(g: Grader, fn, args: tuple, sources: dict):
    """``g.call(fn, *args)`` with its ops recorded: (result, calls)."""
    with _OpRecorder(sources) as recorder:
        got = g.call(fn, *args)
    return got, recorder.calls


def _expect_none(g: Grader, description: str, found: list, detail) -> None:
    """One case: nothing may be ``found``; ``detail(*found[0])`` names the first that was."""
    g.expect(description, not found, detail(*found[0]) if found else "")


def _expect_no_merge_op(g: Grader, case: str, calls) -> None:
    merges = [(str(c.func),) for c in calls if str(c.func).startswith(_MERGES)]
    detail = "it calls {}, which does the merge for you".format
    _expect_none(g, f"{case}: the running maximum and sum written out", merges, detail)


def _in_order(calls, tile: str | None):
    """(op, source, group, first position) of every read but a copy's, in order, and (None, None, group, None)
    where a read of ``tile`` at a new position (the next query tile) starts the order afresh for that group."""
    current = {}
    for call in calls:
        if str(call.func).startswith(_COPIES):
            continue  # a copy is not a use: its copy is followed, and read where it is used
        for src, groups in call.reads:
            for group, (first, _) in groups.items() if src == tile else ():
                if current.get(group) != first:
                    current[group] = first
                    yield None, None, group, None
        for src, groups in call.reads:
            for group, (first, _) in groups.items():
                yield str(call.func), src, group, first


def _second_pass(calls, names: tuple, tile: str | None = None) -> list:
    """[(op, source, group, position, position read before)] for the first read of a source in ``names`` at an
    earlier position of its group than the read before it."""
    last = {}
    for op, src, group, position in _in_order(calls, tile):
        if op is None:
            last = {key: p for key, p in last.items() if key[1] != group}
        elif src in names:
            if position < last.get((src, group), -1):
                return [(op, src, group, position, last[src, group])]
            last[src, group] = position
    return []


def _late_values(calls, block: int) -> list:
    """[(op, value tile, group, key tile read before)] for the first read of value tile j after key tile j + 1
    (or a later one) of the same query tile: the online softmax folds each value tile into the output before it
    reads the next key tile; scores kept for a second pass read all the keys first."""
    keys = {}
    for op, src, group, position in _in_order(calls, "q"):
        if op is None:
            keys.pop(group, None)
        elif src == "k":
            keys[group] = max(keys.get(group, -1), position // block)
        elif src == "v" and position // block < keys.get(group, -1):
            return [(op, position // block, group, keys[group])]
    return []


def _work(calls):
    """The calls other than views, copies, allocations and elementwise ops on a whole input (``k * scale``)."""
    for c in calls:
        moves = c.is_view or str(c.func).startswith((*_COPIES, *_ALLOCS))
        if not moves and not (torch.Tag.pointwise in c.func.tags and any(out in c.ins for out in c.outs)):
            yield c


def _many_rows(calls, block: int) -> list:
    """[(op, rows, source)] of the ops in ``_work`` that read more than ``block`` rows of one head of q, k or v."""
    return [(str(c.func), n, src) for c in _work(calls) for src, rows in c.reads for _, n in rows.values() if n > block]


def _first_block_masked() -> torch.Tensor:
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(1))
    x[0, :5], x[2] = -math.inf, -math.inf  # a first block masked; a row masked whole
    return x


def check_online_logsumexp(fn):
    """``fn(x, block)``: logsumexp of x (..., N) over the last dim, one pass over blocks of columns.

    The method: no op but a view or a copy may read a tensor whose last dimension is longer than ``block``
    (``torch.logsumexp(x, -1)``, or ``x.max(-1)`` over the whole row, fails), no reduction may fold more than
    ``block`` elements into one result (``x.mT.amax(0)``, or an ``amax((-2, -1))`` over all blocks at once, fails),
    none may be ``torch.logsumexp`` or ``torch.logaddexp`` (per block, they would do the merge), and each row's
    blocks are read in order, once: a maximum block by block, then a sum block by block (two passes, even over
    copies of the blocks), fails.
    """
    g = Grader("check_online_logsumexp")
    gen = torch.Generator().manual_seed(0)
    cases = [
        ("small values", torch.randn(3, 10, generator=gen), 4),
        ("one block", torch.randn(2, 7, generator=gen), 16),
        ("values near 1000 (exp overflows without the running max)", 1000 + torch.randn(4, 33, generator=gen), 8),
        (
            "rows with -inf entries",
            torch.randn(2, 12, generator=gen).masked_fill(torch.arange(12) % 3 == 0, -math.inf),
            5,
        ),
        # a first block with nothing in it (running max -inf), and a row that is all -inf (answer -inf):
        # exp(m - m_new) with m = m_new = -inf is NaN unless the update guards it
        ("a row whose first block is all -inf", _first_block_masked(), 5),
    ]
    recorded = []
    for name, x, block in cases:  # the values first, then the method
        case = f"{name}, x of shape {tuple(x.shape)}, block {block}"
        mine = x.clone()
        got, calls = _recorded(g, fn, (mine, block), {"x": (mine, -1)})
        g.compare(case, got, torch.logsumexp(x, dim=-1), atol=1e-4, rtol=1e-6)
        recorded.append((case, block, calls))
    for case, block, calls in recorded:
        reading = [c for c in calls if not c.is_view and not str(c.func).startswith(_COPIES)]
        wide = [(c.func, s) for c in reading for s in c.ins if s and s[-1] > block]
        _expect_none(g, f"{case}: {block} columns at a time", wide, "{} read a tensor of shape {}".format)
        folds = [(c.func, c.folded, c.ins[0]) for c in calls if c.folded > block]
        detail = "{} folded {} elements of a tensor of shape {} into each result".format
        _expect_none(g, f"{case}: each reduction over at most {block} elements", folds, detail)
        _expect_no_merge_op(g, case, calls)
        detail = (
            "{} read column {} of row {} after an op had read column {}: a second pass over the row "
            "(carry a running maximum and sum, and read each block once)"
        )
        found = [(f, p, r, b) for f, _, r, p, b in _second_pass(calls, ("x",))]
        _expect_none(g, f"{case}: one pass over the blocks", found, detail.format)
    return g.result()


def _too_wide(calls, T: int) -> list:
    """(op, shape) of the ops in ``_work`` that read or make a tensor with a dimension of ``T``."""
    return [(str(c.func), shape) for c in _work(calls) for shape in (*c.outs, *c.ins) if T in shape]


def check_tiled_attention(fn):
    """``fn(q, k, v, block)``: non-causal attention, q (B, H, Tq, D), k and v (B, H, Tk, D).

    The method: no fused attention op (``F.scaled_dot_product_attention``), no ``torch.logsumexp`` or
    ``torch.logaddexp`` to carry the normaliser; no op but a view, a copy or an elementwise op on a whole input
    reads more than ``block`` rows of one head of q, k or v (a batched matmul over every key tile at once fails);
    each query tile reads the key and value tiles in order, once (a first pass for the maximum and a second for
    the sum fails), and reads value tile j before key tile j + 1, as the online softmax does (score tiles kept
    in a list, their maximum taken, then multiplied by the values, fail). On the last case (Tq = 48, Tk = 40,
    tiles of 8, where a tile holds 64 scores and one head's score matrix 1,920), no op may make 1,920 elements
    or more, and none but a view, a copy, an allocation or an elementwise op on a whole input may read or make
    a tensor with a dimension of 40 (every key at once, in any position: ``k @ q_i.mT`` fails) or of 48 (every
    query at once), nor one whose last dimension is longer than a tile.
    """
    g = Grader("check_tiled_attention")
    gen = torch.Generator().manual_seed(0)
    recorded = []
    for B, H, Tq, Tk, D, block, sizes_checked in [
        (1, 1, 8, 8, 4, 4, False),
        (2, 3, 13, 21, 8, 8, False),
        (1, 2, 5, 40, 16, 16, False),
        (1, 1, 3, 3, 4, 64, False),
        (1, 2, 48, 40, 4, 8, True),  # one head's (Tq, Tk) matrix is 5x q, k, v or the output, 30x a tile
    ]:
        q, k, v = (torch.randn(B, H, T, D, generator=gen) for T in (Tq, Tk, Tk))
        k = k * 4  # large scores: a missing rescaling by exp(m_old - m_new) shows up
        case = f"Tq={Tq}, Tk={Tk}, D={D}, block={block}"
        mine = [t.clone() for t in (q, k, v)]
        got, calls = _recorded(g, fn, (*mine, block), {n: (t, -2) for n, t in zip("qkv", mine)})
        g.compare(case, got, F.scaled_dot_product_attention(q, k, v), atol=1e-5)
        recorded.append((case, Tq, Tk, block, sizes_checked, calls))
    for case, Tq, Tk, block, sizes_checked, calls in recorded:  # the values first, then the method
        fused = [(str(c.func),) for c in calls if any(name in str(c.func) for name in _FUSED_ATTENTION)]
        _expect_none(g, f"{case}: tile by tile", fused, "it calls {}, a fused attention".format)
        if sizes_checked:
            made = [(str(c.func), out, c.ins) for c in calls if not c.is_view for out in c.outs]
            big = [(func, out) for func, out, _ in made if math.prod(out) >= Tq * Tk]
            detail = f"{{}} produced a tensor of shape {{}}, as large as one head's {Tq} x {Tk} scores".format
            _expect_none(g, f"{case}: no (Tq, Tk) matrix", big, detail)
            detail = f"{{}} read or made a tensor of shape {{}}: all {Tk} keys at once, more than a tile of {block}"
            _expect_none(g, f"{case}: at most {block} keys at a time", _too_wide(calls, Tk), detail.format)
            detail = f"{{}} read or made a tensor of shape {{}}: all {Tq} queries at once, not a tile of {block}"
            _expect_none(g, f"{case}: at most {block} queries at a time", _too_wide(calls, Tq), detail.format)
            # ops that only allocate (read no tensor) or copy may hold a whole row of q, k, v or o
            wide = [(f, out) for f, out, ins in made if ins and not f.startswith(_COPIES) and out and out[-1] > block]
            detail = f"{{}} produced a tensor of shape {{}}: a last dimension longer than a tile of {block}".format
            _expect_none(g, f"{case}: tiles of at most {block}", wide, detail)
        _expect_no_merge_op(g, case, calls)
        detail = (
            "{} read {} row {} (batch x head {}) after row {}, for the same query tile: a second pass over the "
            "keys (carry m, l and the output instead)"
        )
        found = [(f, src, p, grp, b) for f, src, grp, p, b in _second_pass(calls, ("k", "v"), tile="q")]
        _expect_none(g, f"{case}: one pass over the key tiles", found, detail.format)
    for case, _, _, block, _, calls in recorded:
        detail = f"{{}} read {{}} rows of one head of {{}} at once: more than a tile of {block}".format
        _expect_none(g, f"{case}: at most {block} rows of q, k or v per op", _many_rows(calls, block), detail)
        detail = (
            "{} read value tile {} (batch x head {}) after key tile {}, for the same query tile: fold each value "
            "tile into the output (rescaled by the running maximum) before reading the next key tile"
        )
        _expect_none(g, f"{case}: each value tile before the next key tile", _late_values(calls, block), detail.format)
    return g.result()
