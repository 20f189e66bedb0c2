"""Checkpoints that resume exactly and load without unpickling anything.

A training run is resumable when everything that decides the next loss is saved:

    tensors.safetensors   the model's weights; the optimizer's per-parameter state (Adam's moments
                          and step counts); the random-number generators of torch (CPU, CUDA) and
                          NumPy
    state.json            the step, the data position (micro-batches consumed), the seconds spent,
                          the optimizer's hyper-parameters per group, the loss scaler's state,
                          Python's ``random`` state

``torch.save`` would write all of it in one file, but ``torch.load`` *unpickles*, and unpickling
runs whatever code the file names: a checkpoint from somewhere else is a program. safetensors is
a JSON header plus raw bytes, so loading reads numbers and nothing else; the rest is plain JSON.

A checkpoint is a folder ``step-000120`` written under a hidden temporary name and then renamed
(``os.replace``, atomic on POSIX): a run killed while saving leaves the previous checkpoint intact
and no half-written folder that looks complete; the next save removes such leftovers of dead
processes. ``state.json`` records the sha256 of the tensor file and of its own content, so a flipped
byte in the weights or in the step, position or seed is caught, not resumed from; a checkpoint without
these checksums is refused too (one written before they were recorded loads with ``allow_unchecked=True``,
with a warning). ``load`` reads and checks *everything* before it changes anything, so a missing, corrupt
or mismatched checkpoint raises ``CheckpointError`` (naming the file) and leaves the model and optimizer
untouched.

``newest_intact`` is what a resume starts from: it checks the checkpoints newest first and moves each
damaged one aside (``step-000120`` becomes ``step-000120.damaged``, which is no checkpoint to list,
resume from or prune, and is kept for a look), so the run goes on from the one before, saves the steps it
recomputes under their own names, and can be resumed again.

``prune`` keeps the newest N checkpoints and removes the older ones, so that a long run does not fill
the disk (a day of BERT-base on a GPU, a checkpoint of weights and Adam's moments every 100 steps, would
write terabytes). N is at least 2, so that ``load_latest`` always has a checkpoint to fall back to. A
folder is renamed to a hidden temporary name before it is deleted: a run killed while pruning leaves
either the whole checkpoint or a leftover that the next save removes, never a half-deleted one that looks
complete. A checkpoint that is a symlink (kept on another disk) loses only its link.

Left out: sharded checkpoints (one file per rank, lesson 15), asynchronous saving.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..data.cache import sha256_of
from ..runtime import process_alive

__all__ = ["CheckpointError", "UncheckedCheckpointError", "save", "prune", "check_keep", "read", "load"]
__all__ += ["load_latest", "newest_intact", "latest", "checkpoints", "checkpoint_name"]

FORMAT = "llmedu-checkpoint-1"
TENSORS, STATE = "tensors.safetensors", "state.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model/optimizer it is loaded into."""


class UncheckedCheckpointError(CheckpointError):
    """A checkpoint records no checksum to check it against: damaged, or written before they were recorded."""


def _state_digest(state: dict) -> str:
    """The sha256 of a checkpoint's state (everything in state.json but this digest), key order aside."""
    content = {k: v for k, v in state.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode("utf-8")).hexdigest()


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoints(root: str | Path) -> list[Path]:
    """The complete-looking checkpoint folders under ``root``, by step (numerically: step-1000000
    comes after step-999999, although its name sorts before)."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [
        p for p in root.glob("step-*") if p.name[5:].isdigit() and (p / TENSORS).is_file() and (p / STATE).is_file()
    ]
    return sorted(done, key=lambda p: int(p.name[5:]))


def latest(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None if there is none."""
    found = checkpoints(root)
    return found[-1] if found else None


def _remove_leftovers(root: Path) -> None:
    """Delete temporary folders that a process killed while saving or pruning left behind (it is dead)."""
    for tmp in root.glob(".step-*.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):
            _remove(tmp, ignore_errors=True)


def _remove(path: Path, ignore_errors: bool = False) -> None:
    """Delete a checkpoint folder; one that is a symlink loses only the link (its target belongs elsewhere)."""
    if path.is_symlink():
        try:
            path.unlink()
        except OSError:
            if not ignore_errors:
                raise
    else:
        shutil.rmtree(path, ignore_errors=ignore_errors)


def check_keep(keep, name: str = "keep") -> None:
    """How many checkpoints to keep: an int >= 2, so that a damaged latest one has one before it."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 2:
        raise ValueError(
            f"{name} must be an int >= 2 (a damaged latest checkpoint falls back to the one before), got {keep!r}"
        )


def prune(root: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` (>= 2) complete checkpoints under ``root``; return the removed."""
    check_keep(keep)
    removed = checkpoints(root)[:-keep]
    for old in removed:
        doomed = old.with_name(f".{old.name}.tmp-{os.getpid()}")
        os.replace(old, doomed)  # gone from checkpoints() at once, whatever happens next
        _remove(doomed)
    return removed


# -- saving --------------------------------------------------------------------------------------
def save(root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict) -> Path:
    """Write a checkpoint folder under ``root`` atomically; ``train_state`` must hold ``step``."""
    root = Path(root)
    final = root / checkpoint_name(train_state["step"])
    if final.exists():
        raise FileExistsError(f"{final} already exists; resume from it or use another checkpoint directory")
    tensors = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}  # clone: tied weights
    opt = optimizer.state_dict()
    scalars = {}
    for index, per_param in opt["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = value.detach().cpu().clone()
            else:
                scalars[f"{index}.{name}"] = value
    groups = []
    for group in opt["param_groups"]:
        if any(isinstance(v, torch.Tensor) for v in group.values()):
            raise TypeError("optimizer hyper-parameters held as tensors (e.g. lr=torch.tensor(...)) are not supported")
        groups.append(group)
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors["rng.numpy"] = torch.from_numpy(np_keys.astype(np.int64))
    py_version, py_internal, py_gauss = random.getstate()
    state = {
        "format": FORMAT,
        **train_state,
        "optimizer": {"param_groups": groups, "scalars": scalars, "n_state": len(opt["state"])},
        "rng": {
            "numpy": [np_kind, np_pos, np_has_gauss, np_gauss],
            "python": [py_version, list(py_internal), py_gauss],
        },
    }
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(tensors, str(tmp / TENSORS), metadata={"format": FORMAT})
    state["sha256"] = sha256_of(tmp / TENSORS)  # of the bytes as written, checked by load
    state["state_sha256"] = _state_digest(json.loads(json.dumps(state)))  # as JSON will read it back
    with open(tmp / STATE, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)  # the checkpoint appears whole, or not at all
    return final


# -- loading -------------------------------------------------------------------------------------
def read(path: str | Path, *, allow_unchecked: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, state) of one checkpoint folder, checked: both files present, the state valid JSON of this
    format, the state's and the tensor file's sha256 the ones recorded at save time, and a readable
    safetensors file. For readers that need the weights without a model and optimizer to load into
    (``load`` uses it too). A checkpoint that records no checksum is refused (``UncheckedCheckpointError``)
    unless ``allow_unchecked``: then what is recorded is checked and the rest loads with a warning."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: not a folder")
    for name in (TENSORS, STATE):
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is not a complete checkpoint: {name} is missing")
    try:
        state = json.loads((path / STATE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path / STATE} is not valid JSON: {err}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path / STATE} is not an {FORMAT} file")
    own = state.get("state_sha256")
    if own is not None and own != _state_digest(state):
        raise CheckpointError(f"{path / STATE} differs from the sha256 recorded in it when it was saved: it is damaged")
    missing = [name for key, name in (("sha256", TENSORS), ("state_sha256", STATE)) if key not in state]
    if missing:
        message = f"{path / STATE} records no sha256 of {' nor of '.join(missing)}, so it cannot be checked"
        if not allow_unchecked:
            raise UncheckedCheckpointError(
                f"{message}: it is damaged, or was written by an older llmedu (then load it with "
                "allow_unchecked=True, or move the folder aside to resume from the checkpoint before it)"
            )
        warnings.warn(f"{message}; loading it unchecked, as asked (allow_unchecked=True)", RuntimeWarning, stacklevel=3)
    state.pop("state_sha256", None)
    recorded = state.pop("sha256", None)
    if recorded is not None and sha256_of(path / TENSORS) != recorded:
        raise CheckpointError(f"{path / TENSORS} differs from the sha256 recorded when it was saved: it is damaged")
    try:
        tensors = load_file(str(path / TENSORS))  # raw bytes and a JSON header: no code runs
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path / TENSORS} is not a readable safetensors file: {err}") from None
    return tensors, state


def _check_model(path: Path, model: nn.Module, tensors: dict) -> dict[str, torch.Tensor]:
    weights = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    expected = model.state_dict()
    if set(weights) != set(expected):
        missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        raise CheckpointError(f"{path} does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, value in expected.items():
        if weights[name].shape != value.shape or weights[name].dtype != value.dtype:
            raise CheckpointError(
                f"{path}: {name} is {tuple(weights[name].shape)} {weights[name].dtype} in the checkpoint, "
                f"{tuple(value.shape)} {value.dtype} in the model"
            )
    return weights


def _optimizer_state(path: Path, optimizer: torch.optim.Optimizer, tensors: dict, saved: dict) -> dict:
    groups = saved["param_groups"]
    ours = optimizer.param_groups
    if len(groups) != len(ours) or any(len(g["params"]) != len(o["params"]) for g, o in zip(groups, ours)):
        raise CheckpointError(f"{path}: the optimizer's parameter groups do not match the checkpoint's")
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for key, value in saved["scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    if len(state) != saved["n_state"]:
        raise CheckpointError(f"{path}: optimizer state for {saved['n_state']} parameters expected, found {len(state)}")
    params = [p for group in ours for p in group["params"]]  # the state dict numbers them in this order
    for index, per_param in state.items():
        for name, value in per_param.items():
            # a per-element state (Adam's moments) must be laid out as its parameter; other shapes
            # (8-bit Adam's codes and per-block scales) are the optimizer's own to check on loading
            per_element = isinstance(value, torch.Tensor) and value.numel() == params[index].numel() > 1
            if per_element and value.shape != params[index].shape:
                raise CheckpointError(
                    f"{path}: optimizer state {name} of parameter {index} is {tuple(value.shape)}, the parameter {tuple(params[index].shape)}"
                )
    # JSON turned tuples (Adam's betas) into lists
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": groups}


def load(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, allow_unchecked: bool = False
) -> dict:
    """Load a checkpoint folder into ``model`` and ``optimizer``, restore the RNGs; return the
    training state (step, position, seconds, scaler...). Nothing changes if anything is wrong."""
    path = Path(path)
    tensors, state = read(path, allow_unchecked=allow_unchecked)
    try:
        weights = _check_model(path, model, tensors)
        opt_state = _optimizer_state(path, optimizer, tensors, state["optimizer"])
        np_kind, np_pos, np_has_gauss, np_gauss = state["rng"]["numpy"]
        py_version, py_internal, py_gauss = state["rng"]["python"]
        torch_rng = tensors["rng.torch"]
        cuda_rng = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
        np_keys = tensors["rng.numpy"].numpy().astype(np.uint32)
    except (KeyError, IndexError, ValueError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{path} is incomplete or corrupt: {type(err).__name__}: {err}") from None
    # everything is read and checked: only now does anything change
    model.load_state_dict(weights)
    optimizer.load_state_dict(opt_state)
    torch.set_rng_state(torch_rng)
    if cuda_rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_rng)
    np.random.set_state((np_kind, np_keys, np_pos, np_has_gauss, np_gauss))
    random.setstate((py_version, tuple(py_internal), py_gauss))
    return {k: v for k, v in state.items() if k not in ("format", "optimizer", "rng")}


def newest_intact(root: str | Path, *, allow_unchecked: bool = False) -> Path | None:
    """The newest checkpoint under ``root`` that passes ``read``'s checks, or None if there is none.

    Each damaged one newer than it is moved aside (renamed ``<name>.damaged``, with a warning naming it
    and why): no longer a checkpoint to list, resume from or prune, so that the run can save the steps it
    recomputes under their own names. A checkpoint that records no checksum is not moved: that is an
    error (``UncheckedCheckpointError``) unless ``allow_unchecked``, since it may be an older llmedu's.
    """
    for path in reversed(checkpoints(root)):
        try:
            read(path, allow_unchecked=allow_unchecked)
            return path
        except UncheckedCheckpointError:
            raise
        except CheckpointError as err:
            aside = path.with_name(f"{path.name}.damaged")
            n = 1
            while aside.exists():
                n += 1
                aside = path.with_name(f"{path.name}.damaged-{n}")
            os.replace(path, aside)
            warnings.warn(f"skipping a damaged checkpoint: {err}; moved aside to {aside}", RuntimeWarning, stacklevel=2)
    return None


def load_latest(
    root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, allow_unchecked: bool = False
) -> tuple[Path, dict]:
    """Load the newest intact checkpoint under ``root`` (``newest_intact``); return its path and training state.

    A damaged newer one is reported and moved aside, so a crash that corrupted the last save costs
    ``checkpoint_every`` steps, not the run. A checkpoint that is intact but does not fit the model or
    optimizer is an error, not a reason to fall back: the one before would not fit either.
    """
    path = newest_intact(root, allow_unchecked=allow_unchecked)
    if path is None:
        raise CheckpointError(f"no intact checkpoint in {root} (damaged ones are moved aside, see the warnings)")
    return path, load(path, model, optimizer, allow_unchecked=allow_unchecked)
