"""What every parameter-efficient method shares: find modules by name, wrap them, freeze the rest.

A PEFT method adds a few new parameters to a pretrained network and trains only those. Whether
the network is ours (``llmedu.models``) or Hugging Face's, the recipe is the same:

1. find the modules to adapt by their names (``find_modules(model, ["q_proj", "v_proj"])``);
2. replace each by a wrapper that holds the original (``.base``) and the new parameters
   (``replace_module``); every wrapper has a ``peft_method`` name and an ``enabled`` switch;
3. freeze everything that is not an adapter parameter (``freeze_base``);
4. save and load only the adapter's tensors (``save_adapter`` / ``load_adapter``, safetensors).

A name pattern matches a module when it equals the module's full name, is a dotted suffix of it
(``"q_proj"`` matches ``model.layers.0.self_attn.q_proj``), or is a regular expression that
matches the full name (``r".*\\.output\\.dense"``). This is the rule of ``peft``'s
``target_modules``.

Left out: several named adapters on one model (the ``peft`` ``adapter_name`` machinery), and
quantised base layers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "base_fingerprint",
    "find_modules",
    "replace_module",
    "peft_modules",
    "ensure_not_applied",
    "adapter_parameter_names",
    "freeze_base",
    "mark_trainable",
    "count_parameters",
    "adapter_state_dict",
    "save_adapter",
    "load_adapter",
    "set_adapters_enabled",
    "adapters_disabled",
    "model_dims",
]


# -- finding and replacing modules --------------------------------------------------------------------
def _matches(pattern: str, name: str) -> bool:
    return name == pattern or name.endswith("." + pattern) or re.fullmatch(pattern, name) is not None


def find_modules(
    model: nn.Module, patterns: str | Iterable[str], kind: type | tuple[type, ...] = nn.Module
) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs whose name matches one of ``patterns``, in the model's order.

    Every pattern must match at least one module, and every match must be a ``kind``: a typo in
    a target name is an error here, not a fine-tuning run that trains nothing.
    """
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not patterns:
        raise ValueError("no target module pattern was given")
    named = [(n, m) for n, m in model.named_modules() if n]
    found = []
    for pattern in patterns:
        hits = [(n, m) for n, m in named if _matches(pattern, n)]
        if not hits:
            leaves = ", ".join(sorted({n.rsplit(".", 1)[-1] for n, _ in named})[:24])
            raise ValueError(
                f"target pattern {pattern!r} matches no module of {type(model).__name__}; its module names end in: {leaves}"
            )
        found += [hit for hit in hits if hit[0] not in {n for n, _ in found}]
    for name, module in found:
        if not isinstance(module, kind):
            wanted = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise TypeError(f"module {name!r} is a {type(module).__name__}; this method adapts {wanted} modules only")
    order = {n: i for i, (n, _) in enumerate(named)}
    return sorted(found, key=lambda hit: order[hit[0]])


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule ``name`` was (``"encoder.layer.0.output.dense"``)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def peft_modules(model: nn.Module, method: str | None = None) -> list[nn.Module]:
    """Every wrapper in ``model`` (the model itself included), or those of one ``method``."""
    return [
        m for m in model.modules() if getattr(m, "peft_method", None) and (method is None or m.peft_method == method)
    ]


def ensure_not_applied(model: nn.Module, method: str) -> None:
    """Applying the same method twice would wrap wrappers; refuse with a clear message."""
    if peft_modules(model, method):
        raise ValueError(
            f"{method} is already applied to this model; apply it to a fresh copy of the base model instead"
        )


# -- which parameters train ---------------------------------------------------------------------------
def adapter_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters that the PEFT wrappers added (not those of the modules they wrap)."""
    names = set()
    for prefix, module in model.named_modules():
        if getattr(module, "peft_method", None):
            for n, _ in module.named_parameters():
                if not n.startswith("base."):
                    names.add(f"{prefix}.{n}" if prefix else n)
    return names


def freeze_base(model: nn.Module) -> None:
    """``requires_grad = False`` for every parameter that is not an adapter's."""
    ours = adapter_parameter_names(model)
    for name, p in model.named_parameters():
        p.requires_grad_(name in ours)


def mark_trainable(model: nn.Module, patterns: str | Iterable[str]) -> list[str]:
    """Also train the modules matching ``patterns`` (a new classifier head, say); returns their names."""
    names = []
    for name, module in find_modules(model, patterns):
        for p in module.parameters():
            p.requires_grad_(True)
        names.append(name)
    return names


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; shared tensors are counted once."""
    seen, trainable, total = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total


# -- saving only what was trained ---------------------------------------------------------------------
def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors by name: the adapter plus any module ``mark_trainable`` opened."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def save_adapter(model: nn.Module, path: str | Path) -> int:
    """Write the trainable tensors to a safetensors file; return its size in bytes."""
    from safetensors.torch import save_file

    tensors = {n: t.contiguous().cpu() for n, t in adapter_state_dict(model).items()}
    if not tensors:
        raise ValueError("the model has no trainable parameter: nothing to save (was a PEFT method applied?)")
    methods = sorted({m.peft_method for m in peft_modules(model)})
    metadata = {"llmedu.peft": json.dumps(methods), "llmedu.base": base_fingerprint(model)}
    save_file(tensors, str(path), metadata=metadata)
    return Path(path).stat().st_size


def base_fingerprint(model: nn.Module) -> str:
    """A short hash of the frozen base model: the names, shapes and dtypes of its frozen tensors, and
    the first and last 16 values of each (enough to tell two checkpoints of one architecture apart,
    without hashing every weight of a large model)."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            flat = p.detach().reshape(-1)
            ends = torch.cat([flat[:16], flat[-16:]]).float().cpu()
            digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
            digest.update(ends.numpy().tobytes())
    return digest.hexdigest()[:16]


def load_adapter(model: nn.Module, path: str | Path, *, other_base: bool = False) -> None:
    """Copy tensors saved by ``save_adapter`` into ``model``, which must have the same adapter applied.

    Everything is checked before anything is copied, so a file that does not fit leaves the model as
    it was. An adapter trained on another base model (other weights of the same shape: the recorded
    ``base_fingerprint`` differs) is refused unless ``other_base=True`` says that is what you want.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no adapter file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:  # the tensors and the metadata, in one read
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            recorded = (f.metadata() or {}).get("llmedu.base")
    except SafetensorError as err:  # cut short, or not a safetensors file at all
        raise ValueError(f"{path} is not a readable adapter file (safetensors): {err}") from None
    params = dict(model.named_parameters())
    wanted = set(adapter_state_dict(model))
    missing, unexpected = sorted(wanted - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"{path.name} does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]} "
            "(apply the same method with the same settings before loading)"
        )
    ours = base_fingerprint(model) if recorded is not None and not other_base else None
    if ours is not None and recorded != ours:
        raise ValueError(
            f"{path.name} was trained on another base model (fingerprint {recorded}, this model's "
            f"{ours}): load the base it was trained on, or pass other_base=True"
        )
    wrong = [(n, t.shape, params[n].shape) for n, t in tensors.items() if params[n].shape != t.shape]
    if wrong:  # checked for every tensor before any is copied: no half-loaded model
        name, theirs, ours = wrong[0]
        raise ValueError(f"{name}: the file holds {tuple(theirs)}, the model {tuple(ours)} ({len(wrong)} such)")
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)


# -- switching adapters off ---------------------------------------------------------------------------
def set_adapters_enabled(model: nn.Module, enabled: bool) -> None:
    """Turn every PEFT wrapper on or off; off, the model computes exactly what the base model did."""
    wrappers = peft_modules(model)
    if not wrappers:
        raise ValueError("no PEFT method is applied to this model")
    for module in wrappers:
        if getattr(module, "merged", False) and not enabled:
            raise RuntimeError("a merged LoRA layer cannot be switched off: unmerge() it first")
        module.enabled = enabled


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """``with adapters_disabled(model):`` runs the base model, then switches the adapters back on."""
    set_adapters_enabled(model, False)
    try:
        yield
    finally:
        set_adapters_enabled(model, True)


# -- the sizes a method needs ---------------------------------------------------------------------------
def model_dims(model: nn.Module) -> dict[str, int]:
    """layers, heads, kv_heads, head_dim, d_model of our models or of a ``transformers`` model."""
    c = getattr(model, "config", None)
    if c is None:
        raise TypeError(f"{type(model).__name__} has no .config: cannot read its number of layers and heads")
    if hasattr(c, "n_layers"):  # llmedu.models.TransformerConfig
        return dict(layers=c.n_layers, heads=c.n_heads, kv_heads=c.n_kv_heads, head_dim=c.head_dim, d_model=c.d_model)
    heads = c.num_attention_heads
    return dict(
        layers=c.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        d_model=c.hidden_size,
    )
