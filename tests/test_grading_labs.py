"""`labutils grade` on the real labs: every solution full marks, every starter below the pass mark.

Each test grades with the real grader (papermill in the sandbox, checks launching the
scripts through torchrun), two submissions at a time, the way an instructor would.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from labutils.grading.batch import grade

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# The checks an untouched starter must fail (every other check passes).
STARTER_FAILS = {
    "01_data_sharding": ["Every item is trained on exactly once", "The order of the items changes"],
    "02_rank_zero_collective": ["Training finishes", "Every log line shows the loss averaged"],
    "03_unused_parameters": ["Training runs every step", "Every rank ends with the same weights",
                             "The weights equal one process"],
    "04_gradient_accumulation": ["One gradient all-reduce per optimizer step",
                                 "The weights equal one process"],
    "05_ring_allreduce": ["ring_all_reduce sums in place", "Each rank sends 2(n-1)/n",
                          "ring_all_reduce uses only point-to-point"],
    "06_distributed_evaluation": ["Each of the 11 items is counted exactly once",
                                  "The accuracy equals the single-process accuracy"],
    "07_resume_after_kill": ["The resumed run ends with exactly the weights"],
}


def _tests(result: dict) -> dict[str, dict]:
    return {t["name"]: t for t in result["tests"]}


def _failing(result: dict) -> list[str]:
    return sorted(t["name"] for t in result["tests"] if t["status"] != "passed" and t["max_score"])


def _assert_solution(result: dict) -> None:
    assert result["passed"] and not result.get("grader_error"), result
    failing = [(t["name"], t["output"]) for t in result["tests"] if t["status"] != "passed"]
    assert not failing, failing
    assert result["notebook"]["status"] == "completed"
    assert result["integrity"] == []


def _assert_starter(lab: str, result: dict) -> None:
    assert not result["passed"] and not result.get("grader_error"), result
    expected = STARTER_FAILS[lab]
    failing = _failing(result)
    assert len(failing) == len(expected), failing
    for prefix in expected:
        assert any(name.startswith(prefix) for name in failing), (prefix, failing)
    assert result["notebook"]["status"] == "completed", "the starter notebook runs to its end"


def _check_outputs(out: Path, results: list[dict]) -> None:
    for result in results:
        folder = out / result["name"]
        data = json.loads((folder / "results.json").read_text())
        assert {"score", "max_score", "tests", "execution_time"} <= set(data)
        assert (folder / "feedback.html").is_file()
        assert (folder / "executed.ipynb").is_file() == result["has_executed_notebook"]
    assert len((out / "grades.csv").read_text().splitlines()) == len(results) + 1


@pytest.mark.parametrize("lab", [lab for lab in STARTER_FAILS if lab != "06_distributed_evaluation"])
def test_solution_full_marks_and_starter_below_pass_mark(lab, tmp_path):
    results = grade(REPO / "labs" / lab,
                    [REPO / "solutions" / lab / f"{lab}.ipynb", REPO / "labs" / lab / f"{lab}.ipynb"],
                    out_dir=tmp_path / "out", jobs=2, progress=None)
    _assert_solution(results[0])
    _assert_starter(lab, results[1])
    _check_outputs(tmp_path / "out", results)


def _variant(tmp_path: Path, name: str, *, script_from: str, edit=None, notebook_text=None,
             lab: str = "06_distributed_evaluation") -> Path:
    """A submission folder: a notebook (the starter's unless replaced) and evaluate.py."""
    folder = tmp_path / "submissions" / name
    folder.mkdir(parents=True)
    source = (REPO / script_from / lab / "evaluate.py").read_text()
    for old, new in (edit or {}).items():
        assert old in source
        source = source.replace(old, new)
    (folder / "evaluate.py").write_text(source)
    notebook = REPO / "solutions" / lab / f"{lab}.ipynb"
    if notebook_text is None:
        shutil.copyfile(notebook, folder / f"{lab}.ipynb")
    elif notebook_text:
        (folder / f"{lab}.ipynb").write_text(notebook_text(notebook.read_text()))
    return folder


def test_eight_submissions_two_at_a_time_in_under_three_minutes(tmp_path):
    """One lab, 8 submissions of all kinds, --jobs 2: partial credit, integrity, speed."""
    lab = "06_distributed_evaluation"
    subs = {
        "solution": REPO / "solutions" / lab / f"{lab}.ipynb",
        "starter": REPO / "labs" / lab / f"{lab}.ipynb",
        # drops the padding, and real items with it: 10 of 11 counted at 2 ranks
        "drop_last": _variant(tmp_path, "drop_last", script_from="labs", edit={
            "sampler=DistributedSampler(dataset, shuffle=False))":
            "sampler=DistributedSampler(dataset, shuffle=False, drop_last=True))"}),
        # counts every item once, then averages the ranks' accuracies: partial credit
        "mean_of_ranks": _variant(tmp_path, "mean_of_ranks", script_from="solutions", edit={
            "dist.all_reduce(correct)  # sums over the ranks\ndist.all_reduce(counted)\n"
            "accuracy = correct.item() / counted.item()":
            "share = torch.tensor(correct.item() / max(1, counted.item()))\n"
            "dist.all_reduce(share)\ndist.all_reduce(counted)\naccuracy = share.item() / world_size"}),
        # a locked cell edited to hide the symptom: undone, reported, no effect on the score
        "edited_cell": _variant(tmp_path, "edited_cell", script_from="solutions",
                                notebook_text=lambda t: t.replace("assert row[", "pass  # assert row[")),
        # a checks.py that always passes, next to the starter: ignored and reported
        "fake_checks": _variant(tmp_path, "fake_checks", script_from="labs"),
        "no_notebook": _variant(tmp_path, "no_notebook", script_from="solutions", notebook_text=""),
        "broken_json": _variant(tmp_path, "broken_json", script_from="solutions",
                                notebook_text=lambda t: t[: len(t) // 2]),
    }
    (subs["fake_checks"] / "checks.py").write_text(
        "from labutils.grading import check\n\n@check('all good', points=100)\n"
        "def good(c):\n    c.expect(True, 'everything')\n")
    t0 = time.monotonic()
    results = grade(REPO / "labs" / lab, list(subs.values()), out_dir=tmp_path / "out", jobs=2,
                    progress=None)
    elapsed = time.monotonic() - t0
    by = dict(zip(subs, results))
    _assert_solution(by["solution"])
    _assert_starter(lab, by["starter"])
    assert _failing(by["drop_last"]) == _failing(by["starter"])
    assert "10 predictions counted" in _tests(by["drop_last"])[_failing(by["drop_last"])[0]]["output"]
    mean = _tests(by["mean_of_ranks"])
    assert mean["Each of the 11 items is counted exactly once, at 2 and 3 ranks"]["status"] == "passed"
    accuracy = mean["The accuracy equals the single-process accuracy, at 2 and 3 ranks"]
    assert accuracy["status"] == "failed" and "measured: accuracy" in accuracy["output"]
    assert by["edited_cell"]["passed"] and by["edited_cell"]["integrity"] == [
        "locked cell 'symptom' was edited; the grader ran the lab's version"]
    assert not by["fake_checks"]["passed"]
    assert by["fake_checks"]["integrity"] == ["the checks differ from the lab's copy; the grader used its own"]
    assert {t["name"] for t in by["fake_checks"]["tests"]} == {t["name"] for t in by["starter"]["tests"]}
    for name in ("no_notebook", "broken_json"):
        notebook = _tests(by[name])["The notebook runs from top to bottom"]
        assert notebook["status"] == "failed", name
        assert by[name]["passed"], "the scripts are right: only the notebook point is lost"
    assert "no notebook found" in _tests(by["no_notebook"])["The notebook runs from top to bottom"]["output"]
    assert "not valid JSON" in _tests(by["broken_json"])["The notebook runs from top to bottom"]["output"]
    _check_outputs(tmp_path / "out", results)
    print(f"8 submissions, --jobs 2: {elapsed:.0f} s")
    assert elapsed < 180, f"8 submissions took {elapsed:.0f} s"
