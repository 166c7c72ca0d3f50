"""labutils.cluster.slurm: the sbatch script (structure, quoting, what each node runs), input checks,
and real jobs on a local SLURM cluster (tests/slurm_fixture.py): a 2-rank gloo all_reduce
across two slurmd nodes, a planted failure, and a cancelled job that leaves nothing behind."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from labutils.runtime.procs import free_port
from labutils.errors import InputError
from labutils.cluster.slurm import (
    NodeValues, ShellRef, SlurmError, SlurmJob, add_subcommand, check_cluster, sbatch_script,
    srun_command, torchrun_node_command,
)
from slurm_fixture import SCRIPTS, slurm_cluster  # noqa: F401  (the session's local cluster)

PYTHON = sys.executable


@pytest.fixture(autouse=True)
def _nodes_temporary_folder(tmp_path, monkeypatch):
    """A job's nodes get the submitter's environment (sbatch --export=ALL): plain torchrun
    makes its log folder in TMPDIR, so the jobs here leave theirs in the test's folder,
    not in the machine's /tmp."""
    folder = tmp_path / "nodes-tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))


# --- the script, without a cluster ----------------------------------------------------------

def test_sbatch_script_structure():
    text = sbatch_script("train.py", nnodes=2, nproc_per_node=4, args=["--epochs", "2"],
                         job_name="ddp", partition="gpu", time_limit="01:00:00",
                         gpus_per_node=4, run_dir="/shared/run1", rdzv_port=29600)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    directives = [line.split(None, 1)[1] for line in lines if line.startswith("#SBATCH")]
    assert directives == [
        "--job-name=ddp", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=4",
        "--gpus-per-node=4", "--partition=gpu", "--time=01:00:00", "--output=slurm-%j.out",
        "--chdir=/shared/run1",
    ]
    # every directive comes before the first command, or sbatch ignores it
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)' in text
    assert "exec srun " in text and "--kill-on-bad-exit=1" in text
    assert '--cpus-per-task="$SLURM_CPUS_PER_TASK" --gpus-per-node=4' in text
    assert '--rdzv-endpoint "$head_addr:29600"' in text and '--rdzv-id "$SLURM_JOB_ID"' in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_defaults_leave_out_optional_directives():
    text = sbatch_script("train.py", nnodes=1, nproc_per_node=2)
    assert "--partition" not in text and "--gpus-per-node" not in text and "--chdir" not in text
    assert "#SBATCH --cpus-per-task=2" in text  # one CPU per rank unless told


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run_with_stubs(tmp_path: Path, text: str, nnodes: int) -> list[dict]:
    """Run a batch script with stand-ins for scontrol, srun and python: srun starts the task
    once per node with SLURM_NODEID set; 'python' records its argv and environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "scontrol", """\
        case "$*" in
          "show hostnames nodeA,nodeB") printf 'nodeA\\nnodeB\\n' ;;
          "-o show node nodeA") echo "NodeName=nodeA Arch=x86_64 NodeAddr=10.0.0.7 NodeHostName=a" ;;
          *) echo "unexpected scontrol $*" >&2; exit 1 ;;
        esac
        """)
    _stub(bin_dir, "srun", """\
        while [[ "$1" == --* ]]; do shift; done   # srun's own options
        for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit; done
        """)
    _stub(bin_dir, "fakepython", f"""\
        exec {PYTHON} -c 'import json, os, sys
        print(json.dumps({{"argv": sys.argv[1:], "node": os.environ["SLURM_NODEID"]}}))' "$@"
        """)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "nodeA,nodeB", "SLURM_NNODES": str(nnodes),
           "SLURM_CPUS_PER_TASK": "2"}
    done = subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_each_node_runs_torchrun_with_slurms_values(tmp_path):
    tricky = ["--msg", "it's $HOME and \"quotes\"", "two words", ""]
    text = sbatch_script("train.py", nnodes=2, nproc_per_node=3, args=tricky,
                         python="fakepython", rdzv_port=29501)
    runs = _run_with_stubs(tmp_path, text, nnodes=2)
    assert [r["node"] for r in runs] == ["0", "1"]
    for run in runs:
        assert run["argv"] == [
            "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "3",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.7:29501", "--rdzv-id", "42",
            "train.py", *tricky]


def test_a_node_command_gets_the_node_rank(tmp_path):
    def labutils_like(node: NodeValues) -> list:
        return [node.python, "-m", "labutils.cli", "launch", "-n", str(node.nproc_per_node),
                "--nnodes", node.nnodes, "--node-rank", node.node_rank,
                "--rdzv-endpoint", node.rdzv_endpoint, "--rdzv-id", node.rdzv_id,
                "--log-dir", node.run_dir, node.script, "--", *node.args]

    text = sbatch_script("train.py", nnodes=2, nproc_per_node=1, args=["--lr", "0.1"],
                         python="fakepython", run_dir="/runs/r1", node_command=labutils_like)
    runs = _run_with_stubs(tmp_path, text, nnodes=2)
    assert [r["argv"][r["argv"].index("--node-rank") + 1] for r in runs] == ["0", "1"]
    assert runs[1]["argv"][-6:] == ["--log-dir", "/runs/r1", "train.py", "--", "--lr", "0.1"]


@pytest.mark.parametrize("kwargs, what", [
    ({"script": "train.sh"}, "script"),
    ({"nnodes": 0}, "nnodes"),
    ({"nnodes": True}, "nnodes"),
    ({"nproc_per_node": -1}, "nproc_per_node"),
    ({"args": "--epochs 2"}, "args"),
    ({"job_name": "my job"}, "job_name"),
    ({"partition": "gpu;rm"}, "partition"),
    ({"time_limit": "1h"}, "time_limit"),
    ({"time_limit": "00:30"}, None),
    ({"time_limit": "2-12:00:00"}, None),
    ({"gpus_per_node": 1, "nproc_per_node": 2}, "gpus_per_node"),
    ({"output": "a\nb"}, "output"),
    ({"rdzv_port": 70000}, "rdzv_port"),
    ({"cpus_per_task": 0}, "cpus_per_task"),
])
def test_inputs_checked_before_anything_runs(kwargs, what):
    call = {"script": "train.py", "nnodes": 2, "nproc_per_node": 1, **kwargs}
    if what is None:
        sbatch_script(call.pop("script"), **call)
        return
    with pytest.raises(InputError) as err:
        sbatch_script(call.pop("script"), **call)
    assert err.value.what == what and "\n" not in str(err.value)


def test_shell_refs_and_srun_reject_odd_input():
    with pytest.raises(InputError):
        ShellRef("$(rm -rf /)")
    with pytest.raises(InputError):
        srun_command([])
    assert torchrun_node_command(NodeValues(
        script="t.py", args=(), nproc_per_node=1, python="python", run_dir=None,
        rdzv_endpoint=ShellRef("$head_addr:1")))[:3] == ["python", "-m", "torch.distributed.run"]


def _cli(argv: list[str], script_args: list[str] = ()) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="labutils")
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    ns.script_args = list(script_args)
    return ns


def test_cli_writes_the_script(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    ns = _cli(["slurm", "train.py", "--nodes", "2", "--nproc", "2", "--time", "10",
               "--out", str(out)], ["--epochs", "3"])
    assert ns.handler(ns) == 0
    text = out.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --time=10" in text
    assert "train.py \\\n        --epochs 3" in text
    ns = _cli(["slurm", "train.py", "--nodes", "1", "--nproc", "1"])
    assert ns.handler(ns) == 0 and capsys.readouterr().out.startswith("#!/bin/bash")
    ns = _cli(["slurm", "train.py", "--nodes", "0", "--nproc", "1"])
    assert ns.handler(ns) == 2
    assert capsys.readouterr().err.startswith("labutils slurm: --nodes: expected an integer >= 1, got 0; pass e.g. --nodes 2")


def test_submit_errors_are_one_line(tmp_path, monkeypatch):
    text = sbatch_script("train.py", nnodes=1, nproc_per_node=1)
    with pytest.raises(InputError, match="workdir"):
        SlurmJob.submit(text, tmp_path / "missing")
    with pytest.raises(InputError, match="script_text"):
        SlurmJob.submit("echo no shebang", tmp_path)
    with pytest.raises(InputError, match="job_id"):
        SlurmJob("12; rm")
    monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM commands here
    with pytest.raises(SlurmError, match=r"^sbatch not found on PATH") as err:
        SlurmJob.submit(text, tmp_path)
    assert "\n" not in str(err.value)


def test_unreachable_cluster_is_one_line(tmp_path, monkeypatch):
    if subprocess.run(["which", "scontrol"], capture_output=True).returncode != 0:
        pytest.skip("scontrol not installed (Debian package slurm-client)")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nowhere.conf"))
    with pytest.raises(SlurmError, match=r"^SLURM_CONF=.*does not exist"):
        check_cluster()
    port = free_port()  # nothing listens there
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=gone\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={port}\n"
                    "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(SlurmError, match="the SLURM cluster does not answer: .*DOWN") as err:
        check_cluster()
    assert "\n" not in str(err.value)


# --- real jobs on the local cluster -----------------------------------------------------------

ALL_REDUCE = """\
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value)
    print(f"rank {dist.get_rank()}/{dist.get_world_size()} on {os.environ['SLURMD_NODENAME']}:"
          f" sum={value.item():.0f}", flush=True)
    dist.destroy_process_group()
    """


def _job(slurm_cluster, write_script, tmp_path, name: str, source: str) -> SlurmJob:
    """Submit SCRIPT on every node of the cluster, 2 ranks in all (2x1, or 1x2 on one node)."""
    script = write_script(name, source)
    nnodes = slurm_cluster.nodes
    text = sbatch_script(str(script), nnodes=nnodes, nproc_per_node=2 // nnodes,
                         job_name=name.removesuffix(".py"), time_limit="2",
                         run_dir=str(tmp_path), rdzv_port=free_port(), python=PYTHON)
    return SlurmJob.submit(text, tmp_path)


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and entry.name != str(os.getpid()):
            found.append(f"{entry.name} {cmdline}")
    return found


@pytest.mark.slow
def test_two_rank_job_completes(slurm_cluster, write_script, tmp_path):
    job = _job(slurm_cluster, write_script, tmp_path, "allreduce.py", ALL_REDUCE)
    assert job.output_path == tmp_path / f"slurm-{job.job_id}.out"
    assert job.wait(timeout=60) == "COMPLETED", job.output_text()
    assert job.exit_code() == 0 and not job.alive()
    out = job.output_text()
    lines = sorted(line.split(": ", 1)[1] for line in out.splitlines() if ": rank " in line)
    nodes = ["node1", "node2"] if slurm_cluster.nodes == 2 else ["node1", "node1"]
    assert [line.split(" on ")[0] for line in lines] == ["rank 0/2", "rank 1/2"], out
    assert sorted(line.split(" on ")[1] for line in lines) == [f"{n}: sum=3" for n in nodes]


@pytest.mark.slow
def test_failing_job_is_failed_with_its_exit_code(slurm_cluster, write_script, tmp_path):
    job = _job(slurm_cluster, write_script, tmp_path, "fails.py", """\
        import os
        import time
        if os.environ["RANK"] == "1":
            raise RuntimeError("planted failure on rank 1")
        time.sleep(60)  # rank 0 would wait: srun --kill-on-bad-exit ends it
        """)
    assert job.wait(timeout=60) == "FAILED"
    # srun's status: 1 when the failed task ended the step, 143 when srun itself was
    # terminated while it tore the step down; never 0
    assert job.exit_code() not in (0, None), job.output_text()[-1500:]
    out = job.output_text()
    assert "RuntimeError: planted failure on rank 1" in out
    assert "rank      : 1 (local_rank: 0)" in out  # torchrun's root-cause report


def test_start_script_again_is_a_no_op(slurm_cluster):
    env = {**os.environ, "LABUTILS_SLURM_PORT": str(slurm_cluster.port),
           "LABUTILS_SLURM_NODES": str(slurm_cluster.nodes)}
    done = subprocess.run([str(SCRIPTS / "start-local-slurm.sh"), str(slurm_cluster.dir)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "already running" in done.stdout, done.stderr


@pytest.mark.slow
def test_cancel_stops_every_process(slurm_cluster, write_script, tmp_path, capsys):
    script = write_script("sleeper.py", """\
        import os
        import time
        print(f"ready {os.environ['RANK']}", flush=True)
        time.sleep(300)
        """)
    # submitted the way a learner would: labutils slurm ... --submit prints the job id
    ns = _cli(["slurm", str(script), "--nodes", str(slurm_cluster.nodes),
               "--nproc", str(2 // slurm_cluster.nodes), "--time", "2", "--submit",
               "--run-dir", str(tmp_path), "--python", PYTHON, "--port", str(free_port())])
    assert ns.handler(ns) == 0
    job = SlurmJob(capsys.readouterr().out.strip())
    deadline = time.monotonic() + 60
    while job.output_text().count("ready") < 2:
        assert time.monotonic() < deadline and job.alive(), job.output_text()
        time.sleep(0.2)
    script = str(script)
    assert len(_processes_mentioning(script)) >= 4  # 2 agents, 2 ranks (and srun)
    assert job.cancel(wait=True, timeout=30) == "CANCELLED"
    queued = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                            timeout=10).stdout.split()
    assert job.job_id not in queued and not job.alive()
    assert _processes_mentioning(script) == []
