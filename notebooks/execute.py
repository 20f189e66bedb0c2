"""Re-execute lesson notebooks from a clean kernel and save them with outputs and clean metadata.

    python notebooks/execute.py                      # every notebook, fast mode
    python notebooks/execute.py notebooks/00_hardware.ipynb
    python notebooks/execute.py --full               # full mode
    python notebooks/execute.py --as-committed       # each in the mode its saved outputs came from

This is how the committed notebooks are produced, so that a reader on the web sees the plots. The
rule: a lesson is committed executed in its full mode where that runs on 2 CPU cores in reasonable
time (under ~15 minutes; the PEFT lesson and the capstone once, longer), so that its saved outputs
show the real effect; the mode is recorded in the notebook's metadata (``llmedu.mode``) and printed
by its first cell. CI executes every notebook in fast mode through nbval regardless.
Each notebook runs in its own fresh kernel with the notebooks folder as working directory. The
metadata that changes from run to run (timings, Python patch version, widget state) is dropped so
that diffs show only what a lesson really changed. A notebook that raises is not saved, and the
command exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def clean(nb, mode: str) -> None:
    """Keep only metadata that means something to a reader, and the mode the outputs came from."""
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "llmedu": {"mode": mode},
    }
    for cell in nb.cells:
        for key in ("execution", "collapsed", "scrolled", "ExecuteTime"):
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            for output in cell.get("outputs", []):
                output.get("metadata", {}).pop("execution", None)


def execute(path: Path, fast: bool, timeout: int) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    os.environ["LLMEDU_FAST"] = "1" if fast else "0"
    start = time.perf_counter()
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    seconds = time.perf_counter() - start
    clean(nb, "fast" if fast else "full")
    nbformat.write(nb, path)
    return seconds


def committed_mode(path: Path) -> str:
    """The mode a committed notebook's outputs came from (fast when it was never recorded)."""
    import nbformat

    mode = nbformat.read(path, as_version=4).metadata.get("llmedu", {}).get("mode", "fast")
    if mode not in ("fast", "full"):
        raise ValueError(f"{path.name}: metadata llmedu.mode is {mode!r}, expected 'fast' or 'full'")
    return mode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--full", action="store_true", help="full mode instead of the fast mode")
    modes.add_argument("--as-committed", action="store_true", help="each notebook in its recorded mode")
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per cell")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(HERE.glob("[0-9][0-9]*_*.ipynb"))
    failed = []
    for path in paths:
        if not path.is_file() or path.suffix != ".ipynb":
            parser.error(f"{path} is not a notebook file")
        try:
            mode = committed_mode(path) if args.as_committed else "full" if args.full else "fast"
            seconds = execute(path.resolve(), fast=mode == "fast", timeout=args.timeout)
            print(f"ok     {path.name}  {mode}  {seconds:6.1f} s")
        except Exception as err:  # report every notebook, then fail
            failed.append(path.name)
            print(f"FAILED {path.name}: {type(err).__name__}: {str(err)[-2000:]}")
    if failed:
        print(f"{len(failed)} notebook(s) failed and were not saved: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
