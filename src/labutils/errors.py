"""Error classes that carry the facts a learner needs to fix the problem."""

from __future__ import annotations

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
