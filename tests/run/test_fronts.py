"""What each front of the launcher accepts: launch()'s parameters, every `labutils`
subcommand's flags, and %%torchrun's, against tests/data/fronts.txt (written from the
code before the engine was restructured, issue 24). A change here is a change of
contract: update the file on purpose, in the same commit as the docs."""

from __future__ import annotations

import argparse
import inspect

from helpers import DATA

from labutils.cli import build_parser
from labutils.notebook.magics import TorchrunMagics
from labutils.run.launcher import launch


def fronts() -> list[str]:
    lines = [f"launch() {sorted(inspect.signature(launch).parameters)}"]
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    for name, parser in sorted(commands.choices.items()):
        lines.append(f"cli {name} {sorted(o for a in parser._actions for o in a.option_strings)}")
    magic = TorchrunMagics.torchrun.parser
    lines.append(f"%%torchrun {sorted(o for a in magic._actions for o in a.option_strings)}")
    return lines


def test_every_front_accepts_what_it_accepted():
    assert fronts() == (DATA / "fronts.txt").read_text().splitlines()
