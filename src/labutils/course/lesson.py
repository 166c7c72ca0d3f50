"""A lesson's own modules, imported in a notebook or a test under names no other lesson uses.

A lesson folder (lessons/03_bucketing_and_overlap/) holds the scripts its ranks run
and the modules its notebook imports. Two lessons both have a models.py, so putting
lesson folders on sys.path lets `import models` find whichever lesson came first.
Here each folder is a package of its own, lessons.<folder>: lesson 03's models.py is
the module lessons.03_bucketing_and_overlap.models, lesson 07's another one.

In a notebook (the working directory is lessons/)::

    from labutils.course import lesson
    LESSON = "03_bucketing_and_overlap"   # its scripts: launch(f"{LESSON}/buckets.py", nproc=2)
    lesson.use(LESSON)                    # its modules: plain imports from here on
    import lesson03 as L                  # L.__name__ == "lessons.03_bucketing_and_overlap.lesson03"

and in tests, where many lessons share one process: `L = lesson.load(folder, "lesson03")`.

A plain `import models` (in a cell, or inside a lesson module) finds the file in the
lesson used last that has one, and only when nothing on sys.path has that name, so a
lab folder on sys.path keeps its own ring.py. The scripts the ranks run are untouched:
Python puts a script's own folder first on its path, where they find their neighbours.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

from labutils.errors import InputError

__all__ = ["use", "load", "package_name", "LESSONS_DIR"]

# The checkout's lessons/ folder (this file is src/labutils/course/lesson.py): where old
# import paths (labutils.viz) find the plots that moved into their lesson's folder.
LESSONS_DIR = Path(__file__).resolve().parents[3] / "lessons"

PREFIX = "lessons."  # unique names: lessons.<folder name>.<module>


class _PlainNames:
    """Finds a top-level name among the used lessons' files (a meta path finder placed
    after sys.path's) and loads it as the module at its unique name: one module, two
    names, so a cell and the lesson's own modules share its classes."""

    def __init__(self) -> None:
        self.folders: dict[str, Path] = {}  # package name -> folder, the lesson used last first
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def package_of(self, name: str) -> str | None:
        """The package of the lesson used last that has name.py, or None."""
        return next((package for package, folder in self.folders.items()
                     if (folder / f"{name}.py").is_file()), None)

    def find_spec(self, name, path=None, target=None):
        if path is not None or self.package_of(name) is None:  # submodules: their package's path
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{self.package_of(spec.name)}.{spec.name}")
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system stamped the plain name's spec on the module; give it its own back.
        module.__spec__ = self._specs[module.__name__]


def _finder() -> _PlainNames:
    """The one finder of this process, put on sys.meta_path at first use."""
    for finder in sys.meta_path:
        if isinstance(finder, _PlainNames):
            return finder
    finder = _PlainNames()
    sys.meta_path.append(finder)
    return finder


def package_name(folder: str | os.PathLike) -> str:
    """The package name a lesson folder's modules live under: lessons.<folder name>.

    Args:
        folder: the lesson folder.
    """
    return PREFIX + Path(folder).name.replace(".", "_")


# The oldest torch every lesson has run with, top to bottom (2.11, on a GPU machine; the
# project pins 2.13): lessons 02 and 07 take 2.13's new collective names where they exist.
OLDEST_TORCH = (2, 11)


def check_torch(version: str | None = None) -> None:
    """Refuse, in one line, a torch older than every lesson has run with."""
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            version = installed("torch")
        except PackageNotFoundError:
            raise InputError("torch", expected="torch installed", given=None,
                             fix="run `make lab` (it installs the pinned torch 2.13.0)") from None
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]]
    if len(parts) == 2 and tuple(parts) < OLDEST_TORCH:
        oldest = ".".join(map(str, OLDEST_TORCH))
        raise InputError("torch", expected=f"torch {oldest} or later (the lessons ran on "
                         f"{oldest} and 2.13)", given=version,
                         fix="install the pinned torch 2.13.0 (`make lab`), or torch>=" + oldest)


def use(folder: str | os.PathLike) -> None:
    """Make a lesson folder's modules importable by their plain names (import lesson03),
    each loaded once under its unique name lessons.<folder>.<module>.

    A plain name another lesson's module holds in sys.modules is dropped there when this
    lesson has a file of that name, so the next import finds this lesson's file (modules
    that imported the other one keep it).

    Args:
        folder: the lesson folder, relative to the working directory or absolute.
    """
    check_torch()
    path = Path(folder).resolve()
    if not path.is_dir() or not any(path.glob("*.py")):
        raise InputError("folder", expected="a lesson folder with .py files", given=str(folder),
                         fix="run the notebook from lessons/, or pass the folder's full path")
    package = package_name(path)
    registered = sys.modules.get(package)
    if registered is None:
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = [str(path)]
        sys.modules[package] = importlib.util.module_from_spec(spec)
    elif Path(registered.__path__[0]) != path:
        raise InputError("folder", expected=f"one folder named {path.name} per process",
                         given=str(path), fix=f"{registered.__path__[0]} is loaded as {package} already")
    finder = _finder()
    finder.folders.pop(package, None)
    finder.folders = {package: path, **finder.folders}
    for stem in (p.stem for p in path.glob("*.py")):
        cached = getattr(sys.modules.get(stem), "__name__", "")
        if cached.startswith(PREFIX) and cached != f"{package}.{stem}":
            del sys.modules[stem]


def load(folder: str | os.PathLike, name: str) -> ModuleType:
    """Import one module of a lesson folder under its unique name (see use()).

    Args:
        folder: the lesson folder, relative to the working directory or absolute.
        name: the module's file name without .py, e.g. "lesson03" or "models".

    Returns:
        The module, named lessons.<folder>.<name>.
    """
    use(folder)
    path = Path(folder).resolve()
    if not isinstance(name, str) or not name.isidentifier() or not (path / f"{name}.py").is_file():
        found = sorted(p.stem for p in path.glob("*.py"))
        raise InputError("name", expected=f"one of the folder's modules {found}", given=name,
                         fix="pass the file name without .py")
    return importlib.import_module(f"{package_name(path)}.{name}")
