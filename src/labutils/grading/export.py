"""Grades out of the grader: a per-check summary of a class, and a Canvas gradebook CSV.

`labutils grade` writes, next to grades.csv, checks.csv and checks.png: for every
check, how many submissions failed it, its mean score and who sees its result
(the checks most learners fail come first). `labutils export GRADES --roster
ROSTER.csv --assignment NAME` reads the results.json files of a grading and writes
a CSV that Canvas's gradebook import takes: the roster's student columns (Student,
ID, SIS User ID, SIS Login ID, Section) and one column for the assignment, matched
on a roster column (the submission's folder name is the learner's login by default),
as points scaled to the assignment's (--points), or complete/incomplete by the lab's
pass mark (--complete), with 0 for learners who sent nothing (--missing-zero).

Canvas's "Download Submissions" zip can be graded as it is: `labutils grade LAB
submissions.zip` unpacks it into one folder per learner, named by Canvas's user id
(the roster's "ID"), and records who was late (canvas.json next to the grades); the
export then matches on "ID" and lists the late submissions.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import zipfile
from pathlib import Path

from labutils.errors import GradingError, cannot_write
from labutils.grading.report import write_atomic

CANVAS_STUDENT_COLUMNS = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
CANVAS_INDEX = "canvas.json"   # written next to the grades when a Canvas zip was graded
# A file in Canvas's "Download Submissions" zip: name_[LATE_]userid_submissionid_file
_CANVAS_FILE = re.compile(r"^(?P<student>[^_/]+)_(?P<late>LATE_)?(?P<user>\d+)_(?P<sub>\d+)_(?P<file>.+)$")
SUMMARY_COLUMNS = ["check", "visibility", "max_score", "submissions", "failed", "failed_percent",
                   "mean_score"]


def check_summary(results: list[dict]) -> list[dict]:
    """Per check across submissions (results.json dicts): failures first, most failed first."""
    rows: dict[str, dict] = {}
    for result in results:
        for test in result.get("tests", []):
            if not test.get("max_score"):
                continue   # the integrity note scores nothing
            row = rows.setdefault(test["name"], {
                "check": test["name"], "visibility": test.get("visibility", "visible"),
                "max_score": test["max_score"], "submissions": 0, "failed": 0, "total": 0.0})
            row["submissions"] += 1
            row["failed"] += test.get("status") != "passed"
            row["total"] += test.get("score", 0.0)
    out = []
    for row in rows.values():
        n = row.pop("submissions")
        total = row.pop("total")
        out.append({**row, "submissions": n, "failed_percent": round(100 * row["failed"] / n, 1),
                    "mean_score": round(total / n, 2)})
    return sorted(out, key=lambda r: (-r["failed_percent"], r["check"]))


def summary_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, SUMMARY_COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def summary_plot(rows: list[dict], title: str, path: Path) -> None:
    """A horizontal bar per check: the share of submissions that failed it."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = [_short(r["check"]) + ("" if r["visibility"] == "visible" else " (hidden)")
             for r in rows][::-1]
    shares = [r["failed_percent"] for r in rows][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    bars = ax.barh(names, shares, color="#cf222e")
    ax.bar_label(bars, labels=[f"{r['failed']}/{r['submissions']}" for r in rows][::-1],
                 padding=3, fontsize=8)
    ax.set_xlim(0, 110)
    ax.set_xlabel("submissions that failed the check (%)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def write_summary(out_dir: Path, results: list[dict], title: str) -> list[dict]:
    """checks.csv and checks.png in out_dir, from results.json dicts."""
    rows = check_summary(results)
    write_atomic(Path(out_dir) / "checks.csv", summary_csv(rows))
    if rows:
        summary_plot(rows, f"{title}: {len(results)} submissions", Path(out_dir) / "checks.png")
    return rows


def read_grades(grades_dir: str | os.PathLike) -> dict[str, dict]:
    """submission name -> its results.json, from a folder `labutils grade` wrote."""
    folder = Path(grades_dir)
    found = {p.parent.name: json.loads(p.read_text()) for p in sorted(folder.glob("*/results.json"))}
    if not found:
        raise GradingError(f"{grades_dir}: no */results.json there; expected the --out "
                           "folder of `labutils grade`")
    return found


def unpack_canvas(zip_path: Path, dest: Path, expected: list[str], grades: Path) -> list[Path]:
    """Unpack Canvas's "Download Submissions" zip into dest/<user id>/ folders, each file
    under its own name (Canvas's "-1" of a resubmitted file dropped when that gives one
    of the `expected` names); add each learner to grades/canvas.json (user id ->
    student, late). Returns the folders, one per learner."""
    try:
        archive = zipfile.ZipFile(zip_path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise GradingError(f"{zip_path}: not a zip file ({exc})") from None
    index_path = grades / CANVAS_INDEX
    index: dict[str, dict] = json.loads(index_path.read_text()) if index_path.is_file() else {}
    users: set[str] = set()
    with archive:
        members = [m for m in archive.infolist() if not m.is_dir()]
        odd = [m.filename for m in members if not _CANVAS_FILE.match(Path(m.filename).name)]
        if not members or odd:
            raise GradingError(f"{zip_path.name}: expected Canvas's Download Submissions zip "
                               f"(files named student_userid_submissionid_file), found "
                               f"{odd[0] if odd else 'no file'}")
        for member in members:
            m = _CANVAS_FILE.match(Path(member.filename).name)
            assert m is not None   # every member matched above
            name = m["file"]
            plain = re.sub(r"-\d+(\.[^.]+)$", r"\1", name)
            if name not in expected and plain in expected:
                name = plain
            folder = dest / m["user"]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / Path(name).name).write_bytes(archive.read(member))
            if m["user"] not in users:
                index[m["user"]] = {"student": m["student"], "late": False}
                users.add(m["user"])
            index[m["user"]]["late"] = index[m["user"]]["late"] or bool(m["late"])
    write_atomic(index_path, json.dumps(index, indent=2))
    return [dest / user for user in sorted(users)]


def canvas_csv(results: dict[str, dict], roster: list[dict], assignment: str, *,
               match: str = "SIS Login ID", points: float | None = None,
               complete: bool = False, missing_zero: bool = False,
               ) -> tuple[str, list[str], list[str]]:
    """(CSV text, submissions with no roster row, roster students with no submission).

    points: the assignment's points in Canvas; each score is scaled to it (None: the
    lab's own points). complete: write complete/incomplete by the lab's pass mark.
    missing_zero: 0 (or incomplete) for a learner of the roster with no submission.
    """
    if not roster:
        raise GradingError("the roster is empty: export the Canvas gradebook (Grades > Export) "
                           "and pass that CSV")
    missing = [c for c in CANVAS_STUDENT_COLUMNS if c not in roster[0]]
    if match not in roster[0] or "ID" in missing:
        raise GradingError(f"the roster has no column {match if match not in roster[0] else 'ID'!r}; "
                           f"expected Canvas's gradebook export with {', '.join(CANVAS_STUDENT_COLUMNS)}"
                           f" (choose the matching column with --match)")
    by_key = {row[match].strip(): row for row in roster if row.get(match, "").strip()}
    unmatched = sorted(name for name in results if name not in by_key)
    absent = sorted(row.get("Student", key) for key, row in by_key.items() if key not in results)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*CANVAS_STUDENT_COLUMNS, assignment])
    max_score = next((r["max_score"] for r in results.values() if r.get("max_score")), None)
    if points is not None and (points <= 0 or max_score is None):
        raise GradingError(f"--points {points:g}: expected a number above 0, and graded "
                           "submissions to scale")
    possible = "" if complete or max_score is None else f"{points if points is not None else max_score:g}"
    writer.writerow(["Points Possible", "", "", "", "", possible])
    for row in roster:
        key = row.get(match, "").strip()
        if key in results:
            grade = _grade_cell(results[key], points=points, complete=complete)
        elif key and missing_zero:
            grade = "incomplete" if complete else "0"
        else:
            continue
        writer.writerow([row.get(c, "") for c in CANVAS_STUDENT_COLUMNS] + [grade])
    return buf.getvalue(), unmatched, absent


def _grade_cell(result: dict, *, points: float | None, complete: bool) -> str:
    extra = result.get("extra_data", {})
    if complete:
        return "complete" if extra.get("passed") else "incomplete"
    score, max_score = float(result["score"]), float(result.get("max_score") or 0)
    if points is not None and max_score:
        return f"{round(score * points / max_score, 2):g}"
    return f"{score:g}"


def read_roster(path: str | os.PathLike) -> list[dict]:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise GradingError(f"--roster {path}: cannot read it ({exc.strerror})") from None
    rows = list(csv.DictReader(io.StringIO(text)))
    # Canvas's export has a "Points Possible" row (and sometimes a muted row) under the header
    return [r for r in rows if r.get("Student", "").strip() not in ("Points Possible", "")]


def add_subcommand(sub) -> None:
    """Register ``labutils export``; its handler is ns.handler(ns) -> exit status."""
    p = sub.add_parser(
        "export", help="grades for an LMS: a Canvas gradebook CSV, and the per-check summary",
        description="Read the results of `labutils grade` in GRADES and write a CSV that "
        "Canvas's gradebook import takes (Grades > Import), one row per graded learner of "
        "ROSTER (Canvas's gradebook export), plus the per-check summary (checks.csv, "
        "checks.png) again. Exit status: 0 written, 2 bad input.")
    p.add_argument("grades", help="the --out folder of labutils grade")
    p.add_argument("--roster", required=True, help="Canvas's gradebook export (CSV)")
    p.add_argument("--assignment", required=True,
                   help='the gradebook column, e.g. "Lab 01 (1234)" (Canvas\'s name and id)')
    p.add_argument("--match", default=None,
                   help="the roster column that equals the submission's name (default: SIS "
                   "Login ID; ID when a Canvas Download Submissions zip was graded)")
    p.add_argument("--points", type=float, default=None,
                   help="the assignment's points in Canvas: scores are scaled to them")
    p.add_argument("--complete", action="store_true",
                   help="write complete/incomplete by the lab's pass mark instead of points")
    p.add_argument("--missing-zero", action="store_true",
                   help="0 (incomplete) for roster learners with no submission (default: "
                   "their grade is left as it is)")
    p.add_argument("--out", default=None, help="the CSV to write (default GRADES/canvas.csv)")
    p.set_defaults(handler=_export)


def _export(ns) -> int:
    results = read_grades(ns.grades)
    index_path = Path(ns.grades) / CANVAS_INDEX
    canvas = json.loads(index_path.read_text()) if index_path.is_file() else {}
    match = ns.match or ("ID" if canvas else "SIS Login ID")
    text, unmatched, absent = canvas_csv(results, read_roster(ns.roster), ns.assignment,
                                         match=match, points=ns.points, complete=ns.complete,
                                         missing_zero=ns.missing_zero)
    out = Path(ns.out) if ns.out else Path(ns.grades) / "canvas.csv"
    why = cannot_write(out, folder=False)
    if why:
        raise GradingError(f"--out {out}: cannot write the CSV there ({why}); expected a .csv "
                           "in a folder this user can write, e.g. --out canvas.csv")
    write_atomic(out, text)
    title = next(iter(results.values())).get("extra_data", {}).get("lab", "lab")
    write_summary(Path(ns.grades), list(results.values()), title)
    print(f"wrote {out}: {len(results) - len(unmatched)} grades for {ns.assignment}")
    if unmatched:
        print(f"not in the roster (no grade written): {', '.join(unmatched)}")
    if absent:
        print(f"{len(absent)} learner(s) of the roster have no submission; "
              + ("they get 0" if ns.missing_zero and not ns.complete else
                 "they get incomplete" if ns.missing_zero else "their grade is left as it is"))
    late = sorted(name for name, r in results.items()
                  if r.get("extra_data", {}).get("late") or canvas.get(name, {}).get("late"))
    if late:
        print(f"late: {', '.join(late)}")
    return 0
