"""The lesson experience, end to end: JupyterLab in headless Chromium runs a lesson in a live kernel.

nbval proves that a notebook executes; it does not prove that a learner who opens it in JupyterLab
and clicks Run > Run All Cells sees it work. This test does exactly that, on loopback only:

1. a temporary copy of the lesson, with its outputs cleared (the committed notebook is never
   touched, and every output checked was produced by this run), is served by a fresh JupyterLab;
2. Debian's Chromium, driven by Playwright (``executable_path``: nothing is downloaded), opens
   it, waits for the kernel, runs all cells from the menu and saves the notebook;
3. the checks read both what the page draws and what JupyterLab saved: every code cell has an
   execution count, no cell raised, and each ``LiveMonitor`` left exactly one output, an
   ``image/png`` with a ``text/plain`` starting ``LiveMonitor[``, drawn as a decoded ``<img>``.

A screenshot of the monitor's cell is kept in ``artefacts/`` (git-ignored). A second test runs a
notebook that raises, to show that the checks do catch a failure.

Needs ``/usr/bin/chromium`` (``apt-get install chromium``): without it the tests are skipped,
except under CI (``CI`` set), where they fail, since CI must run them.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import nbformat
import pytest
from browser import notebook_page
from browser.jupyterlab import REPO, JupyterLab
from playwright.sync_api import sync_playwright

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
LESSON = REPO / "notebooks" / "05_transformer_from_scratch.ipynb"  # a lesson with a LiveMonitor, quick in fast mode
ARTEFACTS = REPO / "artefacts"
MONITOR_CALL = re.compile(r"\bLiveMonitor\(")
OPEN_MS, RUN_MS = 90_000, 180_000  # deadlines only: a run that finishes sooner returns sooner


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run the browser tests")
        pytest.skip(reason)
    return CHROMIUM


@pytest.fixture(scope="module")
def lab(tmp_path_factory, chromium):
    root = tmp_path_factory.mktemp("notebooks")
    with JupyterLab(root_dir=root, home=tmp_path_factory.mktemp("jupyterlab")) as server:
        yield server


@pytest.fixture(scope="module")
def browser(tmp_path_factory, chromium):
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),  # a fresh --user-data-dir
            executable_path=str(chromium),
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        yield context
        context.close()


def serve(notebook: nbformat.NotebookNode, lab: JupyterLab, name: str) -> Path:
    """Write ``notebook`` with its outputs cleared into the server's folder; returns the copy."""
    notebook = nbformat.from_dict(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    path = lab.root_dir / name
    nbformat.write(notebook, path)
    return path


def run_in_browser(browser, lab: JupyterLab, path: Path, screenshot: Path | None = None):
    """Open, Run All, save; returns (cells as drawn, notebook as saved, seconds to run all)."""
    page = browser.new_page()
    try:
        # a workspace of its own, so that JupyterLab does not also reopen the previous test's notebook
        notebook_page.open_notebook(page, lab.url(f"lab/workspaces/{path.stem}/tree/{path.name}"), OPEN_MS)
        before = notebook_page.read_cells(page)
        assert all(not cell["outputs"] for cell in before), "the served copy should start without outputs"
        start = time.perf_counter()
        notebook_page.run_all(page, RUN_MS)
        seconds = time.perf_counter() - start
        drawn = notebook_page.read_cells(page)
        notebook_page.save(page)
        if screenshot is not None:
            monitors = [i for i, cell in enumerate(nbformat.read(path, 4).cells) if MONITOR_CALL.search(cell.source)]
            if monitors:
                notebook_page.scroll_to_cell(page, monitors[0])
            screenshot.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(screenshot))
    finally:
        page.close()
    return drawn, nbformat.read(path, 4), seconds


def problems(source: nbformat.NotebookNode, drawn: list[dict], saved: nbformat.NotebookNode) -> list[str]:
    """Everything a learner would see go wrong, as sentences; empty when the lesson ran cleanly."""
    found = []
    if len(drawn) != len(source.cells) or len(saved.cells) != len(source.cells):
        return [f"{len(source.cells)} cells served, {len(drawn)} drawn, {len(saved.cells)} saved"]
    for i, (cell, shown, kept) in enumerate(zip(source.cells, drawn, saved.cells)):
        if cell.cell_type != "code":
            continue
        first_line = cell.source.strip().splitlines()[0][:60] if cell.source.strip() else ""
        where = f"cell {i} ({first_line!r})"
        if not re.fullmatch(r"\[\d+\]:", shown["prompt"]) or kept.execution_count is None:
            found.append(f"{where} has no execution count (prompt {shown['prompt']!r})")
        for out in kept.outputs:
            if out.output_type == "error":
                found.append(f"{where} raised {out.ename}: {out.evalue}")
        for text in (t for out in shown["outputs"] for t in out["stderr"]):
            if "Traceback" in text:
                found.append(f"{where} shows a traceback: {text.strip().splitlines()[-1]}")
        calls = len(MONITOR_CALL.findall(re.sub(r"#.*", "", cell.source)))
        monitors = [
            j for j, out in enumerate(kept.outputs)
            if out.get("data", {}).get("text/plain", "").startswith("LiveMonitor[")
        ]  # fmt: skip
        if calls and len(monitors) != calls:
            found.append(f"{where} creates {calls} LiveMonitor(s) but shows {len(monitors)} monitor outputs")
        for j in monitors:
            if "image/png" not in kept.outputs[j].data:
                found.append(f"{where}: the monitor's output {j} has no image/png")
            elif j >= len(shown["outputs"]) or not any(img["loaded"] for img in shown["outputs"][j]["images"]):
                found.append(f"{where}: the monitor's output {j} is not drawn as a decoded <img>")
    return found


def test_a_lesson_runs_in_jupyterlab(lab, browser):
    if not LESSON.exists():
        pytest.fail(f"{LESSON.relative_to(REPO)} is missing")
    source = nbformat.read(LESSON, 4)
    assert any(MONITOR_CALL.search(c.source) for c in source.cells if c.cell_type == "code"), (
        f"{LESSON.name} no longer uses LiveMonitor: point this test at a lesson that does"
    )
    path = serve(source, lab, LESSON.name)
    shot = ARTEFACTS / f"browser-{LESSON.stem}.png"
    drawn, saved, seconds = run_in_browser(browser, lab, path, screenshot=shot)
    print(f"Run All took {seconds:.1f} s in JupyterLab; screenshot: {shot.relative_to(REPO)}")
    found = problems(source, drawn, saved)
    assert not found, f"{LESSON.name} in JupyterLab:\n" + "\n".join(found)


def test_checks_catch_a_failing_notebook(lab, browser):
    """A cell that raises stops Run All: the checks must name the error and the cell left unrun."""
    monitor = (
        "from llmedu.viz import LiveMonitor\nimport time, math\n"
        'with LiveMonitor(title="demo") as mon:\n'
        "    for i in range(20):\n"
        "        mon.log(i, loss=math.exp(-i / 5)); time.sleep(0.05)"
    )
    source = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# A notebook that fails"),
            nbformat.v4.new_code_cell(monitor),
            nbformat.v4.new_code_cell("1 / 0"),
            nbformat.v4.new_code_cell("print('never reached')"),
        ],
        metadata={"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
    )
    drawn, saved, _ = run_in_browser(browser, lab, serve(source, lab, "fails.ipynb"))
    found = problems(source, drawn, saved)
    assert any("raised ZeroDivisionError" in p for p in found), found
    assert any(p.startswith("cell 2") and "traceback" in p for p in found), found
    assert any(p.startswith("cell 3") and "no execution count" in p for p in found), found
    assert not any(p.startswith("cell 1") for p in found), f"the monitor cell ran cleanly: {found}"
