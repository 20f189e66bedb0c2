"""The grid of the size-vs-shape study (``scaling.py``): which sizes and shapes, and the rules they keep.

    counts = check_grid(GRIDS["cpu"])            # {name: {"total", "non_embedding"}}, or a clear error
    entry = parse_entry("huge-wide=512,2,16")    # one of your own, from the command line

A ``GridEntry`` is one configuration of the study: a size (the colour of its curve) in a shape (the line
style), as overrides of ``crammed()``'s d_model, n_layers and n_heads. The default grid at the CPU shape
(``GRIDS["cpu"]``; d_model 128, 4 layers, vocabulary 4096 is ``crammed()``'s) has three sizes, about 0.3x,
1.1x and 4.5x the CPU shape's 677k non-embedding parameters, each in two shapes with the same layers x
width^2 (so the same weights in the blocks): deep and narrow, 8 layers, against shallow and wide, 2 layers
at twice the width. Heads are 32 wide where the width allows. ``check_grid`` refuses a grid whose shapes of
one size differ by more than ``PARAM_TOLERANCE`` in non-embedding parameters.

Left out: shapes other than depth against width (the paper's funnel transformers, recurrent layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...models import MaskedLM
from ...models.counting import count_parameters
from ..recipe import TINY_SHAPE, Recipe, crammed

__all__ = ["PARAM_TOLERANCE", "GridEntry", "GRIDS", "BASES", "parse_entry", "parameter_counts", "check_grid"]

PARAM_TOLERANCE = 0.10  # the shapes of one size: non-embedding parameters within 10% (largest / smallest - 1)


@dataclass(frozen=True)
class GridEntry:
    """One configuration of the study: a size (the colour of its curve) in a shape (the line style)."""

    size: str  # the group of about equal non-embedding parameters: "small", "medium", "large"
    shape: str  # "deep" (narrow) or "wide" (shallow); any label, the line style follows it
    d_model: int
    n_layers: int
    n_heads: int

    def __post_init__(self):
        for label, value in (("size", self.size), ("shape", self.shape)):
            if not isinstance(value, str) or not value or any(c in value for c in "=,- "):
                raise ValueError(f"{label} must be a non-empty label without '=', ',', '-' or spaces, got {value!r}")
        for name in ("d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{self.name}: {name} must be an int >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"{self.name}: n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                f"every head must be d_model / n_heads wide"
            )

    @property
    def name(self) -> str:
        return f"{self.size}-{self.shape}"

    def overrides(self) -> dict:
        """The fields of ``crammed(**overrides)`` this entry sets."""
        return {"d_model": self.d_model, "n_layers": self.n_layers, "n_heads": self.n_heads}


# The base shape each grid is built around: overrides of crammed() (the batch, the vocabulary).
BASES: dict[str, dict] = {"cpu": {}, "tiny": dict(TINY_SHAPE)}
# Per size, two shapes with the same n_layers * d_model^2: 8 layers against 2 layers at twice the width.
GRIDS: dict[str, tuple[GridEntry, ...]] = {
    "cpu": (
        GridEntry("small", "deep", 48, 8, 2),  # 192k non-embedding parameters (0.28x the CPU shape's 677k)
        GridEntry("small", "wide", 96, 2, 3),  # 198k
        GridEntry("medium", "deep", 96, 8, 3),  # 752k (1.1x)
        GridEntry("medium", "wide", 192, 2, 6),  # 780k
        GridEntry("large", "deep", 192, 8, 6),  # 2.99M (4.4x)
        GridEntry("large", "wide", 384, 2, 12),  # 3.10M
    ),
    "tiny": (  # for smoke runs, around TINY_SHAPE (d 64, 2 layers, vocabulary 1024)
        GridEntry("small", "deep", 32, 8, 2),  # 85k non-embedding parameters
        GridEntry("small", "wide", 64, 2, 2),  # 87k: TINY_SHAPE itself
        GridEntry("large", "deep", 64, 8, 2),  # 334k
        GridEntry("large", "wide", 128, 2, 4),  # 346k
    ),
}


def parse_entry(text: str, grid: str = "cpu") -> GridEntry:
    """A grid entry from the command line: a name of ``GRIDS[grid]`` ("medium-deep"), or
    "SIZE-SHAPE=D_MODEL,N_LAYERS,N_HEADS" for one of your own ("huge-wide=512,2,16")."""
    if grid not in GRIDS:
        raise ValueError(f"unknown grid {grid!r}; available: {', '.join(GRIDS)}")
    known = {e.name: e for e in GRIDS[grid]}
    if text in known:
        return known[text]
    if "=" not in text:
        raise ValueError(
            f"unknown grid entry {text!r}: the {grid} grid has {', '.join(known)}; "
            f"or write SIZE-SHAPE=D_MODEL,N_LAYERS,N_HEADS, e.g. huge-wide=512,2,16"
        )
    name, spec = text.split("=", 1)
    size, _, shape = name.partition("-")
    numbers = spec.split(",")
    if not shape or len(numbers) != 3 or not all(n.strip().isdigit() for n in numbers):
        raise ValueError(
            f"cannot read the grid entry {text!r}: write SIZE-SHAPE=D_MODEL,N_LAYERS,N_HEADS, e.g. huge-wide=512,2,16"
        )
    d_model, n_layers, n_heads = (int(n) for n in numbers)
    return GridEntry(size, shape, d_model, n_layers, n_heads)


def parameter_counts(recipe: Recipe) -> dict[str, int]:
    """{"total", "non_embedding"} of the MaskedLM the recipe builds (``count_parameters``; the tied decoder
    counts once, with the embeddings)."""
    model = MaskedLM(recipe.model)
    return {"total": count_parameters(model), "non_embedding": count_parameters(model, embeddings=False)}


def check_grid(grid: Sequence[GridEntry], base: dict | None = None, tolerance: float = PARAM_TOLERANCE) -> dict:
    """{name: parameter_counts} of the grid's models; a clear error for a grid that breaks the rules.

    The rules: at least one entry, distinct names, and the shapes of one size within ``tolerance`` of each
    other in non-embedding parameters (largest / smallest - 1), so that "same size" means something.
    """
    base = dict(base or {})
    if not grid:
        raise ValueError("the grid is empty: give at least one entry")
    names = [e.name for e in grid]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"the grid names {', '.join(repeated)} more than once")
    counts = {e.name: parameter_counts(crammed(**{**base, **e.overrides()})) for e in grid}
    for size in dict.fromkeys(e.size for e in grid):
        members = {e.name: counts[e.name]["non_embedding"] for e in grid if e.size == size}
        low, high = min(members.values()), max(members.values())
        if high / low - 1 > tolerance:
            listed = ", ".join(f"{n} {p:,}" for n, p in members.items())
            raise ValueError(
                f"the shapes of size {size!r} differ by {high / low - 1:.0%} in non-embedding parameters "
                f"({listed}), more than the tolerance of {tolerance:.0%}: change a width or a depth, or call "
                f"them different sizes"
            )
    return counts
