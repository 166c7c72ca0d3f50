"""Every lesson's self-check, against its answer key: the notebook asks exactly the
questions the key has, and the key says "correct" for its own answers and "not quite"
for others.

The self-check cell of a notebook is not a checked cell: left unanswered it prints
"not answered yet" for every question, which shows nothing. This test holds what that
cell cannot.
"""

from __future__ import annotations

import ast

import nbformat
import pytest
from helpers import LESSONS

from labutils.course import lesson, selfcheck

FOLDERS = sorted(p for p in LESSONS.iterdir() if p.is_dir() and (p / f"lesson{p.name[:2]}.py").is_file())


def _answers_cell(folder) -> dict:
    """The notebook's `answers = {...}` cell, read as the literal it is."""
    nb = nbformat.read(LESSONS / f"{folder.name}.ipynb", as_version=4)
    (source,) = [c.source for c in nb.cells if c.cell_type == "code"
                 and c.source.lstrip().startswith("answers = {")]
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.Assign)
               and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["answers"]]
    return ast.literal_eval(node.value)


def _key(folder, monkeypatch) -> tuple[dict, dict]:
    """The expected answers and options the lesson's check_answers hands to selfcheck."""
    module = lesson.load(folder, f"lesson{folder.name[:2]}")
    seen: dict = {}
    monkeypatch.setattr(selfcheck, "check_answers",
                        lambda answers, expected, **options: seen.update(expected=expected,
                                                                         options=options))
    module.check_answers({})
    monkeypatch.undo()
    return seen["expected"], seen["options"]


def _wrong(want):
    if isinstance(want, bool):
        return not want
    if isinstance(want, (int, float)):
        return want * 3 + 7
    if isinstance(want, (list, tuple)):
        return [*want, want[0]] if want else [1]
    return "something else entirely"


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name[:2] for f in FOLDERS])
def test_the_notebook_asks_the_questions_of_the_answer_key(folder, monkeypatch):
    expected, _ = _key(folder, monkeypatch)
    answers = _answers_cell(folder)
    assert list(answers) == list(expected)
    assert set(answers.values()) == {None}  # the learner fills them in


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name[:2] for f in FOLDERS])
def test_the_key_accepts_its_answers_and_refuses_others(folder, monkeypatch, capsys):
    expected, options = _key(folder, monkeypatch)
    known = {q: spec[0] for q, spec in expected.items() if spec[0] is not None}
    assert known, "a self-check with no answer known before the runs"
    right = selfcheck.check_answers(known, expected, **options)
    assert right == {q: (True if q in known else None) for q in expected}
    wrong = selfcheck.check_answers({q: _wrong(w) for q, w in known.items()}, expected, **options)
    assert all(wrong[q] is False for q in known), wrong
    assert "not quite" in capsys.readouterr().out
