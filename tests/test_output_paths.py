"""Where a command writes (launch()'s log_dir, every --out): a path it cannot write is a
one-line error that says so and how to go on, before anything runs (it was a traceback
from mkdir for `labutils release` and `labutils autograder`, and launch()'s
NotADirectoryError)."""

from __future__ import annotations

import pytest

from helpers import REPO, SCRIPTS
from labutils import launch
from labutils.cli import main
from labutils.errors import LaunchConfigError, cannot_write
from labutils.runtime.runfiles import write_atomic

LAB = str(REPO / "labs" / "01_data_sharding")
HELLO = str(SCRIPTS / "hello.py")


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a folder\n")
    return path


def test_cannot_write_says_why(tmp_path, a_file):
    assert cannot_write(tmp_path / "new" / "deeper") is None and (tmp_path / "new" / "deeper").is_dir()
    assert cannot_write(tmp_path / "made" / "out.zip", folder=False) is None
    assert (tmp_path / "made").is_dir() and not (tmp_path / "made" / "out.zip").exists()
    assert cannot_write(a_file / "x") == f"{a_file} is a file"
    assert cannot_write(a_file) == f"{a_file} is a file"
    assert cannot_write(a_file / "x" / "y.csv", folder=False) == f"{a_file} is a file"
    assert cannot_write(tmp_path, folder=False) == "a folder is there"


@pytest.mark.parametrize("words, said", [
    (["launch", "--log-dir", "{f}", HELLO],
     "labutils launch: --log-dir: expected a folder the run's logs can be written into, got "
     "'{f} ({f} is a file)'; pass a folder this process can write into"),
    (["launch", "--json", "{f}/summary.json", HELLO],
     "labutils launch: --json: expected a file in a folder this user can write, got "
     "'{f}/summary.json ({f} is a file)'; pass e.g. --json summary.json, or leave it out"),
    (["launch", "--json", "{d}", HELLO],
     "labutils launch: --json: expected a file in a folder this user can write, got "
     "'{d} (a folder is there)'; pass e.g. --json summary.json, or leave it out"),
    (["grade", LAB, LAB, "--out", "{f}/grades"],
     "labutils grade: --out {f}/grades: cannot write there ({f} is a file); expected a folder "
     "this user can write, e.g. --out grades"),
    (["release", "--out", "{f}/copy", LAB],
     "labutils release: --out {f}/copy: cannot write there ({f} is a file); expected a new or "
     "empty folder this user can write"),
    (["autograder", "--out", "{f}/a.zip", LAB],
     "labutils autograder: --out {f}/a.zip: cannot write the zip there ({f} is a file); "
     "expected a .zip in a folder this user can write, e.g. --out autograder.zip"),
    (["slurm", "--nodes", "2", "--nproc", "2", "--out", "{f}/job.sbatch", HELLO],
     "labutils slurm: --out: expected a file in a folder this user can write, got "
     "'{f}/job.sbatch ({f} is a file)'; pass another --out, or leave it out to print it"),
    (["k8s", "--nnodes", "2", "-n", "2", "--image", "course:1", "--out", "{f}/job.yaml", HELLO],
     "labutils k8s: --out: expected a file in a folder this user can write, got "
     "'{f}/job.yaml ({f} is a file)'; pass another --out, or leave it out to print it"),
])
def test_a_path_no_command_can_write_is_one_line(words, said, a_file, tmp_path, capsys):
    def fill(text: str) -> str:
        return text.replace("{f}", str(a_file)).replace("{d}", str(tmp_path))

    assert main([fill(w) for w in words]) == 2
    assert capsys.readouterr().err.splitlines() == [fill(said)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [a_file.name]  # nothing ran


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path):
    (tmp_path / "summary.json").mkdir()   # the rename onto a folder fails
    with pytest.raises(IsADirectoryError):
        write_atomic(tmp_path / "summary.json", "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_launch_says_which_setting_named_the_folder(a_file, monkeypatch, tmp_path):
    with pytest.raises(LaunchConfigError, match=r"^log_dir: expected a folder .*is a file\)'; "
                       "pass a folder this process can write into$"):
        launch(HELLO, 2, log_dir=a_file / "runs", display="none")
    monkeypatch.setenv("LABUTILS_RUNS_DIR", str(a_file / "runs"))
    with pytest.raises(LaunchConfigError, match="^LABUTILS_RUNS_DIR: .*; set LABUTILS_RUNS_DIR to"):
        launch(HELLO, 2, display="none")
    monkeypatch.delenv("LABUTILS_RUNS_DIR")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("a file where ./runs would go\n")
    with pytest.raises(LaunchConfigError, match=r"^log_dir: .*'runs \(.*runs is a file\)'; pass log_dir=, or run"):
        launch(HELLO, 2, display="none")
