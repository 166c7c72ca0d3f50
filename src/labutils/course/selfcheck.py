"""The self-check at the end of every lesson: the learner's answers against the expected ones.

Each lesson keeps its questions as ``{name: (expected, hint)}`` (or ``(expected, hint,
rel_tol)`` for a number that is measured, not exact) and calls check_answers(), which
prints one line per question: correct, not quite (with the hint), or not answered yet.
"""

from __future__ import annotations

import math

TEXT_MODES = ("exact", "contains")


def answer_matches(given, want, *, rel_tol: float = 1e-9, text: str = "exact") -> bool:
    """Whether an answer counts as right.

    - True/False: the same bool (1 is not True);
    - text: case and surrounding spaces ignored; text="contains" accepts an answer that
      contains the expected word ("in backward()" for "backward");
    - numbers: math.isclose with rel_tol (ints and floats alike, bools never);
    - lists and tuples: the same length and every item matching;
    - None as the expected value: nothing matches (the notebook has not computed it yet).
    """
    if want is None:
        return False
    if isinstance(want, bool):
        return given is want
    if isinstance(want, str):
        answer, expected = str(given).strip().lower(), want.strip().lower()
        return expected in answer if text == "contains" else answer == expected
    if isinstance(want, (list, tuple)):
        return isinstance(given, (list, tuple)) and len(given) == len(want) and all(
            answer_matches(g, w, rel_tol=rel_tol, text=text) for g, w in zip(given, want))
    if isinstance(given, bool) or not isinstance(given, (int, float)):
        return False
    return math.isclose(given, want, rel_tol=rel_tol, abs_tol=1e-12)


def check_answers(answers: dict, expected: dict, *, rel_tol: float = 1e-9,
                  text: str = "exact") -> dict[str, bool | None]:
    """Print, per question, whether the answer is right; answers left as None are skipped.

    Args:
        answers: question name -> the learner's answer.
        expected: question name -> (answer, hint) or (answer, hint, rel_tol).
        rel_tol: tolerance for numbers without their own.
        text: "exact" or "contains", how text answers are compared (see answer_matches).

    Returns:
        question name -> True (right), False (not quite) or None (not answered).
    """
    if text not in TEXT_MODES:
        raise ValueError(f"text: expected one of {TEXT_MODES}, got {text!r}")
    if not isinstance(answers, dict):
        print(f"answers: expected a dict of question name -> answer, got {type(answers).__name__}")
        return {}
    unknown = sorted(set(answers) - set(expected))
    if unknown:
        print(f"unknown question names {unknown}; expected {sorted(expected)}")
    results: dict[str, bool | None] = {}
    for name, (want, hint, *own) in expected.items():
        given = answers.get(name)
        if given is None:
            results[name] = None
            print(f"{name}: not answered yet")
            continue
        tol = own[0] if own else rel_tol
        results[name] = answer_matches(given, want, rel_tol=tol, text=text)
        print(f"{name}: correct" if results[name] else f"{name}: not quite ({given!r}); hint: {hint}")
    return results
