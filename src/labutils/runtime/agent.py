"""Entry point of the torchrun agent: die with the launcher, then run torchrun.

The launcher starts ``python -m labutils.runtime.agent <torchrun args>`` instead of
``python -m torch.distributed.run`` so that the agent is SIGKILLed by the
kernel if the process that called launch() dies (a Jupyter kernel killed with
-9, say). Each worker does the same towards the agent (see worker.py), so the
whole tree goes down with its root. Nothing else changes: this runs
torch.distributed.run's own main in the same interpreter.
"""

from __future__ import annotations

import os
import runpy
import sys

from labutils.runtime.procs import die_with_parent
from labutils.runtime.runfiles import ENV_AGENT_PID, ENV_PARENT_PID


def main() -> None:
    parent = os.environ.get(ENV_PARENT_PID)
    die_with_parent(int(parent) if parent else None)
    os.environ[ENV_AGENT_PID] = str(os.getpid())
    sys.argv[0] = "torchrun"
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
