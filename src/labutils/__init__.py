"""labutils: run real torchrun jobs from notebook cells and see every rank.

Public API::

    from labutils import launch
    result = launch("train.py", nproc=4, args=["--epochs", "2"])

``%load_ext labutils`` adds the ``%%torchrun`` cell magic.
"""

from labutils.diagnosis import Failure, Hang
from labutils.errors import LabutilsError, LaunchConfigError, RecordError, ScriptSyntaxError
from labutils.launcher import last_result, launch
from labutils.result import RankResult, RunResult

__all__ = [
    "launch", "last_result", "RunResult", "RankResult", "Failure", "Hang",
    "LabutilsError", "LaunchConfigError", "ScriptSyntaxError", "RecordError",
    "load_ipython_extension",
]
__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """%load_ext labutils: register the %%torchrun magic."""
    from labutils.magics import register

    register(ipython)
