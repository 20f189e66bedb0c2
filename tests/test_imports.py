"""The shape of the library: no import circles in llmedu/, parallel/ below the planner, every file readable.

The import graph is read from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` in a module, at the top or inside a function, relative ones resolved against the
module's package. ``from X import n`` depends on X, and on X.n where that is a module of ours; importing
X.n also runs the packages above it (their ``__init__``), so those count too, except the importer's own
packages (a package's ``__init__`` importing its submodules, which import each other, is how packages
are built, not a circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "llmedu"
MAX_LINES = 350


def modules(library: Path = LIBRARY) -> dict[str, tuple[Path, bool]]:
    """Every module of the library: dotted name -> (file, is it a package's __init__)."""
    found = {}
    for path in sorted(library.rglob("*.py")):
        parts = path.relative_to(library.parent).with_suffix("").parts
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports_of(name: str, source: str, package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports anywhere in ``source`` (see the module docstring)."""
    here = name if package else name.rpartition(".")[0]  # the package that relative imports start from
    targets = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                if node.level - 1 >= len(base):
                    raise ValueError(f"{name}: a relative import (level {node.level}) goes above the library")
                base = ".".join(base[: len(base) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            targets.add(target)
            targets.update(f"{target}.{alias.name}" for alias in node.names)
    own = set(_ancestors(name))
    found = set()
    for target in targets:
        for module in (*_ancestors(target), target):
            if module in known and module not in own and module != name:
                found.add(module)
    return found


def import_graph(library: Path = LIBRARY) -> dict[str, set[str]]:
    found = modules(library)
    known = set(found)
    return {name: imports_of(name, path.read_text(), package, known) for name, (path, package) in found.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle in each strongly connected group of ``graph`` (Tarjan 1972), as a path [a, b, ..., a]."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def connect(v: str) -> None:  # recursive: the library's depth is a few dozen modules at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_circle_in(graph, group) for group in groups]


def _circle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A path from the group's first member back to it, inside the group (breadth first: a shortest one)."""
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph.get(path[-1], ())):
            if w == start:
                return path + [start]
            if w in group and w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"no circle found in the group {sorted(group)}")


# -- the finder itself, on small graphs with known answers ------------------------------------------------
def test_the_cycle_finder_finds_a_circle_and_names_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"x": {"x"}}) == [["x", "x"]]  # a module that imports itself
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []  # a diamond is no circle
    two = find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}})
    assert sorted(two) == [["a", "b", "a"], ["c", "d", "c"]]


def test_imports_are_resolved_relative_and_inside_functions():
    known = {"pkg", "pkg.low", "pkg.high", "pkg.sub", "pkg.sub.leaf", "other"}
    source = "from ..low import x\ndef f():\n    from ..high import y\n    import other\n"
    assert imports_of("pkg.sub.leaf", source, False, known) == {"pkg.low", "pkg.high", "other"}
    # a package's own relative import starts from itself; `from . import m` depends on the module m
    assert imports_of("pkg.sub", "from . import leaf\n", True, known) == {"pkg.sub.leaf"}
    assert imports_of("pkg.low", "import pkg.sub.leaf\n", False, known) == {"pkg.sub", "pkg.sub.leaf"}


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    """Two fake modules that import each other, one of them inside a function, as shared_cores and the
    time model once did: the graph of the files has the circle."""
    package = tmp_path / "fake"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cost.py").write_text("from .cores import hops\n")
    (package / "cores.py").write_text("def hops():\n    from .cost import step\n")
    assert find_cycles(import_graph(package)) == [["fake.cores", "fake.cost", "fake.cores"]]


# -- the library ----------------------------------------------------------------------------------------
def test_there_is_no_import_circle_in_the_library():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_parallel_never_imports_the_planner():
    """The techniques (parallel) sit below the planner that chooses among them: not even through another room."""
    graph = import_graph()
    assert "llmedu.planner" in graph, "the planner has moved: update this test"
    wrong = []
    for name in sorted(m for m in graph if m == "llmedu.parallel" or m.startswith("llmedu.parallel.")):
        paths, seen = [[name]], {name}
        while paths:
            path = paths.pop(0)
            if path[-1] == "llmedu.planner" or path[-1].startswith("llmedu.planner."):
                wrong.append(" -> ".join(path))
                break
            for w in sorted(graph[path[-1]] - seen):
                seen.add(w)
                paths.append(path + [w])
    assert not wrong, "parallel imports the planner: " + "; ".join(wrong)


def test_no_library_file_is_over_350_lines():
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in LIBRARY.rglob("*.py")}
    too_long = {path: n for path, n in sorted(lengths.items()) if n > MAX_LINES}
    assert not too_long, f"over {MAX_LINES} lines: " + ", ".join(f"{p} ({n})" for p, n in too_long.items())
