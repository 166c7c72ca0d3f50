"""Execute a submission's notebook with papermill: a whole-notebook deadline, capped output.

Runs inside the sandbox of one submission::

    python -m labutils.grading.execute IN.ipynb OUT.ipynb --parameters JSON --timeout S \
        --max-output-bytes N --nonce-stdin

papermill injects the parameters after the cell tagged ``parameters`` and runs the
notebook in a fresh kernel in the notebook's folder. Two things papermill does not
do are added by a papermill engine of our own:

- the deadline is for the whole notebook: each cell may run only for what is left
  of it, so many slow cells cannot add up past the limit;
- cell outputs are capped: past ``max_output_bytes`` further output is counted, not
  kept, and past eight times that the kernel is killed (a print loop cannot fill
  the grader's memory or disk).

The outcome goes to the supervisor as one line on stdout, prefixed with the nonce
it sent on stdin; the kernel's own stdout and stderr go to this process's stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from labutils.runtime.procs import make_undumpable

KILL_FACTOR = 8


class NotebookDeadline(Exception):
    """The notebook ran out of its time."""


class OutputLimit(Exception):
    """The notebook printed far more than the grader keeps."""


def _engine(deadline: float, max_output_bytes: int):
    """A papermill engine whose client enforces the deadline and the output cap."""
    from nbclient.exceptions import CellExecutionError, CellTimeoutError
    from papermill.clientwrap import PapermillNotebookClient
    from papermill.engines import NBClientEngine

    class GradedClient(PapermillNotebookClient):
        kept_bytes = 0
        dropped_bytes = 0
        output_killed = False
        current_cell = None

        def papermill_execute_cells(self):
            for index, cell in enumerate(self.nb.cells):
                self.current_cell = index
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NotebookDeadline(index)
                self.timeout = max(1, int(left))
                try:
                    self.nb_man.cell_start(cell, index)
                    self.execute_cell(cell, index)
                except CellTimeoutError:
                    raise NotebookDeadline(index) from None
                except Exception as exc:
                    if self.output_killed:
                        raise OutputLimit(index) from None
                    if isinstance(exc, CellExecutionError):
                        self.nb_man.cell_exception(self.nb.cells[index], cell_index=index,
                                                   exception=exc)
                        break
                    raise
                finally:
                    self.nb_man.cell_complete(self.nb.cells[index], cell_index=index)

        def output(self, outs, msg, display_id, cell_index):
            size = len(json.dumps(msg.get("content", {})))
            if self.kept_bytes + size <= max_output_bytes:
                self.kept_bytes += size
                return super().output(outs, msg, display_id, cell_index)
            if not self.dropped_bytes:
                from nbformat.v4 import new_output

                outs.append(new_output("stream", name="stderr", text=(
                    f"\n[grader] output past {max_output_bytes} bytes is not kept\n")))
            self.dropped_bytes += size
            if self.dropped_bytes > KILL_FACTOR * max_output_bytes and not self.output_killed:
                self.output_killed = True
                os.killpg(self.km.provisioner.pid, signal.SIGKILL)
            return None

    class GradedEngine(NBClientEngine):
        client = None

        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
            # papermill has already moved into the notebook's folder (cwd=...)
            cls.client = GradedClient(nb_man, kernel_name=kernel_name, shutdown_kernel="immediate",
                                      startup_timeout=max(5, int(deadline - time.monotonic())))
            return cls.client.execute()

    return GradedEngine


def first_error(nb) -> int | None:
    """Index of the first cell that failed and was not expected to (tag raises-exception)."""
    for index, cell in enumerate(nb.cells):
        if "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors or cell.get("metadata", {}).get("papermill", {}).get("exception") is True:
            return index
    return None


def execute(notebook: str, output: str, *, parameters: dict, timeout: float,
            max_output_bytes: int) -> dict:
    """Run the notebook; return the outcome (status, where it stopped, how long it took)."""
    import papermill
    import papermill.execute
    from papermill.engines import papermill_engines

    from labutils.grading.notebook import cell_label

    # papermill fails a notebook on any error output, even in cells tagged
    # raises-exception that nbclient rightly ran past; first_error() judges instead.
    papermill.execute.raise_for_execution_errors = lambda nb, output_path: None
    t0 = time.monotonic()
    engine = _engine(t0 + timeout, max_output_bytes)
    papermill_engines.register("labutils-graded", engine)
    outcome: dict = {"status": "completed"}
    index = None
    try:
        nb = papermill.execute_notebook(
            notebook, output, parameters=parameters, engine_name="labutils-graded",
            kernel_name="python3", cwd=os.path.dirname(os.path.abspath(notebook)),
            progress_bar=False, log_output=False, report_mode=False,
        )
        index = first_error(nb)
        if index is not None:
            error: dict = next((o for o in nb.cells[index].get("outputs", [])
                                 if o.get("output_type") == "error"), {})
            outcome = {"status": "error", "ename": error.get("ename", "CellExecutionError"),
                       "evalue": str(error.get("evalue", ""))[:500]}
    except NotebookDeadline as exc:
        outcome, index = {"status": "timeout"}, exc.args[0]
    except OutputLimit as exc:
        outcome, index = {"status": "output_limit"}, exc.args[0]
    except Exception as exc:  # noqa: BLE001 - a dead kernel, a broken notebook: all reported
        name = type(exc).__name__
        status = "kernel_died" if name == "DeadKernelError" else "error"
        outcome = {"status": status, "ename": name, "evalue": str(exc)[:500]}
    client = engine.client
    if client is not None:
        if client.output_killed and outcome["status"] in ("completed", "kernel_died"):
            outcome, index = {"status": "output_limit"}, client.current_cell
        if index is None and outcome["status"] != "completed":
            index = client.current_cell  # the kernel died or the output flooded here
        if index is not None:
            outcome["cell"] = cell_label(client.nb, index)
        outcome["output_bytes_dropped"] = client.dropped_bytes
        outcome["code_cells_run"] = client.code_cells_executed
    outcome["duration_s"] = round(time.monotonic() - t0, 2)
    return outcome


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labutils.grading.execute")
    p.add_argument("notebook")
    p.add_argument("output")
    p.add_argument("--parameters", default="{}", help="JSON object of parameters to inject")
    p.add_argument("--timeout", type=float, required=True, help="seconds for the whole notebook")
    p.add_argument("--max-output-bytes", type=int, default=2 << 20)
    p.add_argument("--nonce-stdin", action="store_true")
    ns = p.parse_args(argv)
    nonce = sys.stdin.readline().strip() if ns.nonce_stdin else ""
    make_undumpable()  # nothing started from here (the kernel, its runs) learns the nonce
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the kernel inherits fd 1: make it stderr, never the result pipe
    outcome = execute(ns.notebook, ns.output, parameters=json.loads(ns.parameters),
                      timeout=ns.timeout, max_output_bytes=ns.max_output_bytes)
    result_out.write(nonce + json.dumps(outcome) + "\n")
    result_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
