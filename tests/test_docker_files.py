"""docker/: the images and the compose file agree with the project and with each other.

No Docker engine runs on the project's machines, so nothing here builds an image. What is
checked instead: versions (torch, Python, the lock) equal the project's pins, every COPY
source exists and is in the build context, the entrypoint and the install script do what
the Dockerfiles rely on (run for real with stand-ins for python and jupyter), the ports
agree, the user is not root, and the compose file's node commands are one 2-node job
that the labutils CLI parses.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from labutils.cluster.kubernetes import CONTAINER_COURSE_DIR

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
TORCH_INDEX = {"Dockerfile.cpu": r"https://download\.pytorch\.org/whl/cpu",
               "Dockerfile.cuda": r"https://download\.pytorch\.org/whl/cu\d{3}"}


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in (DOCKER / name).read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        keyword, _, rest = (pending + text).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{name} ends inside a continued line"
    return out


def values(name: str, keyword: str) -> list[str]:
    return [rest for kw, rest in instructions(name) if kw == keyword]


def build_args(name: str) -> dict[str, str | None]:
    """ARG NAME=default, and None for an ARG with no default (set only when passed)."""
    return {rest.split("=", 1)[0]: rest.split("=", 1)[1] if "=" in rest else None
            for rest in values(name, "ARG")}


def env_vars(name: str) -> dict[str, str]:
    return dict(item.split("=", 1) for rest in values(name, "ENV") for item in shlex.split(rest))


def copies(name: str) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY."""
    out = []
    for rest in values(name, "COPY"):
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        out.append((parts[:-1], parts[-1]))
    return out


def dockerignored(path: str) -> bool:
    """Whether .dockerignore leaves path (relative to the repository) out of the build context."""
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "exceptions (!) are not modelled here"
    parts = path.split("/")
    for end in range(1, len(parts) + 1):
        prefix = "/".join(parts[:end])
        for pattern in patterns:
            if fnmatch.fnmatchcase(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(parts[end - 1], pattern[3:]):
                return True
    return False


def pyproject_pin(package: str) -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d.split("==")[1] for d in deps if d.split("==")[0].lower() == package)


def lock_pin(package: str) -> str:
    for line in (REPO / "requirements.lock").read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip().lower() == package:
            return version.strip()
    raise AssertionError(f"requirements.lock does not pin {package}")


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def interpolate(text: str, **variables: str) -> str:
    """Compose's ${VAR:-default}, with the given variables set and the rest unset."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: variables.get(m.group(1), m.group(2)), text)


def stand_in(folder: Path, name: str) -> Path:
    """An executable `name` that records each call as one tab-separated line in folder/calls.txt."""
    program = folder / name
    program.write_text(f'#!/bin/sh\nprintf "%s\\t" {name} "$@" >> "{folder}/calls.txt"\n'
                       f'printf "\\n" >> "{folder}/calls.txt"\n')
    program.chmod(0o755)
    return program


def calls(folder: Path) -> list[list[str]]:
    return [line.rstrip("\t").split("\t") for line in (folder / "calls.txt").read_text().splitlines()]


# ---- the images ------------------------------------------------------------------------

@pytest.mark.parametrize("name", DOCKERFILES)
def test_torch_is_the_locked_release(name):
    assert build_args(name)["TORCH_VERSION"] == pyproject_pin("torch") == lock_pin("torch") == "2.13.0"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_torch_comes_from_pytorchs_index_for_the_variant(name):
    assert re.fullmatch(TORCH_INDEX[name], build_args(name)["TORCH_INDEX_URL"])


@pytest.mark.parametrize("name", DOCKERFILES)
def test_python_is_the_one_environment_yml_names(name):
    assert values(name, "FROM") == ["${BASE}"]
    image_python = re.fullmatch(r"python:(\d+\.\d+)-slim-bookworm", build_args(name)["BASE"]).group(1)
    environment = (REPO / "environment.yml").read_text()
    conda_python = re.search(r"^\s*-\s*python=(\d+\.\d+)\s*$", environment, re.M)
    assert image_python == conda_python.group(1)  # tests/test_packaging.py checks it against pyproject


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_the_non_root_learner(name):
    steps = instructions(name)
    users = [(i, rest) for i, (kw, rest) in enumerate(steps) if kw == "USER"]
    assert users, f"{name} has no USER: the container would run as root"
    index, user = users[-1]
    assert user.split(":")[0] not in ("root", "0")
    entrypoint = next(i for i, (kw, _) in enumerate(steps) if kw == "ENTRYPOINT")
    assert index < entrypoint
    (useradd,) = [rest for kw, rest in steps if kw == "RUN" and "useradd" in rest]
    assert f"--uid {user.split(':')[0]}" in useradd  # USER's uid is the learner made here


@pytest.mark.parametrize("name", DOCKERFILES)
def test_course_folder_is_the_one_manifests_use(name):
    assert values(name, "WORKDIR") == [CONTAINER_COURSE_DIR]


@pytest.fixture(scope="module")
def learner_copy(tmp_path_factory):
    """The images' build context: scripts/learner_copy.py's output."""
    out = tmp_path_factory.mktemp("context") / "learner"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "learner_copy.py"), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copy_source_exists_in_the_learner_copy_and_not_all_in_the_repository(name, learner_copy):
    for sources, _ in copies(name):
        for source in sources:
            assert (learner_copy / source).exists(), f"{name}: COPY {source}: not in the learner copy"
            assert not dockerignored(source), f"{name}: COPY {source}: left out by .dockerignore"
    # The manifest is copied: a build from the repository (instructor material) fails.
    assert "learner-copy.json" in {s for sources, _ in copies(name) for s in sources}
    assert not (REPO / "learner-copy.json").exists()


def test_the_learner_copy_holds_no_hidden_check_wrong_fix_solution_or_starter_fails(learner_copy):
    names = {p.name for p in learner_copy.rglob("*")}
    assert not names & {"hidden_checks.py", "wrong_fixes.py"}
    assert not any((learner_copy / d).exists() for d in ("solutions", "tests", "benchmarks"))
    labs = sorted(learner_copy.glob("labs/*/lab.json"))
    assert len(labs) == len(list(REPO.glob("labs/*/lab.json"))) == 12
    for config in labs:
        public = json.loads(config.read_text())
        assert "starter_fails" not in public and public["hidden_checks"]["count"] >= 1
        for edited in public["edit"]:  # the starter, as in the repository: not a solution
            assert (config.parent / edited).read_bytes() == (REPO / "labs" / config.parent.name / edited).read_bytes()
    manifest = json.loads((learner_copy / "learner-copy.json").read_text())
    assert manifest["labs"] == [c.parent.name for c in labs]
    assert "lessons/index.ipynb" not in manifest["left_out"]
    assert (learner_copy / "lessons" / "index.ipynb").is_file()
    assert not list(learner_copy.rglob("runs")) and not list(learner_copy.rglob("__pycache__"))


def test_a_learner_copy_with_instructor_material_is_refused(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import learner_copy as module
    finally:
        sys.path.remove(str(REPO / "scripts"))
    out = tmp_path / "copy"
    # as if the README were the instructor's: the copy holds it, so the copy is refused
    monkeypatch.setattr(module, "INSTRUCTOR_FILES", (*module.INSTRUCTOR_FILES, "README.md"))
    with pytest.raises(SystemExit, match="held instructor material: .*README.md"):
        module.write(out)
    assert not out.exists()  # removed, not left half-made


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_lock_and_the_install_script_are_copied_before_the_install(name):
    steps = instructions(name)
    copied = {s for sources, _ in copies(name) for s in sources}
    assert {"requirements.lock", "pyproject.toml", "src", "docker/install-packages.sh"} <= copied
    install = next(i for i, (kw, rest) in enumerate(steps)
                   if kw == "RUN" and "install-packages.sh" in rest)
    for source in ("requirements.lock", "pyproject.toml", "src", "docker/install-packages.sh"):
        at = next(i for i, (kw, rest) in enumerate(steps)
                  if kw == "COPY" and source in shlex.split(rest))
        assert at < install


def test_cuda_image_differs_only_in_the_torch_index_and_nvidia_variables():
    def comparable(name):
        out = []
        for kw, rest in instructions(name):
            if kw == "ARG" and rest.startswith("TORCH_INDEX_URL="):
                continue
            if kw == "ENV":
                rest = " ".join(item for item in shlex.split(rest) if not item.startswith("NVIDIA_"))
            out.append((kw, rest))
        return out

    assert comparable("Dockerfile.cpu") == comparable("Dockerfile.cuda")
    assert env_vars("Dockerfile.cuda")["NVIDIA_VISIBLE_DEVICES"] == "all"


def test_install_script_installs_torch_then_the_lock_then_the_project(tmp_path):
    (tmp_path / "requirements.lock").write_text((REPO / "requirements.lock").read_text())
    stand_in(tmp_path, "python")
    index = build_args("Dockerfile.cpu")["TORCH_INDEX_URL"]
    done = subprocess.run(
        ["sh", str(DOCKER / "install-packages.sh")], cwd=tmp_path, capture_output=True, text=True,
        timeout=30, env={"PATH": f"{tmp_path}:/usr/bin:/bin", "TORCH_VERSION": "2.13.0",
                         "TORCH_INDEX_URL": index})
    assert done.returncode == 0, done.stderr
    made = calls(tmp_path)
    assert made[:3] == [["python", "-m", "pip", "install", "--index-url", index, "torch==2.13.0"],
                        ["python", "-m", "pip", "install", "-r", "requirements.lock"],
                        ["python", "-m", "pip", "install", "--no-deps", "."]]
    assert made[3][:2] == ["python", "-c"] and "import torch, labutils" in made[3][2]


def test_install_script_refuses_a_torch_other_than_the_locks(tmp_path):
    (tmp_path / "requirements.lock").write_text("torch==2.13.0\n")
    stand_in(tmp_path, "python")
    done = subprocess.run(
        ["sh", str(DOCKER / "install-packages.sh")], cwd=tmp_path, capture_output=True, text=True,
        timeout=30, env={"PATH": f"{tmp_path}:/usr/bin:/bin", "TORCH_VERSION": "2.12.0",
                         "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"})
    assert done.returncode == 1
    assert "requirements.lock pins torch==2.13.0" in done.stderr
    assert not (tmp_path / "calls.txt").exists()


def run_entrypoint(tmp_path, *args: str) -> list[str]:
    stand_in(tmp_path, "jupyter")
    done = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), *args], capture_output=True, text=True,
                          timeout=30, env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (call,) = calls(tmp_path)
    return call


def test_entrypoint_starts_jupyterlab_on_the_exposed_port_and_the_course(tmp_path):
    call = run_entrypoint(tmp_path)
    assert call[:3] == ["jupyter", "lab", "--no-browser"]
    assert "--ip=0.0.0.0" in call  # reachable from outside the container
    port = next(a.split("=")[1] for a in call if a.startswith("--ServerApp.port="))
    for name in DOCKERFILES:
        assert values(name, "EXPOSE") == [port]
        assert values(name, "ENTRYPOINT") == ['["entrypoint.sh"]']
    root = next(a.split("=")[1] for a in call if a.startswith("--ServerApp.root_dir="))
    assert root == CONTAINER_COURSE_DIR
    opened = call[-1]
    assert opened.startswith("lessons/") and (REPO / opened).is_file() and not dockerignored(opened)


def test_entrypoint_runs_a_given_command_instead(tmp_path):
    assert run_entrypoint(tmp_path, "jupyter", "--version") == ["jupyter", "--version"]


@pytest.mark.parametrize("script", ["entrypoint.sh", "install-packages.sh"])
def test_scripts_are_executable_posix_sh(script):
    path = DOCKER / script
    assert os.access(path, os.X_OK)
    assert path.read_text().startswith("#!/bin/sh\n")
    assert subprocess.run(["sh", "-n", str(path)], capture_output=True, timeout=10).returncode == 0


def test_dockerignore_keeps_local_and_generated_files_out():
    for path in (".venv", ".git", "runs", "lessons/runs", "lessons/03_bucketing_and_overlap/__pycache__",
                 "src/labutils.egg-info", "test-artifacts"):
        assert dockerignored(path), path
    for path in ("src/labutils/run/cli.py", "lessons/index.ipynb", "labs/README.md", "requirements.lock"):
        assert not dockerignored(path), path


# ---- the compose file ------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_compose_builds_the_course_images(variant):
    services = compose()["services"]
    assert set(services) == {"lab", "node0", "node1"}
    for service in services.values():
        build = service["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == REPO
        dockerfile = context / interpolate(build["dockerfile"], COURSE_VARIANT=variant)
        assert dockerfile.name == f"Dockerfile.{variant}" and dockerfile.is_file()
        assert interpolate(service["image"], COURSE_VARIANT=variant) == f"dist-course:{variant}"
        assert service["init"] is True


def test_compose_lab_publishes_the_entrypoint_port_on_localhost(tmp_path):
    call = run_entrypoint(tmp_path)
    port = next(a.split("=")[1] for a in call if a.startswith("--ServerApp.port="))
    lab = compose()["services"]["lab"]
    assert "command" not in lab  # the entrypoint's default: JupyterLab
    (published,) = lab["ports"]
    host_ip, host_port, container_port = published.split(":")
    assert container_port == port and host_ip == "127.0.0.1"


def test_compose_services_share_the_runs_volume():
    spec = compose()
    assert "runs" in spec["volumes"]
    for service in spec["services"].values():
        assert f"runs:{CONTAINER_COURSE_DIR}/runs" in service["volumes"]


def node_commands() -> dict[str, list[str]]:
    services = compose()["services"]
    return {name: [str(a) for a in service["command"]]
            for name, service in services.items() if name.startswith("node")}


def test_compose_nodes_run_a_real_lesson_script_the_image_holds():
    copied = {s for sources, _ in copies("Dockerfile.cpu") for s in sources}
    for name, command in node_commands().items():
        assert command[:2] == ["labutils", "launch"]
        script = next(a for a in command if a.endswith(".py"))
        assert (REPO / script).is_file() and script.split("/")[0] in copied, f"{name}: {script}"
        assert "from labutils.dist import init" in (REPO / script).read_text()


def test_compose_nodes_form_one_two_node_job():
    from labutils.cli import build_parser

    parser = build_parser()
    launch = parser._subparsers._group_actions[0].choices["launch"]
    missing = [flag for flag in ("--node-rank", "--rdzv-endpoint", "--rdzv-id")
               if flag not in launch._option_string_actions]
    if missing:
        pytest.skip(f"labutils launch has no {', '.join(missing)} yet (the lead's multi-node flags); "
                    "the compose node commands are checked once they land")
    services = compose()["services"]
    parsed = {}
    for name, command in node_commands().items():
        cut = command.index("--") if "--" in command else len(command)
        parsed[name] = parser.parse_args(command[1:cut])
    assert len(parsed) == 2
    ranks = {name: int(ns.node_rank) for name, ns in parsed.items()}
    assert sorted(ranks.values()) == [0, 1]
    for name, ns in parsed.items():
        assert ns.command == "launch" and str(ns.nnodes) == str(len(parsed))
        assert ns.nproc * len(parsed) <= 4  # the course's machines: at most 4 ranks
        host, _, port = ns.rdzv_endpoint.partition(":")
        rank0 = next(n for n, r in ranks.items() if r == 0)
        assert host == services[rank0]["hostname"] and port.isdigit()  # the store lives on node 0
        assert ns.log_dir == f"{CONTAINER_COURSE_DIR}/runs"  # the shared volume
    assert len({(ns.rdzv_endpoint, ns.rdzv_id, ns.nproc, ns.script) for ns in parsed.values()}) == 1
    assert services["node1"]["depends_on"] == ["node0"]
