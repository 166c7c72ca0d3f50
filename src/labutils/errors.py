"""Error classes that carry the facts a learner needs to fix the problem."""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TypeGuard


def whole_number(value: object) -> TypeGuard[int]:
    """Whether value is an int that is not a bool (True is an int to Python, not a count).

    Args:
        value: what a caller passed where a count, rank or step is expected.
    """
    return isinstance(value, int) and not isinstance(value, bool)


def real_number(value: object) -> bool:
    """Whether value is an int or a float, not a bool and not NaN (seconds, points, rates).

    Args:
        value: what a caller passed where a quantity is expected.
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def cannot_write(path: str | os.PathLike, *, folder: bool = True) -> str | None:
    """Why this process cannot write into the folder at path (folder=True) or a file at
    path (folder=False), in a few words, after making the folder (or the file's folder)
    with its parents; None when it can. For the one-line errors of the options that
    say where output goes (log_dir, --out).

    Args:
        path: the folder, or the file, as the user gave it.
        folder: whether path is a folder to write into rather than a file to write.
    """
    target = Path(path)
    where = target if folder else target.parent
    above = where
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        return f"{above} is a file"
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    if not folder and target.is_dir():
        return "a folder is there"
    if not os.access(where, os.W_OK | os.X_OK):
        return f"{where} is not writable by this user"
    return None


def write_out(path: str | os.PathLike, text: str) -> None:
    """Write a command's --out file (a batch script, a manifest), its folder made if need
    be; InputError, one line, where it cannot be written."""
    why = cannot_write(path, folder=False)
    if why is None:
        try:
            Path(path).write_text(text)
            return
        except OSError as exc:
            why = exc.strerror or str(exc)
    raise InputError("--out", expected="a file in a folder this user can write",
                     given=f"{path} ({why})", fix="pass another --out, or leave it out to print it")


class LabutilsError(Exception):
    """Base class of every error labutils raises on purpose."""


class InputError(LabutilsError, ValueError):
    """A function was given a value it cannot use.

    Carries what was expected, what was given and how to fix it, and formats them as
    one line so the notebook shows a short, readable message.
    """

    def __init__(self, what: str, *, expected: str, given: object, fix: str) -> None:
        self.what = what
        self.expected = expected
        self.given = given
        self.fix = fix
        super().__init__(f"{what}: expected {expected}, got {given!r}; {fix}")


def in_flag_words(exc: InputError, flags: Mapping[str, str], *, bare: Collection[str] = (),
                  helps: Mapping[str, str] | None = None, parts: Mapping[str, str] | None = None,
                  default: str = "") -> str:
    """An InputError of a Python function as someone who typed a command's flags reads
    it: each keyword of the function (`nproc`, `max_restarts=1`) in the flag's words
    (`-n/--nproc`, `--max-restarts 1`). A bare word counts as a keyword when it has an
    underscore or is named in `bare` (`nproc`), so prose words stay as they are. Where
    the advice is still Python's (`None`, a dict), the flag's help, which says how the
    command asks for the same thing, or `default`. Errors of other values come back as
    they are.

    Args:
        exc: what the function raised for a value the parsed flags gave it.
        flags: {keyword: the flags that set it, e.g. "-n/--nproc"}.
        bare: keywords without an underscore that are no prose word ("nproc").
        helps: {keyword: its flag's help text}.
        parts: {second word of a compound `what`: its flag} ("fault rank": {"rank": "--kill-rank"}).
        default: the advice when a keyword has no help.
    """
    words = exc.what.split()
    if not words or words[0] not in flags:
        return str(exc)
    parts = dict(parts or {})

    def flag(m: re.Match) -> str:
        name, assigned = m[1], m[2]
        if name not in flags or not (assigned or "_" in name or name in bare):
            return m[0]
        return flags[name] + (" " if assigned else "")

    def said(text: str) -> str:
        return re.sub(r"(?<![-\w])([a-z_]+)(=(?=\S))?", flag, text)

    fix = said(exc.fix)
    if "None" in fix or "{" in fix or "=..." in fix:  # still Python's words
        fix = f"--help says: {helps[words[0]]}" if helps and words[0] in helps else default or fix
    what = parts.get(words[1], exc.what) if len(words) > 1 else flags[words[0]]
    return f"{what}: expected {said(exc.expected.removesuffix(' or None'))}, got {said(repr(exc.given))}; {fix}"


class LaunchConfigError(InputError):
    """A launch request was rejected before any rank started (same one-line format)."""


class ScriptSyntaxError(LaunchConfigError):
    """The learner's script does not compile; carries file, line and the compiler's message."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        self.path = path
        self.line = line
        self.message = message
        LabutilsError.__init__(
            self,
            f"syntax error in {path}:{line}: {message}; fix the script and run again "
            "(no rank was started)",
        )
        self.what, self.expected, self.given, self.fix = (
            "script", "valid Python", f"{path}:{line}", "fix the syntax error",
        )


class GradingError(LabutilsError, ValueError):
    """The grader cannot start: a lab folder, a submission or an export input is not usable."""


class RecordError(LabutilsError, TypeError):
    """report() was given a value that cannot be sent to the notebook as JSON."""

    def __init__(self, name: str, value: object) -> None:
        self.name = name
        self.value = value
        super().__init__(
            f"report({name}=...): expected a number, string, bool, None, a one-element "
            f"tensor or a list/dict of those, got {type(value).__name__}; "
            f"convert it first, e.g. report({name}=float(x))"
        )
