"""Refresh the source listings that lessons print with ``llmedu.show(...)`` after the library changes.

    python notebooks/refresh_listings.py                  # every lesson
    python notebooks/refresh_listings.py notebooks/11_data_parallel.ipynb
    python notebooks/refresh_listings.py --check          # exit 1 if a saved listing is out of date

A lesson committed in full mode can take an hour to execute again; its ``show`` cells only print the
library's current source. This rewrites those outputs, and nothing else, from the code as it stands, so
that the page never shows a function that no longer reads that way. Only the outputs of the statements a
cell opens with are refreshed, and only when they import and show (a for loop of ``show`` calls counts);
whatever the cell computes after them keeps its saved output, and is left to ``execute.py``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _is_listing(node: ast.stmt) -> bool:
    """An import, a ``show(x)`` call, or a for loop of them."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    if isinstance(node, ast.For):
        return all(_is_listing(n) for n in node.body) and not node.orelse
    call = node.value if isinstance(node, ast.Expr) else None
    if not isinstance(call, ast.Call) or len(call.args) != 1 or call.keywords:
        return False
    return (call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)) == "show"


def listing_prefix(source: str) -> str | None:
    """The statements a cell opens with that only import and show (the cell may compute after them), or None."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    prefix = []
    for node in tree.body:
        if not _is_listing(node):
            break
        prefix.append(node)
    if not any(not isinstance(n, (ast.Import, ast.ImportFrom)) for n in prefix):
        return None
    return "\n".join(ast.unparse(n) for n in prefix)


def imports_of(nb) -> str:
    """Every top-level import statement of a notebook's code cells, in order."""
    lines = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        lines += [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return "\n".join(lines)


def listing_outputs(objects: list) -> list[dict]:
    """The outputs ``llmedu.show`` gives in Jupyter: one display of highlighted code per object."""
    import inspect

    import nbformat
    from IPython.core.formatters import DisplayFormatter
    from IPython.display import Code

    formatter = DisplayFormatter()
    outputs = []
    for obj in objects:
        data, metadata = formatter.format(Code(inspect.getsource(obj), language="python"))
        outputs.append(nbformat.v4.new_output("display_data", data=data, metadata=metadata))
    return outputs


def refresh(path: Path, check: bool) -> list[int]:
    """Refresh one lesson's listings; return the indices of the cells whose listing was out of date."""
    import nbformat

    import llmedu

    nb = nbformat.read(path, as_version=4)
    shown: list = []
    real_show, llmedu.show = llmedu.show, shown.append  # the lesson's own code picks what is shown; we collect it
    try:
        namespace: dict = {}
        exec(imports_of(nb), namespace)  # the lesson's own imports: our package, never a downloaded file
        stale = []
        for i, cell in enumerate(nb.cells):
            prefix = listing_prefix(cell.source) if cell.cell_type == "code" and cell.outputs else None
            if prefix is None:
                continue
            shown.clear()
            exec(compile(prefix, str(path), "exec"), namespace)
            new, old = listing_outputs(shown), cell.outputs[: len(shown)]
            if not all(o.get("output_type") == "display_data" for o in old) or len(old) < len(new):
                raise ValueError(f"{path.name} cell {i}: its first outputs are not the {len(new)} listings it shows")
            if [o.get("data", {}).get("text/plain") for o in old] != [o["data"].get("text/plain") for o in new]:
                stale.append(i)
                cell.outputs = new + cell.outputs[len(new) :]
    finally:
        llmedu.show = real_show
    if stale and not check:
        nbformat.write(nb, path)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="lessons to refresh (default: every lesson)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a listing is out of date")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(HERE.glob("[0-9][0-9]*_*.ipynb"))
    out_of_date = 0
    for path in paths:
        stale = refresh(path, args.check)
        out_of_date += len(stale)
        if stale:
            print(f"{path.name}: {'out of date' if args.check else 'refreshed'} cells {stale}")
    return 1 if args.check and out_of_date else 0


if __name__ == "__main__":
    sys.exit(main())
