"""Run lesson notebooks top to bottom with nbclient and say how each went.

    python scripts/run_notebooks.py lessons/00_first_distributed_run.ipynb ... [--out DIR]

For a machine without the project's venv (a GPU machine with its own torch): put src/ on
PYTHONPATH. Prints one line per notebook (seconds, status, the first error and its cell; with
--keep-going every cell runs and each that raised is listed),
then each checked cell (tagged `nbval-check-output`, or marked `# NBVAL_CHECK_OUTPUT`)
whose output differs from the stored one after
lessons/sanitize.cfg's replacements (what nbval would fail: a claim that did not hold),
and, with --out, writes each executed notebook and a JSON summary there.
"""

from __future__ import annotations

import argparse
import configparser
import copy
import json
import os
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, DeadKernelError


def sanitizers(folder: Path) -> list[tuple[re.Pattern, str]]:
    """nbval's sanitize.cfg beside the notebooks, as (pattern, replacement) pairs."""
    cfg = configparser.ConfigParser()
    cfg.read(folder / "sanitize.cfg")
    return [(re.compile(cfg[s]["regex"]), cfg[s]["replace"]) for s in cfg.sections()]


def cell_text(cell, rules: list[tuple[re.Pattern, str]]) -> str:
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    text += "".join(o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", [])
                    if o.get("output_type") == "execute_result")
    for pattern, replacement in rules:
        text = pattern.sub(replacement, text)
    return text


CHECK_TAG = "nbval-check-output"   # nbval's tag; the lessons keep their cells' source clean


def checked(cell) -> bool:
    """Whether nbval compares this cell's output with the stored one (its tag or its comment)."""
    return cell.cell_type == "code" and (CHECK_TAG in cell.get("metadata", {}).get("tags", [])
                                         or "NBVAL_CHECK_OUTPUT" in cell.source)


def check_differences(stored, ran, rules) -> list[str]:
    """For each checked cell that ran: its first line that differs from the stored run."""
    found = []
    for index, (before, after) in enumerate(zip(stored.cells, ran.cells)):
        if not checked(after) or not after.get("execution_count"):
            continue
        old, new = cell_text(before, rules).splitlines(), cell_text(after, rules).splitlines()
        if old == new:
            continue
        for line_no in range(max(len(old), len(new))):
            a = old[line_no] if line_no < len(old) else "(no line)"
            b = new[line_no] if line_no < len(new) else "(no line)"
            if a != b:
                found.append(f"cell {index}: stored {a.strip()[:150]!r}, now {b.strip()[:150]!r}")
                break
    return found


def run(path: Path, timeout: int, keep_going: bool = False) -> tuple[dict, nbformat.NotebookNode]:
    nb = nbformat.read(path, as_version=4)
    stored = copy.deepcopy(nb)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=keep_going,
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.monotonic()
    status, error, cell = "ok", "", None
    try:
        client.execute()
    except CellExecutionError as exc:
        status, error = "error", (str(exc).strip().splitlines() or [""])[-1]
    except DeadKernelError as exc:
        status, error = "kernel died", str(exc)
    except Exception as exc:  # noqa: BLE001 - any other way the run broke is reported
        status, error = "broke", f"{type(exc).__name__}: {exc}"
    code = [c for c in nb.cells if c.cell_type == "code"]
    ran = sum(1 for c in code if c.get("execution_count"))
    failed = [index for index, c in enumerate(nb.cells)
              if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    cell = failed[0] if failed else None
    if failed and status == "ok":  # --keep-going: every cell ran, some raised
        status = "error"
        error = f"cells {', '.join(map(str, failed))} raised: " + "; ".join(
            next(f"{o['ename']}: {o['evalue'][:120]}" for o in nb.cells[i].outputs if o.output_type == "error")
            for i in failed)
    note = ""
    if status == "broke" and cell is None and ran == len(code):
        # every cell ran without an error: what broke was shutting the kernel down
        status, note, error = "ok", f"after the last cell: {error}", ""
    differences = check_differences(stored, nb, sanitizers(path.parent))
    return {"notebook": path.name, "seconds": round(time.monotonic() - t0, 1), "status": status,
            "error": error[:500], "cell": cell, "cells_run": f"{ran}/{len(code)}", "note": note,
            "checks_differing": differences}, nb


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    p.add_argument("--keep-going", action="store_true",
                   help="run every cell even after one raises, and list every cell that did")
    ns = p.parse_args()
    results = []
    for path in ns.notebooks:
        result, nb = run(path.resolve(), ns.timeout, ns.keep_going)
        results.append(result)
        print(f"{result['notebook']}: {result['status']} in {result['seconds']} s"
              + (f" (cell {result['cell']}: {result['error']})" if result["status"] != "ok" else ""),
              flush=True)
        for line in result["checks_differing"]:
            print(f"  differs from the stored output: {line}", flush=True)
        if ns.out:
            ns.out.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, ns.out / path.name)
    if ns.out:
        (ns.out / "summary.json").write_text(json.dumps(
            {"python": sys.version.split()[0], "cpus": os.cpu_count(), "results": results}, indent=2))
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
