"""Module paths from before labutils had subpackages keep working.

``import labutils.viz``, ``from labutils.launcher import launch`` and
``python -m labutils.run.cli`` are in learners' notebooks and scripts; each old path
names the very module object at its new place (one module, two names), so
monkeypatching, isinstance and pickling see one thing. The first import of an old
path in a process warns (DeprecationWarning) with its new path and the release that
drops it (REMOVED_IN). Only public modules keep an old path.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import warnings

REMOVED_IN = "0.2.0"  # the labutils release without these old paths

# old path -> where the module lives now
MOVED = {
    "labutils.runfiles": "labutils.runtime.runfiles",
    "labutils.worker": "labutils.runtime.worker",
    "labutils.launcher": "labutils.run.launcher",
    "labutils.config": "labutils.run.spec",
    "labutils.result": "labutils.run.result",
    "labutils.diagnosis": "labutils.run.diagnosis",
    "labutils.streams": "labutils.run.streams",
    "labutils.run.cli": "labutils.cli",
    "labutils.display": "labutils.notebook.display",
    "labutils.widgets": "labutils.notebook.widgets",
    "labutils.magics": "labutils.notebook.magics",
    "labutils.network": "labutils.run.network",
    "labutils.cluster.network": "labutils.run.network",
    "labutils.slurm": "labutils.cluster.slurm",
    "labutils.kubernetes": "labutils.cluster.kubernetes",
    "labutils.ddp_probes": "labutils.course.ddp_probes",
    "labutils.timing": "labutils.course.timing",
    "labutils.sharding": "labutils.course.sharding",
    "labutils.tables": "labutils.course.tables",
    "labutils.selfcheck": "labutils.course.selfcheck",
    "labutils.viz": "labutils.course.viz",
    "labutils.doctor": "labutils.course.doctor",
}


class _Alias:
    """Finds an old path and loads it as the module at its new path (a meta path
    finder and loader; importlib.abc is not imported, it costs a rank 18 ms)."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def create_module(self, spec):
        warnings.warn(f"{spec.name} is {MOVED[spec.name]} now; the old path goes in labutils "
                      f"{REMOVED_IN}", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system stamped the old spec on the module; give it its own back.
        module.__spec__ = self._specs[module.__name__]

    def get_code(self, name):
        """For ``python -m <old path>``: the code of the module at its new path."""
        new = MOVED[name]
        return importlib.util.find_spec(new).loader.get_code(new)


def install() -> None:
    """Put the finder in front of the import system, once."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
