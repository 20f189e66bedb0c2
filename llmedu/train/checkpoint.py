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
processes. ``state.json`` records the sha256 of the tensor file, so a flipped byte in the weights is
caught, not resumed from. ``load`` reads and checks *everything* before it changes anything, so a
missing, corrupt or mismatched checkpoint raises ``CheckpointError`` (naming the file) and leaves the
model and optimizer untouched; ``load_latest`` then falls back to the checkpoint before it.

``prune`` keeps the newest N checkpoints and removes the older ones, so that a long run does not fill
the disk (a day of BERT-base on a GPU, a checkpoint of weights and Adam's moments every 100 steps, would
write terabytes). N is at least 2, so that ``load_latest`` always has a checkpoint to fall back to. A
folder is renamed to a hidden temporary name before it is deleted: a run killed while pruning leaves
either the whole checkpoint or a leftover that the next save removes, never a half-deleted one that looks
complete.

Left out: sharded checkpoints (one file per rank, lesson 14), asynchronous saving.
"""

from __future__ import annotations

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

__all__ = [
    "CheckpointError",
    "save",
    "prune",
    "check_keep",
    "read",
    "load",
    "load_latest",
    "latest",
    "checkpoints",
    "checkpoint_name",
]

FORMAT = "llmedu-checkpoint-1"
TENSORS, STATE = "tensors.safetensors", "state.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model/optimizer it is loaded into."""


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
            shutil.rmtree(tmp, ignore_errors=True)


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
        shutil.rmtree(doomed)
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
    with open(tmp / STATE, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)  # the checkpoint appears whole, or not at all
    return final


# -- loading -------------------------------------------------------------------------------------
def read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, state) of one checkpoint folder, checked: both files present, the state valid JSON of this
    format, the tensor file's sha256 the one recorded at save time, and a readable safetensors file.
    For readers that need the weights without a model and optimizer to load into (``load`` uses it too)."""
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
    recorded = state.pop("sha256", None)  # checkpoints written before it was recorded have none
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


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load a checkpoint folder into ``model`` and ``optimizer``, restore the RNGs; return the
    training state (step, position, seconds, scaler...). Nothing changes if anything is wrong."""
    path = Path(path)
    tensors, state = read(path)
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


def load_latest(root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Path, dict]:
    """Load the newest checkpoint under ``root`` that loads; return its path and training state.

    A damaged newest checkpoint is reported (a warning naming it and why) and the one before is
    tried, so a crash that corrupted the last save costs ``checkpoint_every`` steps, not the run.
    """
    found = checkpoints(root)
    if not found:
        raise CheckpointError(f"no checkpoint in {root}")
    for path in reversed(found):
        try:
            return path, load(path, model, optimizer)
        except CheckpointError as err:
            warnings.warn(f"skipping a damaged checkpoint: {err}", RuntimeWarning, stacklevel=2)
    raise CheckpointError(f"none of the {len(found)} checkpoints in {root} loads (see the warnings above)")
