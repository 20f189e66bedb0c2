"""notebooks/refresh_listings.py: the source a lesson prints with ``llmedu.show`` is the library's as it stands."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
spec = importlib.util.spec_from_file_location("refresh_listings", NOTEBOOKS / "refresh_listings.py")
listings = importlib.util.module_from_spec(spec)
spec.loader.exec_module(listings)


def test_only_the_statements_that_open_a_cell_and_show_are_a_listing():
    assert listings.listing_prefix("from llmedu import show\nshow(math.sqrt)\nx = 1\nshow(f)") == (
        "from llmedu import show\nshow(math.sqrt)"
    )
    assert listings.listing_prefix("for f in fs:\n    llmedu.show(f)") == "for f in fs:\n    llmedu.show(f)"
    assert listings.listing_prefix("x = 1\nshow(f)") is None  # computes first: left to execute.py
    assert listings.listing_prefix("print(f)") is None
    assert listings.listing_prefix("import math") is None


def test_a_stale_listing_is_found_and_refreshed(tmp_path):
    stale = nbformat.v4.new_output("display_data", data={"text/plain": "def old(): ..."})
    printed = nbformat.v4.new_output("stream", name="stdout", text="2\n")
    source = "import json\nfrom llmedu import show\nshow(json.dumps)\nprint(1 + 1)"
    cell = nbformat.v4.new_code_cell(source, outputs=[stale, printed])
    path = tmp_path / "00_x.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    assert listings.refresh(path, check=True) == [0]
    assert nbformat.read(path, as_version=4).cells[0].outputs == [stale, printed]  # --check changes nothing
    assert listings.refresh(path, check=False) == [0]
    listing, after = nbformat.read(path, as_version=4).cells[0].outputs
    assert listing["data"]["text/plain"].startswith("def dumps(") and after == printed  # what it computes is kept
    assert listings.refresh(path, check=True) == []


def test_every_saved_listing_is_the_current_source():
    """Run as a reader would run the tool, in its own process. In the test process it failed in a full run:
    a lesson's import reaches torch.utils.cpp_extension, whose setuptools replaces distutils, and setuptools'
    shim asserts when an earlier test has already imported the standard library's distutils."""
    done = subprocess.run(
        [sys.executable, str(NOTEBOOKS / "refresh_listings.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, f"{done.stdout}{done.stderr[-2000:]}\nrun: python notebooks/refresh_listings.py"
