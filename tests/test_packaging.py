"""The set-up files agree with each other, and the README's commands are the ones CI runs."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _environment_pip_lines():
    text = (ROOT / "environment.yml").read_text()
    block = text.split("- pip:", 1)[1]
    return [m.group(1).strip() for m in re.finditer(r"^\s+-\s+(.+)$", block, re.M)]


def test_environment_yml_matches_pyproject():
    project = _pyproject()["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["lab"])
    lines = _environment_pip_lines()
    assert set(lines) - {"-e .[dev]"} == wanted, "environment.yml and pyproject.toml list different pins"
    assert "-e .[dev]" in lines
    python = re.search(r"^\s+-\s+python(.+)$", (ROOT / "environment.yml").read_text(), re.M).group(1)
    assert python.strip() == project["requires-python"]


def test_pins_are_ranges_not_exact_versions():
    project = _pyproject()["project"]
    every = list(project["dependencies"]) + [d for ds in project["optional-dependencies"].values() for d in ds]
    exact = [d for d in every if "==" in d]
    assert not exact, f"exact pins rot; use lower bounds: {exact}"


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", readme, re.S)
    assert match, "README.md must mark its test command with <!-- test-command -->"
    command = match.group(1).strip()
    assert command in ci, f"CI does not run the README's test command:\n{command}"


@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
def test_readme_links_every_notebook(notebook):
    assert f"notebooks/{notebook}" in (ROOT / "README.md").read_text()
