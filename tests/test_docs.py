"""docs/architecture.md stays true: the commands it names parse, the modules and files it
names exist, and the exit statuses it lists are the CLI's."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from labutils import cli
from labutils.run import result

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def commands() -> list[str]:
    """The `labutils ...` lines of the page's code blocks."""
    return [line.strip() for line in DOC.splitlines()
            if line.startswith("    labutils ")]


@pytest.mark.parametrize("line", commands())
def test_every_command_on_the_page_parses(line):
    argv = shlex.split(line)[1:]
    if "--" in argv:
        argv = argv[:argv.index("--")]
    cli.build_parser().parse_args(argv)  # SystemExit(2) on an unknown command or flag


def test_the_page_names_commands():
    assert {c.split()[1] for c in commands()} >= {"launch", "doctor", "grade"}


@pytest.mark.parametrize("name", sorted(set(re.findall(r"`(labutils(?:\.\w+)+)", DOC))))
def test_every_module_named_exists(name):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # labutils.run.spec.make_spec: a module, then a name
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            module = getattr(module, attr)
        return
    pytest.fail(f"{name} is not importable")


@pytest.mark.parametrize("path", sorted(set(re.findall(r"`((?:labutils|tests|docs)/[\w/]+\.\w+)`", DOC))))
def test_every_file_named_exists(path):
    assert (ROOT / path).exists() or (ROOT / "src" / path).exists(), path


def test_the_exit_statuses_listed_are_the_clis():
    listed = dict((int(code), what) for code, what in re.findall(r"\b(\d{1,3}) (ok|a rank failed|"
                                                                 r"usage error|hang|timeout|interrupted)", DOC))
    assert listed == {result.EXIT_OK: "ok", result.EXIT_FAILED: "a rank failed",
                      result.EXIT_USAGE: "usage error", result.EXIT_HANG: "hang",
                      result.EXIT_TIMEOUT: "timeout", result.EXIT_INTERRUPTED: "interrupted"}
