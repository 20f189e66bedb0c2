"""Every lesson within the editorial budget: at most 3,000 words of prose (the capstone 4,500), no markdown cell
over 250 words. Lessons not yet distilled are listed by name; the list may only shrink: a listed lesson that
meets the budget fails too, so that it leaves the list the day it is rewritten."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]*.ipynb"))
CAPSTONE_WORDS, LESSON_WORDS, CELL_WORDS = 4_500, 3_000, 250
NOT_YET_DISTILLED: set[str] = set()


def prose(path: Path) -> list[int]:
    """The words of each markdown cell."""
    return [len(c.source.split()) for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"]


def over_budget(path: Path) -> list[str]:
    words = prose(path)
    budget = CAPSTONE_WORDS if "capstone" in path.stem else LESSON_WORDS
    problems = [f"{sum(words)} words of prose (budget {budget})"] if sum(words) > budget else []
    problems += [f"a markdown cell of {n} words (budget {CELL_WORDS})" for n in words if n > CELL_WORDS]
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_is_within_its_word_budget(path):
    problems = over_budget(path)
    if path.stem in NOT_YET_DISTILLED:
        assert problems, f"{path.name} now meets the budget: take it off NOT_YET_DISTILLED"
    else:
        assert not problems, f"{path.name}: " + "; ".join(problems)


def test_the_list_names_only_lessons_that_exist():
    assert NOT_YET_DISTILLED <= {p.stem for p in NOTEBOOKS}
