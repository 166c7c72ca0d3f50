"""labutils.course.selfcheck: the lessons' self-check, one matcher for every lesson."""

import pytest

from labutils.course.selfcheck import answer_matches, check_answers


@pytest.mark.parametrize("given, want, kw, ok", [
    (True, True, {}, True), (1, True, {}, False), (False, True, {}, False),
    (" Module. ", "module.", {}, True), ("modules", "module.", {}, False),
    ("in backward()", "backward", {"text": "contains"}, True),
    ("in backward()", "backward", {}, False),
    (64, 64, {}, True), (64.0, 64, {}, True), (64.5, 64, {}, False),
    (0.0251, 0.025, {"rel_tol": 0.02}, True), (0.026, 0.025, {"rel_tol": 0.02}, False),
    (True, 1, {}, False), ("64", 64, {}, False),
    ([3, 7, 1], [3, 7, 1], {}, True), ((3, 7, 1), [3, 7, 1], {}, True),
    ([3, 7], [3, 7, 1], {}, False), ("3,7,1", [3, 7, 1], {}, False),
    (1.0, None, {}, False),
])
def test_answer_matches(given, want, kw, ok):
    assert answer_matches(given, want, **kw) is ok


def test_check_answers_prints_one_line_per_question(capsys):
    expected = {"q1": (16, "steps done, rounded down"), "q2": ("c", "the reducer"),
                "q3": (0.5, "measured", 0.1)}
    results = check_answers({"q1": 16, "q2": "b", "q3": 0.53, "q9": 1}, expected)
    assert results == {"q1": True, "q2": False, "q3": True}
    out = capsys.readouterr().out.splitlines()
    assert out == ["unknown question names ['q9']; expected ['q1', 'q2', 'q3']",
                   "q1: correct", "q2: not quite ('b'); hint: the reducer", "q3: correct"]
    assert check_answers({}, expected) == {"q1": None, "q2": None, "q3": None}
    assert capsys.readouterr().out.count("not answered yet") == 3
