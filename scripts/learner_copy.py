"""Write the course as learners get it: the build context of the learner image and the
folder `make lab-learner` opens.

    python scripts/learner_copy.py build/learner

OUT (a new or empty folder) receives:
- lessons/: the notebooks and their scripts (no run folders or caches);
- labs/<lab>/: every lab as `labutils release --no-verify` writes it: no hidden checks,
  no wrong-fix catalogue, no "starter_fails" in lab.json (the suite verifies releases by
  grading them: tests/grading/test_grading_labs.py);
- what installs the course: src/, pyproject.toml, requirements.lock, README.md, docker/,
  .dockerignore;
- learner-copy.json: what it holds and what it leaves out. The Dockerfiles copy it, so
  an image cannot be built from the instructor's repository by mistake.

No solutions/, tests/ or benchmarks/. Before it returns, the copy is searched for what a
learner must not get; any find is an error and the copy is removed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MANIFEST = "learner-copy.json"
INSTALL = ("src", "pyproject.toml", "requirements.lock", "README.md", "docker", ".dockerignore")
SKIP = ("runs", "__pycache__", ".ipynb_checkpoints", "checkpoints", "*.egg-info")
# What the instructor keeps: file names never in a learner's copy, and lab.json keys.
INSTRUCTOR_FILES = ("hidden_checks.py", "wrong_fixes.py")
INSTRUCTOR_FOLDERS = ("solutions", "tests", "benchmarks")


def write(out: Path) -> dict:
    from labutils.grading.release import INSTRUCTOR_KEYS, release

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"learner_copy.py: {out}: expected a new or empty folder; remove it "
                         "or name another")
    out.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns(*SKIP)
    shutil.copytree(REPO / "lessons", out / "lessons", ignore=ignore)
    for name in INSTALL:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, out / name, ignore=ignore)
        else:
            shutil.copy2(source, out / name)
    labs = sorted(p.parent.name for p in (REPO / "labs").glob("*/lab.json"))
    for lab in labs:
        release(REPO / "labs" / lab, out / "labs" / lab, verify=False, progress=None)
    manifest = {"lessons": sorted(p.name for p in (out / "lessons").glob("*.ipynb")), "labs": labs,
                "left_out": [*INSTRUCTOR_FILES, *(f"{d}/" for d in INSTRUCTOR_FOLDERS),
                             *(f"lab.json: {key}" for key in INSTRUCTOR_KEYS)]}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    problems = instructor_material(out)
    if problems:
        shutil.rmtree(out)
        raise SystemExit("learner_copy.py: the copy held instructor material: " + "; ".join(problems))
    return manifest


def instructor_material(root: Path) -> list[str]:
    """What in ``root`` a learner must not get (empty when nothing)."""
    from labutils.grading.release import INSTRUCTOR_KEYS

    found = [str(p.relative_to(root)) for name in INSTRUCTOR_FILES for p in root.rglob(name)]
    found += [f"{d}/" for d in INSTRUCTOR_FOLDERS if (root / d).exists()]
    for config in root.glob("labs/*/lab.json"):
        keys = set(json.loads(config.read_text())) & set(INSTRUCTOR_KEYS)
        found += [f"{config.relative_to(root)}: {key}" for key in sorted(keys)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a new or empty folder")
    args = parser.parse_args(argv)
    manifest = write(args.out)
    print(f"learner copy in {args.out}: {len(manifest['lessons'])} lesson notebooks, "
          f"{len(manifest['labs'])} labs released; left out: {', '.join(manifest['left_out'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
