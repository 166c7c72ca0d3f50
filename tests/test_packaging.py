"""The three dependency lists agree: pyproject.toml, environment.yml, requirements.lock."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^\s*-?\s*([A-Za-z0-9_.\-]+)==([^\s;#]+)")


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        m = PIN.match(line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        deps += extra
    unpinned = [d for d in deps if "==" not in d]
    assert not unpinned, f"pyproject.toml has unpinned dependencies: {unpinned}"
    return _pins(deps)


def test_torch_is_pinned_to_the_tested_release():
    assert pyproject_pins()["torch"] == "2.13.0"


def test_environment_yml_matches_pyproject():
    env = _pins((REPO / "environment.yml").read_text().splitlines())
    assert env == pyproject_pins()


def test_lock_contains_every_direct_pin():
    lock = _pins((REPO / "requirements.lock").read_text().splitlines())
    for name, version in pyproject_pins().items():
        assert lock.get(name) == version, f"requirements.lock: {name}=={lock.get(name)}, " \
                                          f"pyproject.toml: {name}=={version}"


def test_lock_is_fully_pinned():
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert PIN.match(line), f"unpinned line in requirements.lock: {line}"


def test_environment_yml_installs_the_project_on_a_supported_python():
    text = (REPO / "environment.yml").read_text()
    assert re.search(r"^\s*-\s*-e \.\s*$", text, re.M), "environment.yml must pip-install the project (-e .)"
    python = re.search(r"^\s*-\s*python=(\d+)\.(\d+)\s*$", text, re.M)
    assert python, "environment.yml must pin python=X.Y"
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = tuple(int(x) for x in requires.removeprefix(">=").split("."))
    assert (int(python.group(1)), int(python.group(2))) >= minimum, \
        f"environment.yml's python={python.group(1)}.{python.group(2)} is below requires-python {requires}"


def test_make_test_gpu_uses_the_machines_python_and_says_what_it_lacks(tmp_path):
    """`make test-gpu` needs no venv (a GPU machine has its own CUDA torch): it never runs
    the set-up, and a Python without torch is one line saying what to do."""
    import subprocess

    dry = subprocess.run(["make", "-n", "test-gpu"], cwd=REPO, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert ".venv" not in dry.stdout and "pip" not in dry.stdout, dry.stdout
    assert "-m gpu tests/test_gpu.py" in dry.stdout and "-rs" in dry.stdout
    missing = subprocess.run(["make", "test-gpu", f"GPU_PYTHON={tmp_path / 'no-python'}"], cwd=REPO,
                             capture_output=True, text=True)
    assert missing.returncode != 0
    lines = [line for line in missing.stderr.splitlines() if not re.match(r"make(\[\d+\])?:", line)]
    assert len(lines) == 1 and "install a CUDA build of torch" in lines[0], missing.stderr


def test_every_locked_package_installs_on_the_oldest_python_requires_python_admits():
    """requires-python is the promise: `make lab` with Debian bookworm's python3 (3.11.2)
    must install the lock. Read from the packages installed here (their Requires-Python)."""
    from importlib.metadata import distributions

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    oldest = Version(requires.removeprefix(">=") + ".0")
    lock = _pins((REPO / "requirements.lock").read_text().splitlines())
    refused = []
    for dist in distributions():
        name = dist.metadata["Name"].lower().replace("_", "-")
        needs = dist.metadata.get("Requires-Python")
        if lock.get(name) == dist.version and needs and oldest not in SpecifierSet(needs):
            refused.append(f"{name}=={dist.version} needs Python {needs}")
    assert not refused, f"requires-python {requires}, yet: {refused}"


def test_the_lock_is_consistent_and_keeps_nbformat_quick_to_import():
    """Every installed requirement of every locked package is met (pip check), and the
    lock holds no rfc3987-syntax: jsonschema 4.24 and later validate IRIs with it when it
    is installed, and building its grammar at import costs about 1 CPU-second in every
    process that imports nbformat (papermill, nbclient, the grader's supervisor: the
    test suite starts hundreds). jsonschema stays at 4.23, where format-nongpl does not
    ask for it."""
    import subprocess
    import sys

    lock = _pins((REPO / "requirements.lock").read_text().splitlines())
    assert "rfc3987-syntax" not in lock and "lark" not in lock
    major, minor, *_ = (int(part) for part in lock["jsonschema"].split("."))
    assert (major, minor) < (4, 24), lock["jsonschema"]
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
