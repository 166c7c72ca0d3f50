"""labutils: run real torchrun jobs from notebook cells and see every rank.

Public API::

    from labutils import launch
    result = launch("train.py", nproc=4, args=["--epochs", "2"])

``%load_ext labutils`` adds the ``%%torchrun`` cell magic.

The package, by layer (docs/architecture.md): runtime/ runs inside the agent and the
ranks, run/ is the launcher, notebook/ shows runs, cluster/ spans hosts, course/ holds
the lessons' helpers, grading/ grades labs. The public names below load on first use,
so a rank's interpreter, which imports only labutils.runtime, stays light.
"""

from labutils import compat
from labutils.errors import LabutilsError, LaunchConfigError, RecordError, ScriptSyntaxError

compat.install()

_LAZY = {
    "launch": "labutils.run.launcher", "last_result": "labutils.run.launcher",
    "RunResult": "labutils.run.result", "RankResult": "labutils.run.result",
    "Failure": "labutils.run.diagnosis", "Hang": "labutils.run.hang",
    "world": "labutils.run.world", "World": "labutils.run.world",
}

__all__ = [
    "launch", "last_result", "world", "World", "RunResult", "RankResult", "Failure", "Hang",
    "LabutilsError", "LaunchConfigError", "ScriptSyntaxError", "RecordError",
    "load_ipython_extension",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'labutils' has no attribute {name!r}")


def _prestart_in_a_kernel() -> None:
    """In a Jupyter kernel, start the warm server now (labutils.run.warm), while the
    learner reads: the kernel's first run is then warm too. Nowhere else: ranks, agents
    and scripts import labutils as well."""
    import os
    import sys

    from labutils.runtime.runfiles import ENV_START

    if "ipykernel" in sys.modules and os.environ.get(ENV_START) != "cold":
        from labutils.run import warm

        warm.prestart()


def load_ipython_extension(ipython) -> None:
    """%load_ext labutils: register the %%torchrun magic."""
    from labutils.notebook.magics import register

    register(ipython)


_prestart_in_a_kernel()
