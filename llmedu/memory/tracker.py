"""Where the bytes of a training step go: a memory tracker built from scratch.

Every tensor lives in a *storage*, a block of bytes; views, slices and ``.view()`` share it. The
memory a step needs is the sum of the storages alive at each moment, and the number that decides
whether a model fits is the peak of that sum. This tracker watches storages being born and dying
and says, for each one, what role it plays:

    parameters    the model's weights (``model.parameters()``)
    gradients     the ``.grad`` of those weights
    optimizer     the optimizer's state (Adam's two moments and step counters: ``optimizer.state``)
    activations   tensors that autograd *saves for backward* during the forward pass
    other         everything else: temporaries (an output used once and dropped, gradients of
                  activations in backward, scratch of the optimizer), buffers, the input batch

How it sees the bytes, with nothing but public PyTorch:

* A ``TorchDispatchMode`` is called for every ATen operation, below autograd, on any device
  (CPU, CUDA, fake tensors). After each op, every storage of its outputs that we have not seen is
  a new allocation; a ``weakref`` to the storage object tells us when it is freed. (PyTorch keeps
  one Python object per storage for as long as the storage lives, so the weakref dies with it.)
* Parameters, existing gradients and existing optimizer state are registered on entry.
* Which storages are activations is asked of autograd itself: ``saved_tensors_hooks`` is called
  with every tensor saved for backward. Gradients are recognised by a post-accumulate-grad hook
  on each parameter, optimizer state by a step post-hook that reads ``optimizer.state``.
* A storage is labelled by the role it ends up playing, for its whole life: the buffer autograd
  allocates for a weight's gradient is a gradient from birth, and Adam's moments, created lazily
  inside the first ``step()``, are optimizer state from the op that made them.

The timeline has one sample after every op: live bytes by category right after the op's outputs
exist, which is when a new peak can occur.

What it leaves out: memory allocated inside a kernel and freed before it returns (cuDNN's
workspaces), memory a library keeps for as long as its handle lives (cuBLAS's workspace, one per handle and
stream, taken from the caching allocator: it shows in ``memory_allocated`` but not here) or never seen by the
dispatcher (the 8-byte scalar autograd saves for ``x / 2.0``),
the CUDA allocator's cached-but-free blocks (we count what ``memory_allocated`` counts: sizes
rounded up to 512 bytes on CUDA), storages resized in place (``UntypedStorage.resize_``), and
tensors created before the ``with`` that are neither parameters, gradients nor optimizer state:
those are counted from the first op that reads them. Autograd calls only the innermost
``saved_tensors_hooks``: inside code that installs its own (activation checkpointing, offloading
to the CPU) the tensors those hooks keep are labelled ``other``. The input batch, when the first
layer saves it (an embedding needs its indices for backward), is an activation by this rule.
The production tool is ``torch.distributed._tools.mem_tracker.MemTracker``; the tests compare with it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CATEGORIES", "MemoryTracker", "Sample"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "other")
# A storage's label only moves up this ladder: a weight saved for backward stays a parameter.
_RANK = {"other": 0, "activations": 1, "gradients": 2, "optimizer": 3, "parameters": 4}
_CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this


@dataclass
class Sample:
    """Live bytes by category right after one op (``phase``: forward, backward or optimizer)."""

    op: str
    phase: str
    by_category: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_category.values())


class _Block:
    """One storage we are tracking: its size and its role."""

    __slots__ = ("nbytes", "category")

    def __init__(self, nbytes: int, category: str):
        self.nbytes, self.category = nbytes, category


class MemoryTracker(TorchDispatchMode):
    """Measure the memory of whatever runs inside ``with MemoryTracker(model, optimizer) as mt:``.

    After the block: ``mt.peak_bytes``, ``mt.peak_by_category()``, ``mt.peak_op`` (the op at the
    peak) and ``mt.timeline`` (a ``Sample`` per op). Inside it, ``mt.current_by_category()``.
    Only storages on ``device`` count, by default the device of the model's parameters (a model without
    parameters must name it): on a GPU, AdamW's step counters, which stay on the CPU, are not GPU memory.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, device: torch.device | str | None = None
    ):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"MemoryTracker needs an nn.Module to find the parameters, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        if device is None:
            devices = {p.device for p in model.parameters()}
            if len(devices) > 1:
                raise ValueError(f"the model's parameters are on {sorted(map(str, devices))}: choose one with device=")
            if not devices:  # e.g. nn.Module() around a bare function: no parameters say where to look
                raise ValueError("the model has no parameters to say which device's memory to count: pass device=")
            device = devices.pop()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.model, self.optimizer, self.device = model, optimizer, device
        self.timeline: list[Sample] = []
        self._used = False

    # -- the bookkeeping ------------------------------------------------------------------------
    def _track(self, tensor: torch.Tensor, category: str) -> None:
        """Make sure ``tensor``'s storage is tracked, and raise its label to ``category``."""
        if tensor.device != self.device:
            return
        if tensor.layout != torch.strided:
            raise NotImplementedError(f"MemoryTracker counts dense tensors only, got one with layout {tensor.layout}")
        storage = tensor.untyped_storage()
        entry = self._blocks.get(id(storage))
        if entry is not None and entry[0]() is storage:  # (an id is reused once its object dies)
            block = entry[1]
            if _RANK[category] > _RANK[block.category]:
                self._current[block.category] -= block.nbytes
                self._current[category] += block.nbytes
                block.category = category
            return
        nbytes = storage.nbytes()
        if tensor.device.type == "cuda":
            nbytes = -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK
        block = _Block(nbytes, category)
        key = id(storage)

        def freed(_ref, key=key, block=block):  # runs when the storage object is destroyed
            if self._blocks.get(key, (None, None))[1] is block:
                del self._blocks[key]
            if self._active:
                self._current[block.category] -= block.nbytes
                self._events.append(("free", block))

        self._blocks[key] = (weakref.ref(storage, freed), block)
        self._current[category] += nbytes
        self._events.append(("alloc", block))

    def _track_optimizer_state(self) -> None:
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._track(value, "optimizer")

    def _phase(self) -> str:
        if self._in_optimizer:
            return "optimizer"
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    # -- the dispatch mode: called for every ATen op --------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):  # an input never seen was made before the `with`
                self._track(t, "other")
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):  # a new storage, or a view of one we know
                self._track(t, "other")
        self._events.append(("sample", f"{func.overloadpacket.__name__}", self._phase()))
        return out

    # -- entering and leaving -------------------------------------------------------------------
    def __enter__(self) -> MemoryTracker:
        if self._used:
            raise RuntimeError("a MemoryTracker measures one block; make a new one for the next")
        self._used, self._active, self._in_optimizer = True, True, False
        self._blocks: dict[int, tuple[weakref.ref, _Block]] = {}
        self._current = dict.fromkeys(CATEGORIES, 0)
        self._events: list[tuple] = []
        self._hooks = []

        for p in self.model.parameters():
            self._track(p, "parameters")
            if p.grad is not None:
                self._track(p.grad, "gradients")
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p: self._track(p.grad, "gradients")))
        for b in self.model.buffers():
            self._track(b, "other")
        if self.optimizer is not None:
            self._track_optimizer_state()
            self._hooks.append(self.optimizer.register_step_pre_hook(self._optimizer_starts))
            self._hooks.append(self.optimizer.register_step_post_hook(self._optimizer_ends))
        self._events.append(("sample", "<start>", "forward"))

        def pack(t):  # autograd saves `t` for backward: its storage holds an activation
            self._track(t, "activations")
            return t

        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._saved_hooks.__enter__()
        return super().__enter__()

    def _optimizer_starts(self, *_):
        self._in_optimizer = True

    def _optimizer_ends(self, *_):
        self._track_optimizer_state()  # Adam's moments are made lazily, inside the first step
        self._in_optimizer = False

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._saved_hooks.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._events.append(("sample", "<end>", self._phase()))
        self._active = False
        self._blocks.clear()  # drop the weakrefs: storages freed from now on are not our business
        self._replay()

    def _replay(self) -> None:
        """Rebuild the timeline from the events, with every storage under its final label."""
        live = dict.fromkeys(CATEGORIES, 0)
        for event in self._events:
            if event[0] == "alloc":
                live[event[1].category] += event[1].nbytes
            elif event[0] == "free":
                live[event[1].category] -= event[1].nbytes
            else:
                self.timeline.append(Sample(event[1], event[2], dict(live)))
        self._events.clear()
        self._peak_index = max(range(len(self.timeline)), key=lambda i: self.timeline[i].total)

    # -- the answers ----------------------------------------------------------------------------
    def _finished(self) -> None:
        if not self._used or self._active:
            raise RuntimeError("the peak is known once the `with MemoryTracker(...)` block has ended")

    @property
    def peak_bytes(self) -> int:
        """The most bytes alive at once during the block (all categories together)."""
        self._finished()
        return self.timeline[self._peak_index].total

    @property
    def peak_op(self) -> str:
        """The op right after which the peak was reached, and in which phase, e.g. 'mm (backward)'."""
        self._finished()
        sample = self.timeline[self._peak_index]
        return f"{sample.op} ({sample.phase})"

    def peak_by_category(self) -> dict[str, int]:
        """Bytes by category at the moment of the peak."""
        self._finished()
        return dict(self.timeline[self._peak_index].by_category)

    def max_bytes(self, *categories: str) -> int:
        """The most bytes that ``categories`` held together at any moment of the block.

        ``mt.max_bytes("parameters", "gradients", "optimizer")`` is the model-state memory once
        every gradient and every optimizer state exists, the number ZeRO's formulas count.
        """
        self._finished()
        unknown = set(categories) - set(CATEGORIES)
        if not categories or unknown:
            raise ValueError(f"name one or more of {CATEGORIES}; got {categories!r}")
        return max(sum(s.by_category[c] for c in categories) for s in self.timeline)

    def current_by_category(self) -> dict[str, int]:
        """Bytes alive now, by category as known so far (a gradient is 'other' until accumulated)."""
        if not self._used:
            raise RuntimeError("the tracker has not started: use it as `with MemoryTracker(model) as mt:`")
        if self._active:
            return dict(self._current)
        return dict(self.timeline[-1].by_category)

    def series(self) -> dict[str, list[int]]:
        """The timeline as one list of bytes per category, ready for a stacked area plot."""
        self._finished()
        return {c: [s.by_category[c] for s in self.timeline] for c in CATEGORIES}

    def summary(self, unit: str = "MiB") -> str:
        """A small table: the peak by category, in ``unit`` (B, KiB, MiB or GiB)."""
        scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
        if unit not in scale:
            raise ValueError(f"unit must be one of {list(scale)}, got {unit!r}")
        rows = [f"{c:<12}{b / scale[unit]:>12.2f} {unit}" for c, b in self.peak_by_category().items()]
        rows.append(f"{'peak':<12}{self.peak_bytes / scale[unit]:>12.2f} {unit}   at {self.peak_op}")
        return "\n".join(rows)
