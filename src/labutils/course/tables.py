"""Plain-text tables for notebook cells: fixed-width, so nbval can compare them.

    from labutils.course.tables import text_table, rank_table
    print(text_table(["size", "time"], [["8 B", "12 µs"], ["1 KiB", "15 µs"]]))
    print(rank_table(result.records, ["before", "after"]))   # one row per rank

Values are shown compactly: 3.0 as 3, 0.1 as 0.1, [0.0, 1.0] as [0 1], None as "".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from labutils.errors import InputError

__all__ = ["cell", "significant", "bytes_in", "text_table", "rank_table"]


def cell(value) -> str:
    """One value as table text: numbers with %g, lists in brackets, None as empty."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + " ".join(cell(v) for v in value) + "]"
    return str(value)


def significant(x: float) -> str:
    """Three significant digits, never in exponent form: 0.00249, 0.648, 12.3, 880, 1200."""
    if x == 0:
        return "0"
    return f"{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


BYTE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def bytes_in(nbytes: float, unit: str, digits: int = 2) -> str:
    """nbytes as a number of unit (KiB, MiB...), for a column whose header names the unit:
    one unit per column."""
    if unit not in BYTE_UNITS:
        raise InputError("unit", expected=f"one of {', '.join(BYTE_UNITS)}", given=unit,
                         fix="name the column's unit")
    return f"{nbytes / BYTE_UNITS[unit]:,.{digits}f}"


def text_table(header: Sequence[str], rows: Iterable[Sequence], *, right: Sequence[int] = ()) -> str:
    """A table with a header line, a rule and one line per row.

    Args:
        header: the column titles.
        rows: one sequence of values per row, as long as the header.
        right: indexes of columns to right-align (numbers); others align left.
    """
    if isinstance(header, str) or not isinstance(header, Sequence) or not header:
        raise InputError("header", expected="a non-empty list of column titles", given=header,
                         fix='pass e.g. ["rank", "value"]')
    texts = [[cell(v) for v in row] for row in rows]
    for i, row in enumerate(texts):
        if len(row) != len(header):
            raise InputError(f"rows[{i}]", expected=f"{len(header)} values (one per column)",
                             given=f"{len(row)} values", fix="give every row one value per column")
    bad = [i for i in right if not isinstance(i, int) or not 0 <= i < len(header)]
    if bad:
        raise InputError("right", expected=f"column indexes 0..{len(header) - 1}", given=list(right),
                         fix="pass the positions of the numeric columns")
    widths = [max([len(str(h))] + [len(row[i]) for row in texts]) for i, h in enumerate(header)]

    def line(values) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    return "\n".join([line([str(h) for h in header]), line(["-" * w for w in widths]),
                      *(line(row) for row in texts)])


def rank_table(records: Iterable[dict], columns: Sequence[str]) -> str:
    """result.records as a table: one row per record sorted by rank, the named columns.

    Args:
        records: dicts with a "rank" key (result.records of a run).
        columns: the reported names to show, in order; missing values show empty.
    """
    rows = sorted(records, key=lambda r: r.get("rank", -1))
    return text_table(["rank", *columns], [[r.get("rank"), *(r.get(c) for c in columns)] for r in rows])
