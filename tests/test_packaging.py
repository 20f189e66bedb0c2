"""The set-up files agree with each other, and the README's commands are the ones CI runs."""

import ast
import json
import re
import sys
from importlib import metadata
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


@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
def test_every_lesson_says_its_mode_first(notebook):
    """A reader who opens a lesson learns at once whether it runs small or full and how to switch (#18)."""
    cells = json.loads((ROOT / "notebooks" / notebook).read_text())["cells"]
    first = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
    assert "runtime.mode_banner()" in first, f"{notebook}: the first code cell must print runtime.mode_banner()"


@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
def test_readme_says_the_mode_each_lesson_is_committed_in(notebook):
    """The syllabus's mode column is the mode recorded in the notebook by notebooks/execute.py."""
    recorded = json.loads((ROOT / "notebooks" / notebook).read_text())["metadata"].get("llmedu", {}).get("mode")
    row = re.search(rf"^\| [^|]+ \| \[[^\]]+\]\(notebooks/{re.escape(notebook)}\) \|[^|]+\| (\w+)", _readme(), re.M)
    assert row, f"README's syllabus has no row for {notebook}"
    assert recorded in ("fast", "full"), f"{notebook}: no llmedu.mode in its metadata; run notebooks/execute.py"
    assert row.group(1) == recorded, f"README says {notebook} is committed in {row.group(1)} mode; it was {recorded}"


@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
def test_no_lesson_leaves_a_temporary_folder_behind(notebook):
    """tempfile.mkdtemp is never removed: lesson 25 left its run folders in /tmp at every run (1.3 GB of
    checkpoints in full mode). A lesson opens a TemporaryDirectory in a `with` block, or holds one and calls
    its cleanup(): its finalizer alone does not run when the kernel is killed, as nbval kills it."""
    cells = json.loads((ROOT / "notebooks" / notebook).read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "mkdtemp(" not in code, f"{notebook}: tempfile.mkdtemp leaves its folder behind; use TemporaryDirectory"
    held = len(re.findall(r"TemporaryDirectory\(", code)) - len(
        re.findall(r"with (tempfile\.)?TemporaryDirectory\(", code)
    )
    assert held == 0 or ".cleanup()" in code, f"{notebook}: a TemporaryDirectory outside `with` is never cleaned up"


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _requirement_name(requirement: str) -> str:
    """'transformers>=4.46' -> 'transformers', normalised as PyPI compares names."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def _imported_modules(source: str) -> set[str]:
    """Top-level module names imported anywhere in ``source`` (lazy imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _lesson_and_library_imports() -> dict[str, str]:
    """Module name -> one file that imports it, over every lesson's code cells and the library."""
    found = {}
    for path in sorted((ROOT / "llmedu").rglob("*.py")):
        for name in _imported_modules(path.read_text()):
            found.setdefault(name, str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":  # IPython magics and shell escapes are not Python
                lines = [
                    line for line in "".join(cell["source"]).splitlines() if not line.lstrip().startswith(("%", "!"))
                ]
                for name in _imported_modules("\n".join(lines)):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_lab_set_up_provides_every_import_of_the_lessons():
    """The README's lab set-up (`pip install -e ".[lab]"`) must run every lesson: each third-party module
    that a notebook or the library imports comes from a dependency, the lab extra, or what those two
    require directly (IPython through ipywidgets). Fails, naming the module, when a lesson imports more."""
    project = _pyproject()["project"]
    direct = {_requirement_name(r) for r in project["dependencies"] + project["optional-dependencies"]["lab"]}
    provided = set(direct)
    for dist in direct:
        provided |= {_requirement_name(r) for r in metadata.requires(dist) or [] if "extra ==" not in r}
    distributions = metadata.packages_distributions()
    missing = []
    for module, where in sorted(_lesson_and_library_imports().items()):
        # pip: the data set-up step reads pip's own default index; every environment that ran the
        # README's `pip install` has it
        if module in sys.stdlib_module_names or module in ("llmedu", "__future__", "pip"):
            continue
        dists = {_requirement_name(d) for d in distributions.get(module, [])}
        assert dists, f"{where} imports {module!r}, which no installed distribution provides"
        if not dists & provided:
            missing.append(f"{module} (from {where}; distribution {', '.join(sorted(dists))})")
    assert not missing, "the lab extra does not install what these lessons import: " + "; ".join(missing)


def test_runs_from_the_folder_above_a_checkout(tmp_path):
    """A checkout is a folder named llmedu/ with a data/ folder in it. Run from the folder above, Python
    must still import the installed llmedu, not that folder as a namespace package (whose data/ would
    hide llmedu.data): the editable install puts the checkout on sys.path instead of an import hook."""
    import subprocess

    (tmp_path / "llmedu" / "data").mkdir(parents=True)
    (tmp_path / "llmedu" / "data" / "README.md").write_text("a checkout's data folder\n")
    code = "import llmedu, llmedu.data.classification; print(llmedu.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith(str(Path("llmedu", "__init__.py")))
