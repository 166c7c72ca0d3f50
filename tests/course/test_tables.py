"""labutils.course.tables: fixed-width text tables for checked notebook outputs."""

from __future__ import annotations

import pytest

from labutils.errors import InputError
from labutils.course.tables import bytes_in, cell, rank_table, text_table


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, ""), (3.0, "3"), (0.1, "0.1"), (1e-7, "1e-07"), (7, "7"), (True, "True"),
     ("x", "x"), ([0.0, 1.0], "[0 1]"), ([[0.0, 1.0], [10.0]], "[[0 1] [10]]"), ((), "[]")],
)
def test_cell(value, text):
    assert cell(value) == text


def test_text_table_aligns_columns():
    table = text_table(["name", "n"], [["ring", 3], ["naive ring", 12.0]], right=[1])
    assert table.splitlines() == [
        "name         n",
        "----------  --",
        "ring         3",
        "naive ring  12",
    ]


def test_text_table_without_rows():
    assert text_table(["a", "bb"], []) == "a  bb\n-  --"


def test_rank_table_sorts_by_rank_and_leaves_missing_empty():
    records = [{"rank": 1, "x": 2.0}, {"rank": 0, "x": 1.0, "y": [1.0]}]
    assert rank_table(records, ["x", "y"]).splitlines() == [
        "rank  x  y", "----  -  ---", "0     1  [1]", "1     2",
    ]


@pytest.mark.parametrize(
    ("header", "rows", "right", "fragment"),
    [
        ([], [], (), "header: expected a non-empty list"),
        ("ab", [], (), "header"),
        (["a", "b"], [[1]], (), r"rows\[0\]: expected 2 values"),
        (["a"], [[1], [1, 2]], (), r"rows\[1\]"),
        (["a"], [[1]], (1,), "right: expected column indexes 0..0"),
        (["a"], [[1]], ("0",), "right"),
    ],
)
def test_text_table_rejects(header, rows, right, fragment):
    with pytest.raises(InputError, match=fragment):
        text_table(header, rows, right=right)


@pytest.mark.parametrize("nbytes, unit, digits, shown", [
    (3_730_432, "MiB", 2, "3.56"), (4_712, "KiB", 1, "4.6"), (0, "MiB", 2, "0.00"),
    (1_288_490_189, "MiB", 3, "1,228.800"), (2**30, "GiB", 2, "1.00"),
])
def test_bytes_in_one_unit_for_a_column(nbytes, unit, digits, shown):
    assert bytes_in(nbytes, unit, digits) == shown


def test_bytes_in_an_unknown_unit_is_a_clear_error():
    with pytest.raises(InputError, match="unit"):
        bytes_in(1, "MB")
