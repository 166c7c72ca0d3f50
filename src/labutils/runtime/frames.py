"""Whose code a stack frame is in: the bootstrap's, a library's, or the learner's.

The worker uses this to cut its own frames from a rank's exception, the diagnosis
to find the line a hung or failed rank was on; both read the same file names.
"""

from __future__ import annotations

import os
import sys

_RUNTIME = os.path.dirname(os.path.abspath(__file__))
# The loop a persistent world's ranks run the notebook's cells in (labutils/cells.py).
_CELLS = os.path.join(os.path.dirname(_RUNTIME), "cells.py")


def is_bootstrap(path: str) -> bool:
    """A frame of what runs the learner's script: runpy, labutils' worker, or the loop
    that runs a persistent world's cells."""
    return path == "<frozen runpy>" or path.endswith(("/runpy.py", "labutils/runtime/worker.py")) \
        or path.startswith(_RUNTIME) or path == _CELLS


def is_library(path: str) -> bool:
    """A frame outside the learner's code: installed packages, the standard library,
    frozen or generated code, labutils' own bootstrap."""
    return (
        "site-packages" in path or "dist-packages" in path or path.startswith("<")
        or "/lib/python3" in path or path.startswith((sys.base_prefix, sys.prefix))
        or is_bootstrap(path)
    )


def script_depth(files: list[str]) -> int:
    """How many frames of a stack (innermost first) are the script's own and what it
    called: the frames under the script (runpy, the worker bootstrap, and in a warm
    run's forked rank, multiprocessing and torchrun's function entry point below
    them) are cut at the innermost frame of the worker bootstrap."""
    worker = [i for i, f in enumerate(files) if f.endswith("labutils/runtime/worker.py")]
    depth = worker[0] if worker else len(files)
    while depth and is_bootstrap(files[depth - 1]):
        depth -= 1
    return depth
