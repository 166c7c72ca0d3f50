"""labutils.course.lesson: each lesson's modules under names of their own, plain imports
inside a lesson finding that lesson's files, and the old path of the plots that moved."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from helpers import REPO

from labutils.course import lesson
from labutils.errors import InputError



@pytest.fixture
def lessons(tmp_path):
    """Two lesson folders that both have a shared_helper.py, and whose main modules
    import it by its plain name; the modules the test imports are forgotten after it."""
    before = set(sys.modules)
    folders = []
    for name in ("91_first", "92_second"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "shared_helper.py").write_text(f"WHO = {name!r}\n")
        (folder / f"main_{name[:2]}.py").write_text("import shared_helper\n\nWHO = shared_helper.WHO\n")
        folders.append(folder)
    yield folders
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_two_lessons_modules_of_one_name_stay_apart(lessons):
    first, second = lessons
    a = lesson.load(first, "shared_helper")
    b = lesson.load(second, "shared_helper")
    assert (a.WHO, b.WHO) == ("91_first", "92_second")
    assert a.__name__ == f"lessons.{first.name}.shared_helper"
    assert Path(a.__file__) == first / "shared_helper.py"


def test_a_plain_import_inside_a_lesson_finds_that_lessons_file(lessons):
    first, second = lessons
    main_first = lesson.load(first, "main_91")
    assert main_first.WHO == "91_first"
    assert main_first.shared_helper is lesson.load(first, "shared_helper")  # one module, two names
    main_second = lesson.load(second, "main_92")
    assert main_second.WHO == "92_second"
    assert main_first.shared_helper.WHO == "91_first"  # what the first lesson imported stays its own


def test_use_makes_plain_names_mean_the_lesson_used_last(lessons):
    first, second = lessons
    lesson.use(first)
    assert importlib.import_module("shared_helper").WHO == "91_first"
    lesson.use(second)
    assert importlib.import_module("shared_helper").WHO == "92_second"


def test_a_folder_on_sys_path_keeps_its_own_file(lessons, tmp_path, monkeypatch):
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "shared_helper.py").write_text("WHO = 'lab'\n")
    monkeypatch.syspath_prepend(str(lab))
    lesson.use(lessons[0])
    assert importlib.import_module("shared_helper").WHO == "lab"


@pytest.mark.parametrize(("folder", "name", "fragment"), [
    ("no_such_lesson", "lesson01", "a lesson folder with .py files"),
    (None, "missing", "one of the folder's modules"),
    (None, "shared_helper.py", "one of the folder's modules"),
])
def test_bad_folder_or_module_name(lessons, folder, name, fragment):
    with pytest.raises(InputError, match=fragment):
        lesson.load(folder or lessons[0], name)


def test_moved_plots_keep_their_old_path():
    old_path = importlib.import_module("labutils.viz")  # what notebooks saved before the move import
    plots = lesson.load(REPO / "lessons" / "03_bucketing_and_overlap", "plots")
    for name in ("plot_bucket_sizes", "plot_overlap_timeline", "plot_bucket_sweep"):
        assert getattr(old_path, name) is getattr(plots, name)
    with pytest.raises(AttributeError, match="plot_nothing"):
        old_path.plot_nothing  # noqa: B018


@pytest.mark.parametrize(("version", "refused"), [
    ("2.13.0", False), ("2.11.0+cu130", False), ("2.12.1", False), ("3.0.0", False),
    ("2.10.2", True), ("1.13.1+cpu", True)])
def test_a_lesson_on_a_torch_older_than_any_it_ran_with_is_refused_in_one_line(version, refused):
    """Every lesson ran top to bottom with torch 2.11 (a GPU machine's) and 2.13 (the pin);
    use(), which every lesson calls first, refuses an older one before anything runs."""
    if not refused:
        lesson.check_torch(version)
        return
    with pytest.raises(InputError) as caught:
        lesson.check_torch(version)
    message = str(caught.value)
    assert "\n" not in message and "torch 2.11 or later" in message and version in message
    assert "make lab" in message


def test_use_checks_the_installed_torch_first(lessons, monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.9.0")
    with pytest.raises(InputError, match="torch 2.11 or later"):
        lesson.use(lessons[0])
