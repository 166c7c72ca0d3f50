"""Lab 12's cases: the hang each learner diagnoses, picked by student id, and the
evidence the notebook shows (each rank's stack, no verdict)."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
from helpers import REPO

from labutils import launch
from labutils.grading.runner import load_checks

LAB = REPO / "labs" / "12_hang_diagnosis"


@pytest.fixture(scope="module")
def cases():
    sys.path.insert(0, str(LAB))
    try:
        import cases as module
        yield module
    finally:
        sys.path.remove(str(LAB))
        sys.modules.pop("cases", None)


@pytest.fixture(scope="module")
def checks(cases):
    """The lab's checks.py, loaded as the grader loads it (the lab folder on sys.path)."""
    return load_checks(LAB)


def test_a_student_id_always_gives_the_same_case_and_ids_spread_over_all(cases):
    assert cases.case("s1234") == cases.case(" S1234 ")
    spread = Counter(cases.case_number(f"student{i}") for i in range(2700))
    assert len(spread) == len(cases.VERSIONS) * len(cases.WORLDS) == 27
    assert min(spread.values()) > 50  # about 100 each
    for missing in (None, "", "  "):
        with pytest.raises(ValueError, match="set student_id"):
            cases.case(missing)


def test_a_line_is_read_as_the_stacks_and_the_summaries_write_it(checks):
    """`hung_line` as a number, a file:line, or a frame copied from the stacks (an audit's
    correct answer, 'line 57', was read as none and lost its points)."""
    for said in (57, 57.0, "57", "train.py:57", "line 57", " line 57 ",
                 'File "original/train_v2.py", line 57 in <module>'):
        assert checks._number(said) == 57, said
    for said in (57.5, "fifty", None, True, "5 7", "", "line", "train.py"):
        assert checks._number(said) is None, said


def test_every_world_puts_its_one_corrupt_reading_on_a_rank_of_its_own(cases):
    from readings import _sensor_log  # the lab folder is on sys.path while `cases` lives

    finders = set()
    for nproc, seed in cases.WORLDS:
        _, targets = _sensor_log(96, 1, seed)
        (item,) = [i for i in range(96) if targets[i].isnan().any()]
        rank, step = item % nproc, (item // nproc) // (cases.GLOBAL_BATCH // nproc)
        assert step >= 2, (nproc, seed)  # some steps train before the hang
        finders.add((nproc, rank))
    assert finders == {(2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (4, 0), (4, 1), (4, 2), (4, 3)}


@pytest.mark.parametrize(("given", "name"), [
    ("broadcast", "broadcast"), ("dist.all_gather", "all_gather"), ("barrier()", "barrier"),
    ("torch.distributed.broadcast", "broadcast"), ("", None), (None, None), (3, None),
    ("two words", None)])
def test_the_collective_is_read_by_its_name(checks, given, name):
    assert checks._call_name(given) == name


@pytest.mark.slow
def test_each_version_hangs_with_the_finder_in_its_own_collective(cases, tmp_path, monkeypatch):
    """One world per version; the launcher's report names the rank the data says, in a
    collective of that version's own, at a line of its own."""
    monkeypatch.chdir(LAB)
    seen = {}
    for version, world in zip(cases.VERSIONS, [(2, 6), (3, 9), (4, 12)]):
        number = cases.VERSIONS.index(version) * len(cases.WORLDS) + cases.WORLDS.index(world)
        mine = next(cases.case(f"id{i}") for i in range(20000) if cases.case_number(f"id{i}") == number)
        result = launch(mine["script"], nproc=mine["nproc"], args=mine["args"], hang_timeout=4,
                        display="none", timeout=90, log_dir=tmp_path)
        assert result.hang is not None, result.summary()
        odd = [r for r, call in result.hang.calls.items() if call != "backward"]
        assert odd == [{(2, 6): 1, (3, 9): 2, (4, 12): 1}[world]], result.hang.calls
        seen[version] = (result.hang.calls[odd[0]], result.hang.waiting[odd[0]])
        stack = result.hang.stacks[odd[0]]
        assert f"in {seen[version][0]}" in stack and "labutils" not in stack
    assert len({call for call, _ in seen.values()}) == 3, seen
    assert len({where for _, where in seen.values()}) == 3, seen


@pytest.mark.slow
def test_a_diagnosis_copied_from_another_case_fails_and_the_right_one_passes(cases, checks, tmp_path):
    """The solution's answer (case 22: rank 2, line 52, barrier) under its own id and
    under the id of a learner whose case is another version, world and rank."""
    from labutils.grading.checks import Checker, run_check

    other = next(f"id{i}" for i in range(1000) if cases.case(f"id{i}")["script"] != "original/train_v3.py"
                 and cases.case(f"id{i}")["nproc"] != 3)
    scores = {}
    for student in ("solution", other):
        learner = tmp_path / student
        (learner / "runs").mkdir(parents=True)
        (learner / "runs" / "diagnosis.json").write_text(json.dumps(
            {"student_id": student, "rank": 2, "line": 52, "collective": "barrier"}))
        checker = Checker(learner_dir=learner, checks_dir=LAB, scratch=tmp_path / f"scratch-{student}",
                          edit=["train.py"])
        scores[student] = run_check(checks.diagnosis, checker)
    assert scores["solution"].score == scores["solution"].points == 3, scores["solution"].output()
    assert scores[other].score < 2, scores[other].output()  # a rank may match by chance, not all three
