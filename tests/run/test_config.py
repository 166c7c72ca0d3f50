"""Every bad launch request fails with one clear line before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import SCRIPTS

from labutils import LaunchConfigError, ScriptSyntaxError, launch
from labutils.run.spec import MAX_NPROC, WORKER_PATH


@pytest.fixture
def ok_script(write_script):
    return write_script("ok.py", "print('hi')\n")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"nproc": 0}, "nproc: expected a whole number of ranks >= 1, got 0"),
        ({"nproc": -2}, "got -2"),
        ({"nproc": MAX_NPROC + 1}, f"at most {MAX_NPROC} ranks"),
        ({"nproc": 10_000}, "at most"),
        ({"nproc": True}, "nproc"),
        ({"nproc": "4"}, "got '4'"),
        ({"nproc": 2.0}, "got 2.0"),
        ({"backend": "mpi"}, "backend: expected 'auto', 'gloo' or 'nccl', got 'mpi'"),
        ({"backend": "nccl"}, "nccl with 0 GPU(s)"),
        ({"args": "--epochs 2"}, "split it, e.g. args=['--epochs', '2']"),
        ({"args": 5}, "args: expected a list of strings"),
        ({"hang_timeout": -1}, "hang_timeout"),
        ({"hang_timeout": "30"}, "hang_timeout"),
        ({"timeout": 0}, "timeout"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"env": {"A": 1}}, "env: expected a dict of str to str"),
        ({"env": {"": "x"}}, "env: expected variable names without '='"),  # a failed run before
        ({"env": {"A=B": "x"}}, "got 'A=B'"),
        # torchrun replaces what it sets for each rank: the value would vanish silently
        ({"env": {"WORLD_SIZE": "8"}}, "torchrun sets WORLD_SIZE for each rank and would replace it"),
        ({"env": {"MASTER_PORT": "29500"}}, "got 'MASTER_PORT'"),
        ({"args": ["--resume", None]}, "args: expected a list of strings (numbers and paths are "
         "turned into strings), got None"),  # the script saw "None"
        ({"args": ["--fast", True]}, "got True"),
        ({"log_dir": 3}, "log_dir: expected a folder (a str or a Path) or None, got 3"),
        ({"display": "fancy"}, "display: expected auto | widgets | text"),
        ({"fault": {"rank": 5, "step": 1}, "max_restarts": 1}, "fault rank: expected a rank in 0..1"),
        ({"fault": {"rank": 0, "step": -1}, "max_restarts": 1}, "fault step"),
        ({"fault": {"rank": 0, "step": 1}}, "max_restarts >= 1"),
        ({"fault": {"rank": 0}}, "fault: expected a dict with 'rank' and 'step'"),
    ],
)
def test_bad_arguments(ok_script, runs_dir, kwargs, fragment):
    kwargs = {"nproc": 2, **kwargs}
    nproc = kwargs.pop("nproc")
    with pytest.raises(LaunchConfigError) as info:
        launch(ok_script, nproc, **kwargs)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message
    assert not runs_dir.exists(), "a run folder was created for a rejected request"


def test_missing_script(runs_dir, tmp_path):
    with pytest.raises(LaunchConfigError, match="script: expected an existing file, got 'nope.py'"):
        launch("nope.py", 2)
    assert not runs_dir.exists()


@pytest.mark.parametrize("name", ["train.txt", "train"])
def test_not_a_python_file(write_script, runs_dir, name):
    path = write_script(name, "print(1)\n")
    with pytest.raises(LaunchConfigError, match="expected a Python file ending in .py"):
        launch(path, 2)


def test_directory_is_not_a_script(tmp_path, runs_dir):
    (tmp_path / "pkg.py").mkdir()
    with pytest.raises(LaunchConfigError, match="Python file"):
        launch(tmp_path / "pkg.py", 2)


def test_syntax_error_names_file_and_line(write_script, runs_dir):
    path = write_script("broken.py", "import os\n\ndef f(:\n    pass\n")
    with pytest.raises(ScriptSyntaxError) as info:
        launch(path, 2)
    assert info.value.line == 3
    assert f"{path}:3" in str(info.value)
    assert "no rank was started" in str(info.value)
    assert not runs_dir.exists()


@pytest.mark.parametrize(("name", "module"), [
    ("profile.py", "the module profile, which torch imports"),  # torch._dynamo imports it
    ("torch.py", "the torch package"),
    ("queue.py", "the module queue, which torch imports"),
    ("email/__init__.py", "the module email, which torch imports"),  # a package
])
@pytest.mark.parametrize("warm", [True, False])
def test_a_file_named_like_a_module_torch_imports_is_refused(ok_script, runs_dir, name, module, warm):
    """Under torchrun, and in a cold start, `import torch` in a rank would load the
    learner's file instead; a warm rank, forked with torch imported, never sees it: the
    run worked warm and failed cold. Refused first, the same either way."""
    shadow = ok_script.parent / name
    shadow.parent.mkdir(exist_ok=True)
    shadow.write_text("x = 1\n")
    with pytest.raises(LaunchConfigError) as info:
        launch(ok_script, 2, warm=warm)
    given = shadow if shadow.name.endswith(".py") and shadow.parent == ok_script.parent else shadow.parent
    assert str(info.value) == (
        f"the script's folder: expected no file named like a module torch imports, got "
        f"'{given}'; rename it (e.g. my_{given.name}): a rank's `import torch` would load it "
        f"in place of {module} (under torchrun too)")
    assert not runs_dir.exists()


def test_a_folder_without_init_and_other_names_are_no_module_of_torchs(ok_script, runs_dir):
    """A folder with no __init__.py named like a module is no package that hides it, and
    a learner's test.py or data.py hides nothing torch imports."""
    from labutils.run.checks import check_no_shadowing

    (ok_script.parent / "email").mkdir()
    for name in ("test.py", "data.py", "model.py", "my_profile.py"):
        (ok_script.parent / name).write_text("x = 1\n")
    check_no_shadowing(ok_script)


def test_the_current_folder_is_checked_too(write_script, runs_dir, tmp_path, monkeypatch):
    """`python -m` puts the current folder first on the path of the agent and the warm
    server: a random.py there broke them before any rank started."""
    (tmp_path / "sub").mkdir()
    script = write_script("sub/ok.py", "print(1)\n")
    (tmp_path / "random.py").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchConfigError, match=r"^the current folder: .*random\.py'; rename it "
                       r"\(e\.g\. my_random\.py\): the launcher's processes, started here"):
        launch(script, 2)


def test_a_deleted_current_folder_holds_nothing_to_refuse(ok_script, tmp_path, monkeypatch):
    from labutils.run.checks import check_no_shadowing

    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    check_no_shadowing(ok_script.resolve())


def test_the_list_is_what_a_rank_imports():
    """TORCH_IMPORTS against the modules a rank has loaded after torch, torch._dynamo and
    the bootstrap, in a fresh interpreter of this installation: none missing (else a
    file of that name would go unrefused), and with torch 2.13 none extra."""
    import importlib.machinery
    import json
    import subprocess
    import sys

    import torch

    from labutils.run.checks import TORCH_IMPORTS

    code = ("import sys, json, labutils.runtime.server, labutils.runtime.worker, "
            "labutils.runtime.agent, torch, torch._dynamo, torch.distributed.run, torch.nn.parallel; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True, cwd="/").stdout)
    replaceable = {n for n in loaded if not n.startswith("_") and n not in sys.builtin_module_names
                   and importlib.machinery.FrozenImporter.find_spec(n) is None
                   and n not in ("encodings", "cython_runtime", "labutils")}
    assert sorted(replaceable - TORCH_IMPORTS) == [], "torch imports these: add them to TORCH_IMPORTS"
    if torch.__version__.startswith("2.13."):
        assert sorted(TORCH_IMPORTS - replaceable) == [], "torch 2.13 no longer imports these"


def test_random_fault_step_is_reproducible():
    from labutils.run.spec import check_fault

    a = check_fault({"rank": 1, "step": (3, 9), "seed": 7}, 2, 1)
    b = check_fault({"rank": 1, "step": (3, 9), "seed": 7}, 2, 1)
    assert a == b and 3 <= a["step"] <= 9


def test_prepare_says_what_will_start_before_anything_starts(tmp_path):
    from labutils.run.launcher import prepare

    run = prepare(SCRIPTS / "hello.py", 2, log_dir=tmp_path,
                  display="none", env={"MY_SETTING": "1"}, max_restarts=1)
    request = run.request
    assert request.run_dir.is_dir() and not any(request.run_dir.iterdir())  # nothing ran
    assert len(request.commands) == 1
    command = request.commands[0]
    assert command[1:3] == ["-m", "labutils.runtime.agent"] and "--max-restarts" in command
    script = str(SCRIPTS / "hello.py")
    # warm (the default): torchrun's function entry point runs the worker bootstrap by path
    assert command[-5:] == ["--run-path", "--start-method", "fork", WORKER_PATH, script]
    cold = prepare(script, 2, log_dir=tmp_path, display="none", warm=False).request
    assert cold.commands[0][-3:] == ["-m", "labutils.runtime.worker", script]
    assert str(cold).splitlines()[1] == "start: cold (warm=False)"
    assert request.env["MY_SETTING"] == "1"
    assert request.env["LABUTILS_RUN_DIR"] == str(request.run_dir)
    text = str(request)
    assert text.splitlines()[:2] == [f"run folder: {request.run_dir}", "start: warm"]
    assert "agent 0: " in text and "MY_SETTING=1" in text


def test_numbers_and_paths_in_args_become_strings(ok_script):
    from labutils.run.spec import make_spec

    assert make_spec(ok_script, 2, args=[3, 0.5, Path("data") / "x.pt", "--flag"]).args == \
        ["3", "0.5", "data/x.pt", "--flag"]
    assert make_spec(ok_script, 2, args=(w for w in ["--steps", "2"])).args == ["--steps", "2"]
