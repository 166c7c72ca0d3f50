"""lessons/index.ipynb, the course's map, stays true: every link works, every lesson and
lab on disk is listed, lessons in order, each with what it needs and its time."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from helpers import LESSONS

INDEX = LESSONS / "index.ipynb"
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


@pytest.fixture(scope="module")
def markdown() -> str:
    notebook = nbformat.read(INDEX, as_version=4)
    assert all(c.cell_type == "markdown" for c in notebook.cells), "the index runs no code"
    return "\n\n".join(c.source for c in notebook.cells)


def local_links(text: str) -> list[str]:
    return [target for _, target in LINK.findall(text)
            if not re.match(r"^(https?:|mailto:|#)", target)]


def test_every_link_opens_a_file_of_the_course(markdown):
    links = local_links(markdown)
    assert links
    missing = [t for t in links if not (LESSONS / t.split("#")[0]).exists()]
    assert not missing, f"the index links to files that do not exist: {missing}"


def test_every_lesson_and_lab_on_disk_is_listed(markdown):
    linked = {(LESSONS / t).resolve() for t in local_links(markdown)}
    lessons = sorted(LESSONS.glob("[0-9][0-9]_*.ipynb"))
    labs = sorted(p for p in (LESSONS.parent / "labs").glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb"))
    assert lessons and labs
    unlisted = [str(p.relative_to(LESSONS.parent)) for p in lessons + labs
                if p.resolve() not in linked]
    assert not unlisted, f"add these to lessons/index.ipynb: {unlisted}"


def test_lessons_are_listed_in_order_with_needs_and_time(markdown):
    section = markdown.split("## Lessons", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if re.match(r"^\| (\[)?\d\d ·", r)]
    numbers = [re.match(r"^\| \[?(\d\d)", r).group(1) for r in rows]
    assert numbers == sorted(numbers) and numbers[0] == "00", numbers
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 5 and all(cells), f"lesson, what, needs, time, runs: {row}"
        assert re.search(r"\d+ (min|h)", cells[3]), f"no time in: {row}"
        if cells[0].startswith("["):  # a lesson that exists says how long its runs take
            assert re.search(r"\d+ min", cells[4]), f"no run time in: {row}"
