"""labutils.cluster.kubernetes: the PyTorchJob manifest, read the way the operator and torchrun read it.

No cluster runs here. Each pod's command is checked as it would run: the environment the
Kubeflow training operator injects (see the module docstring) is simulated per pod, the
command's $(VAR) references are expanded as the kubelet does, and the result is parsed by
torchrun's own argument parser and turned into its LaunchConfig.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO
import yaml

from labutils.cli import main
from labutils.errors import InputError
from labutils.cluster.kubernetes import (CONTAINER_COURSE_DIR, RENDEZVOUS_PORT, add_subcommand, pytorchjob,
                                 to_yaml)

SCRIPT = "lessons/00_first_distributed_run/first_allreduce.py"
IMAGE = "ghcr.io/example/dist-course:cpu"


def job(**kwargs) -> dict:
    kwargs = {"nnodes": 3, "nproc": 2, "image": IMAGE, "root": REPO, **kwargs}
    return pytorchjob(REPO / SCRIPT, **kwargs)


def pods(manifest: dict):
    """(role, index, container) for every pod the operator would create."""
    for role, spec in manifest["spec"]["pytorchReplicaSpecs"].items():
        for index in range(spec["replicas"]):
            yield role, index, spec["template"]["spec"]["containers"][0]


def operator_env(manifest: dict, role: str, index: int, container: dict) -> dict[str, str]:
    """The variables the training operator (v1.7+) sets in this pod, plus the container's own."""
    name, spec = manifest["metadata"]["name"], manifest["spec"]
    replicas = {r: s["replicas"] for r, s in spec["pytorchReplicaSpecs"].items()}
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port")
    env = {"PYTHONUNBUFFERED": "0"}
    if "Master" in replicas:
        node_rank = index + 1 if role == "Worker" else 0
        env |= {"MASTER_ADDR": f"{name}-master-0", "MASTER_PORT": str(port),
                "PET_MASTER_ADDR": f"{name}-master-0", "PET_MASTER_PORT": str(port),
                "WORLD_SIZE": str(sum(replicas.values()) * int(spec["nprocPerNode"])),
                "RANK": str(node_rank), "PET_NODE_RANK": str(node_rank),
                "PET_NPROC_PER_NODE": spec["nprocPerNode"]}
    if "elasticPolicy" in spec:
        policy = spec["elasticPolicy"]
        env |= {"PET_RDZV_ENDPOINT": f"{name}-worker-0:{port}",
                "PET_RDZV_BACKEND": policy["rdzvBackend"],
                "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
                "PET_MAX_RESTARTS": str(policy["maxRestarts"])}
    else:
        env["PET_NNODES"] = str(sum(replicas.values()))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
            env[var["name"]] = f"{name}-{role.lower()}-{index}"
    return env


def expanded(command: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) filled in from the container's environment, as the kubelet does."""
    out = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), part) for part in command]
    assert not any("$(" in part for part in out), f"unexpanded reference in {out}"
    return out


def torchrun_config(command: list[str], env: dict[str, str], monkeypatch):
    """torchrun's parsed arguments and LaunchConfig for this command in this pod."""
    from torch.distributed.run import config_from_args, get_args_parser

    assert command[0] == "torchrun"
    for var in [v for v in os.environ if v.startswith("PET_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        if var.startswith("PET_"):
            monkeypatch.setenv(var, value)  # torchrun reads PET_<OPTION> as the option's default
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args() sets it otherwise
    args = get_args_parser().parse_args(command[1:])
    log_dir, args.log_dir = args.log_dir, os.devnull  # LogsSpecs would create the folder
    config, _, _ = config_from_args(args)
    args.log_dir = log_dir
    return args, config


def test_fixed_job_is_one_master_and_workers():
    m = job(nnodes=3, nproc=2)
    assert (m["apiVersion"], m["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert m["metadata"]["name"] == "first-allreduce"
    assert m["spec"]["nprocPerNode"] == "2"
    assert "elasticPolicy" not in m["spec"]
    replicas = m["spec"]["pytorchReplicaSpecs"]
    assert {r: s["replicas"] for r, s in replicas.items()} == {"Master": 1, "Worker": 2}
    assert {s["restartPolicy"] for s in replicas.values()} == {"Never"}
    for _, _, container in pods(m):
        assert container["name"] == "pytorch"
        assert container["image"] == IMAGE
        assert container["workingDir"] == CONTAINER_COURSE_DIR
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": RENDEZVOUS_PORT}]
        assert container["resources"] == {"requests": {"cpu": "2"}}
        assert "env" not in container and "volumeMounts" not in container


def test_one_node_is_a_master_alone():
    m = job(nnodes=1, nproc=4)
    assert list(m["spec"]["pytorchReplicaSpecs"]) == ["Master"]


def test_every_pod_runs_torchrun_with_its_node_rank(monkeypatch):
    m = job(nnodes=3, nproc=2, args=["--epochs", "2"])
    seen = []
    for role, index, container in pods(m):
        env = operator_env(m, role, index, container)
        args, config = torchrun_config(expanded(container["command"], env), env, monkeypatch)
        assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (3, 3, 2)
        assert config.rdzv_backend == "static"
        assert config.rdzv_endpoint == f"first-allreduce-master-0:{RENDEZVOUS_PORT}"
        assert config.max_restarts == 0
        assert args.training_script == SCRIPT and (REPO / args.training_script).is_file()
        assert args.training_script_args == ["--epochs", "2"]
        seen.append(config.rdzv_configs["rank"])
    assert sorted(seen) == [0, 1, 2]  # each pod a different node; global rank = node*2 + local


@pytest.mark.parametrize("launcher", ["torchrun", "labutils"])
def test_a_fixed_job_that_may_restart_meets_through_c10d_at_the_master(launcher, monkeypatch):
    """torch's static rendezvous keeps one store for every attempt: restarted ranks read
    the last attempt's addresses and fail in init_process_group (tests/run/test_multinode.py)."""
    m = job(nnodes=3, nproc=2, args=["--epochs", "2"], max_restarts=1, launcher=launcher)
    for role, index, container in pods(m):
        command = " ".join(container["command"])
        assert "--node-rank" not in command and "$(RANK)" not in command, command
        assert "--max-restarts" in command and "c10d" in command or launcher == "labutils", command
        assert "$(MASTER_ADDR):$(MASTER_PORT)" in command, command
        if launcher == "torchrun":
            env = operator_env(m, role, index, container)
            _, config = torchrun_config(expanded(container["command"], env), env, monkeypatch)
            assert (config.min_nodes, config.max_nodes, config.rdzv_backend) == (3, 3, "c10d")
            assert config.rdzv_endpoint == f"first-allreduce-master-0:{RENDEZVOUS_PORT}"
            assert (config.run_id, config.max_restarts) == ("first-allreduce", 1)
            # a store per round, as launch() asks; torchrun shares one by default
            assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]


def _run_pods_on_loopback(m: dict, tmp_path) -> tuple[list[int], list[str]]:
    """Every pod's command as the kubelet would start it, on this machine; each pod's
    exit status and output."""
    with socket.socket() as s:  # the Master's Service name resolves only in a cluster
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    base = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    procs = []
    try:
        for role, index, container in pods(m):
            env = operator_env(m, role, index, container) | {
                "MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port, "PET_MASTER_PORT": port}
            command = expanded(container["command"], env)
            command[0] = str(Path(sys.executable).with_name("torchrun"))
            # a pod's /tmp is its own; here plain torchrun's log folder goes to the test's
            procs.append(subprocess.Popen(command, cwd=REPO, env=base | env | {"TMPDIR": str(tmp_path)},
                                          text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:  # no orphans: the agent's whole session, TERM then KILL
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    return [p.returncode for p in procs], outputs


@pytest.mark.slow
def test_fixed_job_commands_run_a_real_two_node_job_on_loopback(tmp_path):
    """Both pods' commands, as the kubelet would start them, on this machine: 2 nodes x 1 rank."""
    codes, outputs = _run_pods_on_loopback(job(nnodes=2, nproc=1), tmp_path)
    assert codes == [0, 0], outputs
    for rank, output in enumerate(outputs):  # pod k is node k: it holds global rank k
        assert f"before {rank + 1}  after all_reduce(SUM) 3  mean 1.5" in output


@pytest.mark.slow
def test_a_fixed_job_that_may_restart_recovers_on_loopback(tmp_path):
    """The last rank exits 3 in the first attempt: both pods restart their ranks, which
    meet again through c10d at the Master and finish (with node ranks, torch's static
    rendezvous failed the restart in init_process_group)."""
    marker = tmp_path / "failed-once"
    m = pytorchjob(REPO / "tests" / "scripts" / "fails_first_attempt.py", nnodes=2, nproc=2,
                   image=IMAGE, root=REPO, max_restarts=1, args=[str(marker)])
    codes, outputs = _run_pods_on_loopback(m, tmp_path)
    assert codes == [0, 0], outputs
    assert marker.exists()  # a rank did exit 3 once
    assert sorted(line for out in outputs for line in out.splitlines()
                  if line.startswith("rank ")) == [f"rank {r} of 4 sum 4" for r in range(4)], outputs


def test_elastic_job_runs_workers_with_c10d(monkeypatch):
    m = job(nnodes=2, nproc=2, elastic=(1, 4), max_restarts=3)
    spec = m["spec"]
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 4,
                                     "maxRestarts": 3}
    assert list(spec["pytorchReplicaSpecs"]) == ["Worker"]
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    assert spec["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"
    for role, index, container in pods(m):
        env = operator_env(m, role, index, container)
        _, config = torchrun_config(expanded(container["command"], env), env, monkeypatch)
        assert (config.min_nodes, config.max_nodes) == (1, 4)
        assert config.rdzv_backend == "c10d"
        assert config.rdzv_endpoint == f"first-allreduce-worker-0:{RENDEZVOUS_PORT}"
        assert config.run_id == "first-allreduce"
        assert config.max_restarts == 3


def test_gpus_per_node_ask_for_gpus_and_nccl():
    m = job(nnodes=2, nproc=4, gpus_per_node=4, memory="16Gi")
    for _, _, container in pods(m):
        assert container["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"},
                                          "limits": {"memory": "16Gi", "nvidia.com/gpu": 4}}
        assert {"name": "LABUTILS_BACKEND", "value": "nccl"} in container["env"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    volumes = m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in volumes


def test_shared_volume_gets_every_pods_logs(monkeypatch):
    m = job(nnodes=2, nproc=2, volume_claim="course-runs", mount_path="/mnt/runs")
    log_dirs = set()
    for role, index, container in pods(m):
        assert container["volumeMounts"] == [{"name": "shared", "mountPath": "/mnt/runs"}]
        env = operator_env(m, role, index, container)
        args, _ = torchrun_config(expanded(container["command"], env), env, monkeypatch)
        assert args.tee == "3"
        log_dirs.add(args.log_dir)
    assert log_dirs == {"/mnt/runs/first-allreduce/first-allreduce-master-0",
                        "/mnt/runs/first-allreduce/first-allreduce-worker-0"}
    volumes = m["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"]
    assert volumes == [{"name": "shared", "persistentVolumeClaim": {"claimName": "course-runs"}}]


def test_labutils_launcher_command_parses_with_the_cli():
    from labutils.cli import build_parser

    parser = build_parser()
    launch = parser._subparsers._group_actions[0].choices["launch"]
    if "--node-rank" not in launch._option_string_actions:
        pytest.skip("labutils launch has no --node-rank/--rdzv-endpoint/--rdzv-id yet (the lead's "
                    "multi-node flags); the command is checked once they land")
    m = job(nnodes=2, nproc=2, launcher="labutils", volume_claim="course-runs", args=["--steps", "3"])
    for role, index, container in pods(m):
        command = expanded(container["command"], operator_env(m, role, index, container))
        cut = command.index("--")
        ns = parser.parse_args(command[1:cut])
        assert ns.command == "launch" and ns.script == SCRIPT and command[cut + 1:] == ["--steps", "3"]
        assert (ns.nproc, str(ns.nnodes), int(ns.node_rank)) == (2, "2", 0 if role == "Master" else 1)
        assert ns.rdzv_endpoint == f"first-allreduce-master-0:{RENDEZVOUS_PORT}"
        assert ns.rdzv_id == "first-allreduce" and ns.log_dir == "/mnt/shared"


def test_yaml_round_trips_after_its_header():
    m = job(nnodes=2, nproc=2, gpus_per_node=2, volume_claim="course-runs")
    text = to_yaml(m)
    assert text.startswith("# PyTorchJob first-allreduce: 2 pods (1 Master + 1 Worker) x 2 ranks each.")
    assert "kubectl apply -f FILE && kubectl logs -f first-allreduce-master-0" in text
    assert "&id" not in text  # no YAML anchors: every pod spec spelled out
    assert yaml.safe_load(text) == m


@pytest.mark.parametrize("image", [
    "dist-course", "dist-course:cpu", "ghcr.io/you/dist-course:2.13.0-cuda",
    "localhost:5000/team/dist_course:v1", "registry.example.com/a/b/c@sha256:" + "0" * 64,
])
def test_good_images(image):
    assert job(image=image)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]["image"] == image


@pytest.mark.parametrize("kwargs, what", [
    ({"nnodes": 0}, "nnodes"),
    ({"nnodes": True}, "nnodes"),
    ({"nproc": 0}, "nproc"),
    ({"nproc": "2"}, "nproc"),
    ({"gpus_per_node": 2, "nproc": 4}, "nproc"),
    ({"image": "Dist-Course:cpu"}, "image"),
    ({"image": "dist course"}, "image"),
    ({"image": "dist-course:"}, "image"),
    ({"image": ""}, "image"),
    ({"name": "First_AllReduce"}, "name"),
    ({"name": "x" * 60}, "name"),
    ({"args": "--epochs 2"}, "args"),
    ({"elastic": (4, 5)}, "elastic"),
    ({"elastic": (0, 3)}, "elastic"),
    ({"elastic": [1, 3]}, "elastic"),
    ({"elastic": (1, 2), "nnodes": 3}, "elastic"),
    ({"elastic": (1, 4), "launcher": "labutils"}, "launcher"),
    ({"launcher": "mpirun"}, "launcher"),
    ({"restart_policy": "Sometimes"}, "restart_policy"),
    ({"max_restarts": -1}, "max_restarts"),
    ({"cpu": "four"}, "cpu"),
    ({"memory": "8 GB"}, "memory"),
    ({"volume_claim": "Course Runs"}, "volume_claim"),
    ({"mount_path": "mnt/shared"}, "mount_path"),
])
def test_bad_input_is_one_clear_line(kwargs, what):
    with pytest.raises(InputError) as info:
        job(**kwargs)
    assert info.value.what == what
    assert "\n" not in str(info.value) and "expected" in str(info.value)


@pytest.mark.parametrize("script", ["missing.py", "README.md", "/etc/hostname.py"])
def test_bad_script(script, tmp_path):
    with pytest.raises(InputError) as info:
        pytorchjob(script, nnodes=2, nproc=2, image=IMAGE, root=REPO)
    assert info.value.what == "script"


def test_script_outside_the_course_folder(tmp_path):
    outside = tmp_path / "train.py"
    outside.write_text("print('hi')\n")
    with pytest.raises(InputError, match="inside the course folder"):
        pytorchjob(outside, nnodes=2, nproc=2, image=IMAGE, root=REPO)


def cli(argv: list[str]) -> argparse.Namespace:
    """Parse like labutils.cli.main: the subcommand registered by add_subcommand, -- cut off."""
    parser = argparse.ArgumentParser(prog="labutils")
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    cut = argv.index("--") if "--" in argv else len(argv)
    ns = parser.parse_args(argv[:cut])
    ns.script_args = argv[cut + 1:]
    return ns


def test_cli_writes_the_manifest(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "job.yaml"
    ns = cli(["k8s", SCRIPT, "--nnodes", "2", "--nproc", "2", "--image", IMAGE, "--name", "demo",
              "--elastic", "1:3", "--max-restarts", "2", "--out", str(out), "--", "--epochs", "1"])
    assert ns.handler(ns) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    m = yaml.safe_load(out.read_text())
    assert m == job(nnodes=2, nproc=2, name="demo", elastic=(1, 3), max_restarts=2,
                    args=["--epochs", "1"])


def test_cli_prints_the_manifest_without_out(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    ns = cli(["k8s", SCRIPT, "--nnodes", "2", "-n", "1", "--image", IMAGE, "--gpus-per-node", "1"])
    assert ns.handler(ns) == 0
    m = yaml.safe_load(capsys.readouterr().out)
    assert m["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0][
        "resources"]["limits"] == {"nvidia.com/gpu": 1}


@pytest.mark.parametrize("extra, what", [
    (["--nnodes", "0"], "--nnodes"),
    (["--image", "Not An Image"], "--image"),
    (["--elastic", "4"], "--elastic"),
])
def test_cli_bad_input_exits_2_and_writes_nothing(extra, what, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "job.yaml"
    ns = cli(["k8s", SCRIPT, "--nnodes", "2", "--nproc", "2", "--image", IMAGE, "--out", str(out),
              *extra])
    assert ns.handler(ns) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"labutils k8s: {what}: expected") and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize(("argv", "said"), [
    (["--nnodes", "0"], "--nnodes: expected an integer >= 1, got 0; pass --nnodes >= 1"),
    (["--max-restarts", "-1"], "--max-restarts: expected an integer >= 0, got -1"),
    (["--memory", "lots"], "--memory: expected a memory quantity like 8Gi or 512Mi, got 'lots'"),
    (["-n", "4", "--gpus-per-node", "2"], "pass -n/--nproc 2 or --gpus-per-node 4"),
    (["--volume", "Course Runs"], "--volume: expected the name of a PersistentVolumeClaim"),
])
def test_cli_errors_name_the_flags(argv, said, capsys):
    """The manifest's checks speak of pytorchjob()'s keywords; the command says its flags."""
    words = ["k8s", str(REPO / "lessons" / "00_first_distributed_run" / "first_allreduce.py"),
             "--nnodes", "2", "-n", "2", "--image", IMAGE]
    assert main([*words, *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("labutils k8s: ") and said in err[0], err
    assert not re.search(r"(?<![-\w])(nproc|nnodes|max_restarts|gpus_per_node|volume_claim)\b", err[0])
