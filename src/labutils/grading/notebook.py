"""The submitted notebook: read it safely, check and restore the lab's locked cells.

A lab's notebook marks the cells a learner must not change with the tag ``locked``
(the ``parameters`` cell is locked too). Cells are matched by their id. Before the
notebook runs, every locked cell is put back exactly as the lab has it: an edited
one gets the lab's source and tags, a removed one is inserted again where it was,
a duplicated one runs once. What was restored is reported, so an edit can neither
change the grade nor go unnoticed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import nbformat

LOCKED_TAGS = ("locked", "parameters")


@dataclass
class NotebookRead:
    """A notebook read from disk, or why it could not be."""

    nb: nbformat.NotebookNode | None
    problem: str = ""


def read_notebook(path, *, max_bytes: int = 20 << 20) -> NotebookRead:
    """Read a notebook; a missing, huge, non-JSON or non-notebook file gives a problem text."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        return NotebookRead(None, f"the notebook could not be read ({exc.strerror})")
    if size > max_bytes:
        return NotebookRead(None, f"the notebook is {size} bytes, more than the {max_bytes} "
                                  "the grader reads; clear its outputs and submit again")
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except UnicodeDecodeError:
        return NotebookRead(None, "the notebook is not UTF-8 text")
    except json.JSONDecodeError as exc:
        return NotebookRead(None, f"the notebook is not valid JSON ({exc.msg} at line {exc.lineno}, "
                                  f"column {exc.colno}); open it in JupyterLab, save it and submit again")
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        return NotebookRead(None, "the file is JSON but not a notebook (no list of cells)")
    try:
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
    except Exception as exc:  # noqa: BLE001 - nbformat raises several kinds
        return NotebookRead(None, f"the notebook does not follow the notebook format: "
                                  f"{str(exc).splitlines()[0][:200]}")
    return NotebookRead(nb)


def is_locked(cell) -> bool:
    return any(tag in cell.get("metadata", {}).get("tags", []) for tag in LOCKED_TAGS)


def _same(a: str, b: str) -> bool:
    normal = lambda s: "\n".join(line.rstrip() for line in s.strip().splitlines())  # noqa: E731
    return normal(a) == normal(b)


def restore_locked_cells(submitted, lab) -> tuple[nbformat.NotebookNode, list[str]]:
    """The submitted notebook with every locked cell of the lab back in place.

    Returns the notebook to run and one line per locked cell that had to be restored.
    Unlocked cells (the learner's notes and experiments) stay where they are.
    """
    locked = [(i, c) for i, c in enumerate(lab.cells) if is_locked(c)]
    by_id = {c.get("id"): (i, c) for i, c in locked}
    lab_index = {c.get("id"): i for i, c in enumerate(lab.cells)}
    out, notes, placed = [], [], set()

    def place_missing_before(index: int) -> None:
        for i, cell in locked:
            if i < index and cell.get("id") not in placed:
                out.append(_copy(cell))
                placed.add(cell.get("id"))
                notes.append(f"locked cell '{cell.get('id')}' was removed; the grader put it back")

    for cell in submitted.cells:
        cid = cell.get("id")
        if cid in lab_index:  # a cell of the lab: missing locked cells before it come first
            place_missing_before(lab_index[cid])
        if cid in by_id:
            if cid in placed:
                notes.append(f"locked cell '{cid}' appeared twice; it runs once")
                continue
            lab_cell = by_id[cid][1]
            if cell.get("cell_type") != lab_cell.cell_type or not _same(cell.get("source", ""),
                                                                       lab_cell.source):
                notes.append(f"locked cell '{cid}' was edited; the grader ran the lab's version")
            out.append(_copy(lab_cell))
            placed.add(cid)
        else:
            out.append(cell)
    place_missing_before(len(lab.cells))
    nb = nbformat.v4.new_notebook(metadata=dict(lab.metadata))
    nb.cells = out
    return nb, notes


def _copy(cell):
    return nbformat.from_dict(json.loads(json.dumps(cell)))


def cell_label(nb, index: int | None) -> str:
    """'cell 4 (id run-broken): first line of its source' for feedback."""
    if nb is None or index is None or not 0 <= index < len(nb.cells):
        return f"cell {index}" if index is not None else "a cell"
    cell = nb.cells[index]
    first = next((line for line in cell.source.splitlines() if line.strip()), "")
    cid = cell.get("id")
    return f"cell {index + 1}" + (f" (id {cid})" if cid else "") + (f": {first[:60]}" if first else "")
