"""A lab as a Gradescope autograder: `labutils autograder LAB --out autograder.zip`.

Gradescope unzips the autograder into /autograder/source, runs setup.sh once to build
the image, then, per submission, runs /autograder/run_autograder with the learner's
files in /autograder/submission and reads /autograder/results/results.json. The zip
holds::

    setup.sh            a venv in /autograder/venv: torch 2.13.0 (CPU build), the
                        course's pinned packages (requirements.lock), labutils
    run_autograder      grades /autograder/submission with that venv
    lab/                the lab, hidden checks included (learners never see the zip)
    labutils/           the labutils package source (pyproject.toml, src/)
    requirements.lock

Every path comes from one variable, AUTOGRADER_ROOT (default /autograder), so the
whole thing can run in any folder standing in for /autograder, as the tests do.
Grading itself is `labutils grade`: the same sandbox, checks and results.json
(Gradescope's format, each test with its visibility).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from labutils.errors import GradingError, cannot_write
from labutils.grading.batch import grade, load_lab, max_score
from labutils.grading.report import gradescope_results, write_atomic

ROOT_ENV = "AUTOGRADER_ROOT"
DEFAULT_ROOT = "/autograder"
REPO = Path(__file__).resolve().parents[3]   # the course: pyproject.toml, requirements.lock

SETUP_SH = r"""#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image.
set -euo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"
SOURCE="$ROOT/source"
# torch's CPU build (PyPI's default build carries gigabytes of CUDA libraries);
# LABUTILS_TORCH_INDEX="" uses pip's own configured index instead.
TORCH_INDEX="${LABUTILS_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup.sh: labutils needs Python 3.11 or newer, found $("$PYTHON" --version 2>&1);" \
         "choose Gradescope's Ubuntu 24.04 base image, or set PYTHON" >&2
    exit 1
fi
# Ubuntu's python3 has the venv module but not ensurepip without python3-venv, so
# `python3 -m venv --help` succeeds and the venv itself then fails: test ensurepip.
if ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1 && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq python3-venv
fi
"$PYTHON" -m venv "$ROOT/venv"
PIP=("$ROOT/venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
if [ -n "$TORCH_INDEX" ]; then
    "${PIP[@]}" --index-url "$TORCH_INDEX" "torch==$(sed -n 's/^torch==//p' "$SOURCE/requirements.lock")"
fi
"${PIP[@]}" -r "$SOURCE/requirements.lock"
"${PIP[@]}" --no-deps --no-build-isolation "$SOURCE/labutils"
"$ROOT/venv/bin/python" -c "import torch, labutils; print('torch', torch.__version__)"
"""

RUN_AUTOGRADER = r"""#!/usr/bin/env bash
# Gradescope runs this for every submission.
ROOT="${AUTOGRADER_ROOT:-/autograder}"
exec "$ROOT/venv/bin/python" -m labutils.grading.gradescope --root "$ROOT"
"""


def build(lab: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the autograder zip for a lab; returns its path."""
    the_lab = load_lab(lab)   # a broken lab fails here, not on Gradescope
    out = Path(out).resolve()
    if out.suffix != ".zip":
        raise GradingError(f"--out {out.name}: expected a .zip file name (Gradescope takes a zip)")
    source = REPO / "src" / "labutils"
    if not (REPO / "pyproject.toml").is_file() or not (REPO / "requirements.lock").is_file():
        raise GradingError(f"labutils is not installed from the course's folder ({REPO} has "
                           "no pyproject.toml or requirements.lock): build the autograder "
                           "from a clone of the course")
    why = cannot_write(out, folder=False)
    if why:
        raise GradingError(f"--out {out}: cannot write the zip there ({why}); expected a .zip "
                           "in a folder this user can write, e.g. --out autograder.zip")
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        _add(zf, "README.md", readme(the_lab))
        _add(zf, "setup.sh", SETUP_SH, executable=True)
        _add(zf, "run_autograder", RUN_AUTOGRADER, executable=True)
        _add(zf, "requirements.lock", (REPO / "requirements.lock").read_bytes())
        _add(zf, "labutils/pyproject.toml", (REPO / "pyproject.toml").read_bytes())
        _add(zf, "labutils/README.md", (REPO / "README.md").read_bytes())
        for path in sorted(source.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                _add(zf, f"labutils/src/labutils/{path.relative_to(source).as_posix()}",
                     path.read_bytes())
        for rel, data in sorted(the_lab.files.items()):
            _add(zf, f"lab/{rel}", data)
    os.replace(tmp, out)
    return out


# Measured by benchmarks/lab_resources.py (grading on one core) for every lab of the course.
RESOURCES_FILE = "resources.json"
# Gradescope's default container: 0.5 vCPU, 768 MB, a 10-minute limit.
DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT_MIN = 768, 10


def readme(the_lab) -> str:
    """The zip's README.md: what the lab needs of Gradescope's container, from the lab's
    measured figures (labs/resources.json), and how to re-measure them."""
    name = the_lab.folder.name
    measure = f"sudo .venv/bin/python benchmarks/lab_resources.py --labs {name} --write"
    path = the_lab.folder.parent / RESOURCES_FILE
    doc = json.loads(path.read_text()) if path.is_file() else {}
    figures = doc.get("labs", {}).get(name)
    head = (f"# Autograder: {the_lab.title}\n\nUpload this zip as the autograder of a Gradescope "
            "programming assignment (base image: Ubuntu 24.04). setup.sh installs torch (CPU) "
            "and labutils; run_autograder grades each submission with `labutils grade`.\n\n"
            "## What this lab needs\n\n")
    if not figures:
        return head + (f"Not measured yet. In a clone of the course, run `{measure}`, then "
                       "build this zip again.\n")
    rows = [(kind, figures[kind]) for kind in ("solution", "starter") if kind in figures]
    peak = max(f["peak_mb"] for _, f in rows)
    anon = max(f.get("anon_peak_mb", f["peak_mb"]) for _, f in rows)
    wall = max(f["wall_s"] for _, f in rows)
    # 1.5x the memory the kernel cannot drop (anonymous), and no less than everything
    # mapped at the peak (torch's libraries too), in steps of 256 MB
    memory = -(-max(anon * 1.5, peak) // 256) * 256
    minutes = max(5, -(-wall * 3 // 60))             # 3x the slower grading, whole minutes
    table = ["| submission | wall (s) | CPU (s) | peak memory (MB) | of it anonymous (MB) |",
             "| --- | --- | --- | --- | --- |"]
    table += [f"| {'learner copy, unchanged' if kind == 'starter' else kind} | {f['wall_s']:g} | "
              f"{f['cpu_s']:g} | {f['peak_mb']:g} | {f.get('anon_peak_mb', '?')} |" for kind, f in rows]
    return head + "\n".join([
        f"One submission graded on one core ({doc.get('measured', '?')}, {doc.get('machine', '?')}):",
        "", *table, "",
        "Peak memory: the processes' proportional set sizes together (a page that forked "
        "ranks share counted once), sampled every 0.2 s.", "",
        f"- **Memory**: at least {memory:.0f} MB (1.5x the anonymous peak, and no less than the "
        "whole peak). Gradescope's default container "
        f"has {DEFAULT_MEMORY_MB} MB: " + ("enough." if memory <= DEFAULT_MEMORY_MB else
                                           "too little; choose a larger one."),
        f"- **Timeout**: at least {minutes:.0f} minutes (3x the slower grading). The default is "
        f"{DEFAULT_TIMEOUT_MIN}: " + ("enough." if minutes <= DEFAULT_TIMEOUT_MIN else "raise it."),
        "- **CPU**: one core is enough. With less (the default container has half a CPU) "
        "the grader counts the CPUs it has and stretches the lab's hang timeouts and "
        "deadlines to match (2 cores / CPUs): gradings take longer instead of calling a "
        "slow rank hung. The figures above were measured on one core; half a CPU was not "
        "tried.",
        "", f"Measured again with `{measure}` in a clone of the course.", ""])


def _add(zf: zipfile.ZipFile, name: str, data: str | bytes, *, executable: bool = False) -> None:
    info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # same bytes every build
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = ((0o755 if executable else 0o644) | stat.S_IFREG) << 16
    zf.writestr(info, data)


def find_submission(folder: Path, lab: Path) -> Path:
    """The folder that holds the submitted notebook: the upload itself, or the one folder
    below it that holds it (a zipped folder, a repository). Raises GradingError when none
    or several do."""
    if not folder.is_dir() or not any(folder.iterdir()):
        raise GradingError("the submission is empty: upload the lab's notebook and the "
                           "scripts you changed")
    notebook = load_lab(lab).config["notebook"]
    found = sorted(p for p in folder.rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts and "__MACOSX" not in p.parts)
    named = [p for p in found if p.name == notebook]
    chosen = named or found
    if len(chosen) == 1:
        return chosen[0].parent
    shown = ", ".join(str(p.relative_to(folder)) for p in chosen[:5])
    if not chosen:
        raise GradingError(f"no notebook in the submission: upload {notebook} and the scripts "
                           "you changed")
    raise GradingError(f"{len(chosen)} notebooks in the submission ({shown}): upload one "
                       f"{notebook}, with the scripts you changed next to it")


def read_metadata(path: Path) -> dict:
    """Who submitted and whether it was late, from Gradescope's submission_metadata.json
    ({} when it is missing or unreadable: grading does not depend on it)."""
    from datetime import datetime

    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    names = [u.get("name") or u.get("email") or "" for u in meta.get("users") or []]
    late = False
    try:
        created = datetime.fromisoformat(str(meta["created_at"]))
        due = datetime.fromisoformat(str(meta["assignment"]["due_date"]))
        late = created > due
    except (KeyError, TypeError, ValueError):
        pass
    return {"names": [n for n in names if n], "late": late}


def run(root: Path) -> dict:
    """Grade root/submission against root/source/lab; write root/results/results.json."""
    results_path = root / "results" / "results.json"
    lab, submission = root / "source" / "lab", root / "submission"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="labutils-gradescope-") as tmp:
        try:
            folder = find_submission(submission, lab)
            result = grade(lab, [folder], out_dir=Path(tmp), jobs=1, progress=print)[0]
            result["metadata"] = read_metadata(root / "submission_metadata.json")
            data = gradescope_results(result)
        except GradingError as exc:
            try:
                points = max_score(load_lab(lab))
            except GradingError:
                points = 0.0
            data = {"score": 0.0, "max_score": points,
                    "execution_time": round(time.monotonic() - started, 2),
                    "output": f"The submission could not be graded: {exc}",
                    "visibility": "visible", "tests": []}
    write_atomic(results_path, json.dumps(data, indent=2))
    return data


def add_subcommand(sub) -> None:
    """Register ``labutils autograder``; its handler is ns.handler(ns) -> exit status."""
    p = sub.add_parser(
        "autograder", help="build a Gradescope autograder zip for a lab",
        description="Write a Gradescope autograder zip for LAB: setup.sh (a venv with torch "
        "2.13.0 CPU, the pinned packages and labutils), run_autograder (grades "
        "/autograder/submission into /autograder/results/results.json, hidden checks "
        "included) and the lab. Exit status: 0 written, 2 bad input.")
    p.add_argument("lab", help="the lab folder (lab.json, notebook, scripts, checks)")
    p.add_argument("--out", default="autograder.zip", help="the zip to write (default "
                   "./autograder.zip)")

    def handler(ns) -> int:
        path = build(ns.lab, ns.out)
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} kB): upload it as the "
              "assignment's autograder (Gradescope's Ubuntu 24.04 base image)")
        return 0

    p.set_defaults(handler=handler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labutils.grading.gradescope")
    p.add_argument("--root", default=os.environ.get(ROOT_ENV, DEFAULT_ROOT),
                   help=f"the autograder's folder (default ${ROOT_ENV} or {DEFAULT_ROOT})")
    ns = p.parse_args(argv)
    data = run(Path(ns.root))
    print(f"score {data['score']:g}" + (f"/{data['max_score']:g}" if "max_score" in data else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
