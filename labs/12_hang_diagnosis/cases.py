"""The hang each learner diagnoses in lab 12 (keep as is: the checks use it too).

A case is one of three versions of train.py, each with the bug written its own way
(original/), run at 2, 3 or 4 ranks on readings whose one corrupt reading sits on a
given rank. Your case follows from your student id: two learners rarely share one.
"""

import hashlib
import os

# The versions of train.py in original/, as colleagues wrote them before the lab's.
VERSIONS = ("original/train.py", "original/train_v2.py", "original/train_v3.py")
# (ranks, --seed): the readings of that seed hold one corrupt reading, in step 2 or 3,
# on a rank of its own; the rank differs from one pair to the next.
WORLDS = ((2, 9), (2, 6), (3, 6), (3, 20), (3, 9), (4, 10), (4, 12), (4, 9), (4, 6))
GLOBAL_BATCH = 12   # readings per step, over all ranks


def case_number(student_id: str) -> int:
    """The case of a student id: the same id always gives the same case."""
    text = str(student_id).strip().lower()
    if not text or text == "none":
        raise ValueError("set student_id to your student id (as the course roster has it) first: "
                         "your case follows from it")
    digest = hashlib.sha256(f"lab12:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (len(VERSIONS) * len(WORLDS))


def case(student_id: str) -> dict:
    """{"number", "script", "nproc", "args"}: the run whose hang a student diagnoses."""
    return numbered(case_number(student_id))


def numbered(number: int) -> dict:
    """Case `number` (0 to 26)."""
    version, (nproc, seed) = number // len(WORLDS), WORLDS[number % len(WORLDS)]
    return {"number": number, "script": VERSIONS[version], "nproc": nproc,
            "args": ["--batch-size", str(GLOBAL_BATCH // nproc), "--corrupt", "1",
                     "--seed", str(seed)]}


def your_case(student_id) -> dict:
    """The notebook's case: the student's, or case 0 to practise on while student_id is
    not set (the grader then has no case to compare a diagnosis with)."""
    try:
        mine = case(student_id)
    except ValueError as exc:
        print(f"{exc}. Until then, case 0 to practise on.")
        mine = numbered(0)
    print(f"case {mine['number']}: {mine['script']} on {mine['nproc']} ranks, "
          f"args: {' '.join(mine['args'])}")
    return mine


def stack_dumps(mine: dict, *, hang_timeout: float) -> dict[int, str]:
    """Run the case; once no rank has made progress for hang_timeout seconds, each rank's
    main-thread stack as it was then: innermost frame first, down to the script's own
    outermost line (the launcher's and torchrun's frames below it are left out)."""
    from labutils import launch
    from labutils.runtime.runfiles import shorten_paths

    result = launch(mine["script"], nproc=mine["nproc"], args=mine["args"],
                    hang_timeout=hang_timeout, display="none")
    if result.hang is None:
        raise RuntimeError(f"{mine['script']} did not hang ({result.reason}): it is one of the "
                           "lab's files, leave it as it is")
    # Paths as a learner reads them: torch's from torch/, the case's script as the case names
    # it (it may be a link, which the ranks' stacks show resolved).
    folder = os.path.dirname(mine["script"])
    resolved = os.path.dirname(os.path.realpath(mine["script"])) + os.sep
    return {rank: shorten_paths(text.replace(resolved, folder + os.sep))
            .replace(".../site-packages/", "")
            for rank, text in sorted(result.hang.stacks.items())}
