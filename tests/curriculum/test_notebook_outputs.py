"""What a learner reads in the saved notebooks: short outputs, no paths of the machine
that ran them (or of the machine torch was built on), no word about how the course
was made. Reads the saved .ipynb files only; runs nothing.

A failure names the notebook, the cell (index as nbformat counts, from 0, and the
execution count) and the offending text. Re-executing the notebook after fixing its
cells or labutils is how a failure here goes away.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import REPO

NOTEBOOKS = sorted(
    [*REPO.glob("lessons/*.ipynb"), *REPO.glob("labs/*/*.ipynb"), *REPO.glob("solutions/*/*.ipynb")]
)

MAX_TEXT_CHARS = 4096  # text/plain + stream text of one cell

# Paths of a machine: this one's (home, root's home, temporary files, the checkout,
# system folders), an installation's site-packages with its prefix, and torch's build
# machine (GitHub Actions' /__w/...). The forms labutils shows are allowed:
# ".../site-packages/torch/...", ".../torch/csrc/...".
MACHINE_PATH = re.compile(
    r"(?<![\w.-])(?:/root|/tmp|/home|/work|/usr|/__w|/var/folders|/private/var)/[^\s\"'`<>)\]]*"
    r"|[^\s\"'`<>(\[]*(?<!\.\.\.)/(?:site|dist)-packages/[^\s\"'`<>)\]]*"
)
# Paths that are the same on every machine: the course's container image keeps the
# course in this folder (docker/), and the Kubernetes manifests of lesson 06 use it.
IMAGE_PATHS = ("/home/learner/course",)

# Sentences about how the course was made, not about what the learner runs. Each
# pattern is narrow on purpose: "reporting this issue" (torch's own messages) or
# "the issue of ..." are ordinary text; text about a run in the notebook says
# "the run above", not "we ran".
MAKING_OF = [
    r"\bthe issue that\b",
    r"\basked for (?:this|the) (?:lesson|course|notebook|lab)\b",
    r"\bour (?:trials|runs|tests|measurements|experiments)\b",
    r"\bwe (?:ran|tried)\b",
    r"\bin \d+ of \d+ (?:trials|runs|tries|attempts)\b",
    r"\b(?:while|when) (?:building|writing|making) (?:this|the) (?:course|lesson|notebook)\b",
    r"\bthis (?:course|lesson|notebook) was (?:built|written|made|developed)\b",
]
MAKING_OF_RE = re.compile("|".join(MAKING_OF), re.IGNORECASE)


def _join(text) -> str:
    return "".join(text) if isinstance(text, list) else (text or "")


def _text_of(output: dict) -> str:
    """What a learner reads of one output as text (stream, text/plain)."""
    if output.get("output_type") == "stream":
        return _join(output.get("text"))
    return _join(output.get("data", {}).get("text/plain"))


def _all_text_of(output: dict) -> str:
    """Every text an output carries: the above, HTML, and an error's traceback."""
    parts = [_text_of(output), _join(output.get("data", {}).get("text/html"))]
    if output.get("output_type") == "error":
        parts.append("\n".join(output.get("traceback", [])))
    return "\n".join(parts)


def _cells(path: Path):
    nb = json.loads(path.read_text())
    for index, cell in enumerate(nb["cells"]):
        count = cell.get("execution_count")
        yield f"{path.relative_to(REPO)} cell {index}" + (f" [{count}]" if count else ""), cell


def _snippet(text: str, start: int, end: int, around: int = 40) -> str:
    return " ".join(text[max(0, start - around): end + around].split())


def _ids():
    return [str(p.relative_to(REPO)) for p in NOTEBOOKS]


def test_there_are_notebooks_to_check():
    assert len([p for p in NOTEBOOKS if p.parent.name == "lessons"]) >= 9


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids())
def test_no_cell_prints_more_than_4_kb_of_text(notebook):
    problems = []
    for where, cell in _cells(notebook):
        text = "".join(_text_of(o) for o in cell.get("outputs", []))
        if len(text) > MAX_TEXT_CHARS:
            first = " ".join(text[:120].split())
            problems.append(f"{where}: {len(text)} characters of text output "
                            f"(at most {MAX_TEXT_CHARS}), starting: {first!r}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids())
def test_no_output_shows_a_machine_path(notebook):
    problems = []
    for where, cell in _cells(notebook):
        for output in cell.get("outputs", []):
            text = _all_text_of(output)
            for m in MACHINE_PATH.finditer(text):
                if m.group(0).startswith(IMAGE_PATHS):
                    continue
                problems.append(f"{where}: machine path {m.group(0)!r} in "
                                f"{_snippet(text, m.start(), m.end())!r}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids())
def test_no_sentence_about_how_the_course_was_made(notebook):
    problems = []
    for where, cell in _cells(notebook):
        texts = [_join(cell.get("source"))]
        texts += [_all_text_of(o) for o in cell.get("outputs", [])]
        for text in texts:
            for m in MAKING_OF_RE.finditer(text):
                problems.append(f"{where} ({cell['cell_type']}): {m.group(0)!r} in "
                                f"{_snippet(text, m.start(), m.end(), 60)!r}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.parametrize("text, found", [
    ("  File \"/root/course/lessons/x.py\", line 3", "/root/course/lessons/x.py"),
    ("logs in /tmp/pytest-of-root/runs/x", "/tmp/pytest-of-root/runs/x"),
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]",
     "/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553"),
    ("File \"/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py\"",
     "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py"),
    ("see /work/main/runs", "/work/main/runs"),
    ("File \".../site-packages/torch/nn/modules/module.py\"", None),
    ("[.../third_party/gloo/gloo/transport/tcp/pair.cc:553]", None),
    ("logs in runs/20261121-193522-failing_rank-2fb4eb", None),
    ("bytes/s and ranks/host", None),
])
def test_the_path_check_itself(text, found):
    m = MACHINE_PATH.search(text)
    assert (m.group(0) if m else None) == found


@pytest.mark.parametrize("text, hit", [
    ("which is the form in the issue that asked for this lesson", True),
    ("failed intermittently in our trials", True),
    ("We ran the same script with nproc=4", True),
    ("In 2 of 3 trials a rank failed", True),
    ("Please include the loss function when reporting this issue (e.g. list)", False),
    ("the issue of stragglers is that they hold everyone back", False),
    ("the run above shows the same", False),
])
def test_the_making_of_check_itself(text, hit):
    assert bool(MAKING_OF_RE.search(text)) == hit
