"""No text a user reads names an issue number of this project.

A reader of the README, a lesson, a docstring, an error message or a command's ``--help`` has no
issue tracker to look "issue #26" up in: the text must say what it means. The history of a change
belongs in the commit log. Checked here: README.md, every notebook's markdown and code cells, every
docstring and string literal of the library, the benchmarks and ``notebooks/execute.py`` (read with
``ast``, so comments are left alone), and the ``--help`` of every command-line entry, each subcommand's
included.

A citation of another project's issue or pull request stays: ``pytorch/pytorch#94819``,
``NVIDIA/nccl issue 601``, ``deepspeedai/DeepSpeed PR #338``. Six- and eight-digit ``#NNNNNN``
are colours, not issues.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# owner/repo#N, owner/repo issue N, owner/repo PR #N: a citation of another project, removed before the check
CITATION = re.compile(r"[\w.-]+/[\w.-]+(?:#|\s+(?:issues?|PRs?|pull\s+requests?)\s*#?\s*)\d+", re.I)
ISSUE = re.compile(
    r"\bissues?\s*#\s*\d+"  # issue #26, issues #11, Issue#5
    r"|\bissues?\s+\d+\b"  # issue 23
    r"|(?<![&\w])#\d+\b",  # (#24), #26's, see #3; not &#39; (HTML) nor name#3 (an anchor)
    re.I,
)
COLOUR = re.compile(r"#\d{6}(?:\d{2})?")


def issue_references(text: str) -> list[str]:
    """Each issue-number reference in ``text``, with a little of its context."""
    text = CITATION.sub(lambda m: " " * len(m.group(0)), text)
    found = []
    for m in ISSUE.finditer(text):
        if COLOUR.fullmatch(m.group(0)):
            continue
        context = text[max(0, m.start() - 40) : m.end() + 30]
        found.append(" ".join(context.split()))
    return found


def _report(offences: list[str]) -> str:
    return (
        f"{len(offences)} issue-number reference(s) in user-facing text; say what is meant instead "
        "(cite another project as owner/repo#N):\n" + "\n".join(offences)
    )


# -- the pattern itself -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "the protocol of issue #26",
        "Issue 23 asked for it",
        "see issues #11 and #12",
        "a faster cache (#24)",
        "#26's protocol",
        "ISSUE#5",
        "as #18 requires",
    ],
)
def test_the_pattern_catches_an_issue_number(text):
    assert issue_references(text), text


@pytest.mark.parametrize(
    "text",
    [
        "pytorch/pytorch#94819",
        "a fault of torch (pytorch/pytorch#94819) that we work around",
        "NVIDIA/nccl#601",
        "NVIDIA/nccl issue 601: it aggregates the NICs",
        "deepspeedai/DeepSpeed PR #338",
        "https://github.com/pytorch/pytorch/issues/94819",
        'color="#555555"',
        'fc="#1f77b4"',
        "&#39; is an apostrophe",
        "a list of issues to watch",
        "# 1. a numbered comment",
    ],
)
def test_the_pattern_allows_citations_and_other_hashes(text):
    assert not issue_references(text), issue_references(text)


# -- the texts ----------------------------------------------------------------------------------


def test_readme():
    text = (ROOT / "README.md").read_text()
    offences = []
    for number, line in enumerate(text.splitlines(), 1):
        offences += [f"README.md:{number}: {hit}" for hit in issue_references(line)]
    assert not offences, _report(offences)


@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_notebook_cells(notebook):
    cells = json.loads((ROOT / "notebooks" / notebook).read_text())["cells"]
    offences = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] in ("markdown", "code"):
            source = "".join(cell["source"])
            where = f"notebooks/{notebook}, cell {index} ({cell['cell_type']})"
            offences += [f"{where}: {hit}" for hit in issue_references(source)]
    assert not offences, _report(offences)


def _python_files() -> list[Path]:
    return sorted(
        [
            *(ROOT / "llmedu").rglob("*.py"),
            *(ROOT / "benchmarks").glob("*.py"),
            *(ROOT / "notebooks").glob("*.py"),
        ]
    )


def _string_offences(path: Path, root: Path = ROOT) -> list[str]:
    """Docstrings and string literals (f-strings' literal parts too), in line order; comments are not read."""
    strings = [
        node
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]
    offences = []
    for node in sorted(strings, key=lambda node: node.lineno):
        offences += [f"{path.relative_to(root)}:{node.lineno}: {hit}" for hit in issue_references(node.value)]
    return offences


def test_library_and_script_strings():
    offences = [offence for path in _python_files() for offence in _string_offences(path)]
    assert not offences, _report(offences)


def test_a_string_in_a_module_is_read(tmp_path):
    """The walk reaches docstrings, messages and f-strings, and leaves comments alone."""
    module = tmp_path / "m.py"
    module.write_text(
        '"""The protocol of issue #26."""\n'
        "# issue #1 in a comment is not user-facing\n"
        "def f(x):\n"
        '    raise ValueError(f"x={x} breaks (#24)")\n'
    )
    offences = _string_offences(module, root=tmp_path)
    assert len(offences) == 2, offences
    assert offences[0].startswith("m.py:1: ") and "issue #26" in offences[0], offences
    assert offences[1].startswith("m.py:4: ") and "(#24)" in offences[1], offences


# -- the command-line entries -------------------------------------------------------------------


def _is_argparse_script(path: Path) -> bool:
    text = path.read_text()
    return "argparse" in text and re.search(r"""if __name__ == ["']__main__["']""", text) is not None


def _entries() -> list[tuple[str, str]]:
    """Every command a user runs: ``-m`` for the library's packages and modules, the scripts by path."""
    entries = []
    for path in sorted((ROOT / "llmedu").rglob("*.py")):
        if path.name == "__main__.py":
            entries.append(("-m", ".".join(path.parent.relative_to(ROOT).parts)))
        elif _is_argparse_script(path):
            entries.append(("-m", ".".join(path.with_suffix("").relative_to(ROOT).parts)))
    for path in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "notebooks").glob("*.py")]):
        if _is_argparse_script(path):
            entries.append(("path", str(path.relative_to(ROOT))))
    return entries


def _subcommands(help_text: str) -> list[str]:
    """argparse prints a parser's subcommands as a line of their own: ``  {fetch,list,where}``."""
    names = []
    for m in re.finditer(r"^\s+\{([\w-]+(?:,[\w-]+)*)\}\s*$", help_text, re.M):
        names += [name for name in m.group(1).split(",") if name not in names]
    return names


def _all_helps(entries: list[tuple[str, str]]) -> dict[str, dict]:
    """``--help`` of each entry and of each of its subcommands (two levels), all run in this process.

    One process for all rather than one per command: the entries are two dozen commands, and each new
    interpreter would import torch again. Each runs as ``python -m`` or the script would (``runpy``), from
    the repository (the caller's working folder and ``sys.path[0]``). Returns ``{"python -m x sub --help": {"text": ..., "error": ...}}``, where ``error`` says
    why a command's text could not be read (an exception, or a nonzero exit)."""
    import contextlib
    import io
    import runpy
    import traceback

    helps = {}
    for kind, target in entries:
        shown_entry = f"python -m {target}" if kind == "-m" else f"python {target}"
        todo = [()]
        while todo:
            args = todo.pop(0)
            shown = " ".join([shown_entry, *args, "--help"])
            sys.argv = [target, *args, "--help"]
            if kind == "path":
                sys.path.insert(0, str((ROOT / target).parent))
            out, error = io.StringIO(), None
            try:
                with contextlib.redirect_stdout(out):
                    if kind == "-m":
                        runpy.run_module(target, run_name="__main__", alter_sys=True)
                    else:
                        runpy.run_path(target, run_name="__main__")
            except SystemExit as exit:
                if exit.code not in (0, None):
                    error = f"exited with {exit.code!r}"
            except Exception:
                error = "raised:\n" + traceback.format_exc(limit=-4)
            finally:
                if kind == "path":
                    sys.path.remove(str((ROOT / target).parent))
            helps[shown] = {"text": out.getvalue(), "error": error}
            if error is None and len(args) < 2:
                todo += [(*args, name) for name in _subcommands(out.getvalue())]
    return helps


def test_every_entry_is_found():
    """The commands the README and the lessons name are among the entries checked below."""
    found = {" ".join(entry) for entry in _entries()}
    for entry in ("-m llmedu.cramming", "-m llmedu.data", "-m llmedu.parallel.example", "path notebooks/execute.py"):
        assert entry in found, f"{entry} is not found as a command-line entry: {sorted(found)}"


def test_subcommands_are_read_from_the_help():
    text = "usage: x [-h] {fetch,list,where} ...\n\npositional arguments:\n  {fetch,list,where}\n  --layout {a,b}\n"
    assert _subcommands(text) == ["fetch", "list", "where"]


def test_help_of_every_command():
    """Each entry's ``--help`` and its subcommands', read in one child process (``_all_helps``)."""
    env = {**os.environ, "LLMEDU_FAST": "1"}
    done = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    helps = json.loads(done.stdout)
    assert len(helps) >= len(_entries()), sorted(helps)
    unread = [f"`{shown}` {help['error']}" for shown, help in helps.items() if help["error"]]
    assert not unread, "these commands' --help could not be read:\n" + "\n".join(unread)
    offences = [f"`{shown}`: {hit}" for shown, help in helps.items() for hit in issue_references(help["text"])]
    assert not offences, _report(offences)


def test_the_help_reader_finds_a_subcommand_offence_and_a_broken_entry(tmp_path, monkeypatch):
    script = tmp_path / "tool.py"
    script.write_text(
        "import argparse\n"
        "if __name__ == '__main__':\n"
        "    parser = argparse.ArgumentParser(description='a tool')\n"
        "    commands = parser.add_subparsers()\n"
        "    commands.add_parser('clean', help='cleans')\n"
        "    commands.add_parser('fix', help='fixes', description='the fix of issue #26')\n"
        "    parser.parse_args()\n"
    )
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('a module that moved')\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    helps = _all_helps([("path", str(script)), ("path", str(broken))])
    assert [shown.split("tool.py ", 1)[-1] for shown in helps if "tool.py" in shown] == [
        "--help",
        "clean --help",
        "fix --help",
    ]
    flagged = [shown for shown, help in helps.items() if issue_references(help["text"])]
    assert flagged == [f"python {script} fix --help"], flagged  # only the subcommand's own page says it
    assert "a module that moved" in helps[f"python {broken} --help"]["error"]


if __name__ == "__main__":  # python tests/test_user_text.py: every entry's --help texts, as JSON
    os.chdir(ROOT)
    sys.path[0] = str(ROOT)  # as `python -m` run from the repository has it, not this tests/ folder
    helps = _all_helps(_entries())
    sys.stdout.write(json.dumps(helps))
