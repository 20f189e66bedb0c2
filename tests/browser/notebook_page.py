"""Drive one notebook in JupyterLab the way a learner does, and read back what the page shows.

Everything here waits on what JupyterLab draws (the kernel status, the ``[*]``/``[n]`` prompts)
with a deadline, never on a fixed sleep, so that a slow machine makes the test slower, not flaky.
The selectors are JupyterLab 4's own CSS classes:

* ``.jp-Notebook-ExecutionIndicator[data-status]``: the kernel status in the notebook toolbar;
* ``.jp-InputPrompt``: a code cell's prompt, ``[ ]:`` never run, ``[*]:`` queued or running,
  ``[3]:`` done;
* ``.lm-Menu-item[data-command=...]``: menu entries by command id, not by their (translatable) label;
* ``.jp-OutputArea-child``: one output of a cell; an error or a stream on stderr is rendered as
  ``.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]``, an ``image/png`` as an
  ``<img>``.
"""

from __future__ import annotations

import re

from playwright.sync_api import Page

STDERR = '.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]'

# One snapshot of the notebook as drawn: per cell its type, prompt and outputs.
_READ_CELLS = f"""() => [...document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')].map(cell => ({{
    code: cell.classList.contains('jp-CodeCell'),
    prompt: (cell.querySelector('.jp-InputArea .jp-InputPrompt')?.textContent ?? '').trim(),
    outputs: [...cell.querySelectorAll('.jp-OutputArea-child')].map(out => ({{
        images: [...out.querySelectorAll('img')].map(img => ({{
            loaded: img.complete && img.naturalWidth > 0,
            width: img.naturalWidth,
            height: img.naturalHeight,
        }})),
        stderr: [...out.querySelectorAll('{STDERR}')].map(e => e.textContent),
    }})),
}}))"""

# Done when the kernel is idle, no cell is queued or running, and either every code cell has an
# execution count or one of them failed (Run All stops at the first error, leaving the rest [ ]).
_RUN_FINISHED = f"""() => {{
    const status = document.querySelector('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator');
    const prompts = [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell .jp-InputArea .jp-InputPrompt')]
        .map(p => p.textContent.trim());
    const failed = [...document.querySelectorAll('.jp-NotebookPanel {STDERR}')]
        .some(e => e.textContent.includes('Traceback'));
    return status?.dataset.status === 'idle' && !prompts.includes('[*]:')
        && (failed || prompts.every(p => /^\\[\\d+\\]:$/.test(p)));
}}"""


def open_notebook(page: Page, url: str, timeout_ms: float) -> None:
    """Open a notebook and wait until its kernel has started and is idle."""
    page.goto(url)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=timeout_ms)
    # The toolbar indicator reads idle before a kernel exists; the status bar names the kernel
    # only once it is connected.
    page.wait_for_selector('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=timeout_ms)
    page.get_by_text(re.compile(r"\| Idle$")).wait_for(timeout=timeout_ms)


def run_all(page: Page, timeout_ms: float) -> None:
    """Run > Run All Cells, from the menu bar, then wait until the run has finished or failed."""
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
    page.wait_for_function(_RUN_FINISHED, timeout=timeout_ms, polling=250)


def save(page: Page, timeout_ms: float = 30_000) -> None:
    """File > Save Notebook, and wait until the tab no longer marks unsaved changes."""
    page.get_by_role("menuitem", name="File", exact=True).click()
    page.locator('.lm-Menu-item[data-command="docmanager:save"]').click()
    page.locator(".lm-TabBar-tab.jp-mod-dirty").wait_for(state="detached", timeout=timeout_ms)


def read_cells(page: Page) -> list[dict]:
    """Every cell as drawn: ``{"code", "prompt", "outputs": [{"images", "stderr"}]}``, in order."""
    return page.evaluate(_READ_CELLS)


def scroll_to_cell(page: Page, index: int) -> None:
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").nth(index).scroll_into_view_if_needed()
