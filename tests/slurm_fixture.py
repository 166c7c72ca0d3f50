"""A real single-host SLURM cluster for the tests: fixture `slurm_cluster`.

scripts/slurm/start-local-slurm.sh starts munged, slurmctld and one slurmd per node on
this machine, under the session's pytest folder and on free ports; SLURM_CONF points the
client commands (sbatch, squeue, scontrol) at it for the whole session. At the end
scripts/slurm/stop-local-slurm.sh cancels every job and stops every daemon, and fails
if any process of the cluster is left.

Use it by importing the fixture where tests need it (a module, or tests/conftest.py):

    from slurm_fixture import slurm_cluster  # noqa: F401

Skipped (with the reason) only when not root or when the Debian packages are missing;
a cluster that is installed but does not start is an error, not a skip.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts" / "slurm"
TOOLS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel",
         "sinfo")


@dataclass(frozen=True)
class LocalSlurm:
    """The running test cluster: its folder, config, controller port and node count."""

    dir: Path
    conf: Path
    port: int
    nodes: int


def skip_reason() -> str | None:
    """Why the local cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return (f"SLURM tests need root (uid {os.geteuid()}): the local cluster's daemons run "
                "as root and start jobs as their owner; run `make test` as root")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"SLURM tests need the Debian packages slurm-wlm and munge (missing: "
                f"{', '.join(missing)}); `make test` installs them as root "
                "(scripts/system-packages.txt)")
    return None


def _free_port_base(span: int) -> int:
    """A port p with p..p+span-1 all free: slurmctld, then one slurmd per node."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + span > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + span):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {span} consecutive free ports found")


def _run_script(name: str, cluster_dir: Path, env: dict, timeout: float) -> str:
    try:
        done = subprocess.run([str(SCRIPTS / name), str(cluster_dir)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{name} did not finish within {timeout:g} s; logs in "
                           f"{cluster_dir}/log") from None
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip() or f"{name} exited {done.returncode}")
    return done.stdout


def slurm_queue() -> str:
    """What squeue lists on the test cluster ('' when no job is queued or running)."""
    return subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=10).stdout


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> LocalSlurm:
    """Start the local cluster once per session; stop it (no job, no process) at the end."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    # One folder per pytest session: a second import of this fixture finds it running.
    cluster_dir = tmp_path_factory.getbasetemp() / "slurm-cluster"
    conf = cluster_dir / "etc" / "slurm.conf"
    nodes = 2
    found = re.search(r"^SlurmctldPort=(\d+)$", conf.read_text(), re.M) if conf.exists() else None
    port = int(found.group(1)) if found else _free_port_base(nodes + 1)
    # OMP_NUM_THREADS as a user's environment may set it, larger than the cores: `nproc`
    # honours it, and the cluster once declared that many CPUs per node, which slurmctld
    # refused (every node INVAL, no SLURM test could run).
    env = {**os.environ, "LABUTILS_SLURM_PORT": str(port), "LABUTILS_SLURM_NODES": str(nodes),
           "OMP_NUM_THREADS": "64"}
    env.pop("SLURM_CONF", None)
    with pytest.MonkeyPatch.context() as mp:
        try:
            _run_script("start-local-slurm.sh", cluster_dir, env, timeout=90)
            mp.setenv("SLURM_CONF", str(conf))
            yield LocalSlurm(dir=cluster_dir, conf=conf, port=port, nodes=nodes)
        finally:
            _run_script("stop-local-slurm.sh", cluster_dir, env, timeout=90)
