"""notebooks/execute.py: the tool that makes the committed notebooks records the mode they ran in."""

import importlib.util
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
spec = importlib.util.spec_from_file_location("execute", NOTEBOOKS / "execute.py")
execute = importlib.util.module_from_spec(spec)
spec.loader.exec_module(execute)


def lesson(tmp_path, metadata=None):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    nb.metadata.update(metadata or {})
    path = tmp_path / "00_x.ipynb"
    nbformat.write(nb, path)
    return path


def test_clean_keeps_the_mode_and_drops_run_to_run_metadata():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
    nb.metadata["widgets"] = {"state": 1}
    nb.cells[0].metadata["execution"] = {"iopub.status.busy": "now"}
    execute.clean(nb, "full")
    assert nb.metadata["llmedu"] == {"mode": "full"}
    assert "widgets" not in nb.metadata and "execution" not in nb.cells[0].metadata


def test_committed_mode_is_read_back(tmp_path):
    assert execute.committed_mode(lesson(tmp_path, {"llmedu": {"mode": "full"}})) == "full"
    assert execute.committed_mode(lesson(tmp_path)) == "fast"  # never recorded: made before the rule


def test_a_mode_that_is_neither_is_refused(tmp_path):
    with pytest.raises(ValueError, match="llmedu.mode is 'slow'"):
        execute.committed_mode(lesson(tmp_path, {"llmedu": {"mode": "slow"}}))


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb")), ids=lambda p: p.name)
def test_every_lesson_records_a_known_mode(path):
    assert execute.committed_mode(path) in ("fast", "full")
