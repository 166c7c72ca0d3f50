"""Ranks of several local agents share the machine's GPUs (lesson 05's shrinking run on a
one-GPU machine picked nccl in each agent and both ranks took cuda:0: NCCL's "Duplicate
GPU detected"). Checked without a GPU by telling torch how many it has."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from labutils import dist
from labutils.errors import LaunchConfigError
from labutils.run import spec
from labutils.runtime import runfiles


@pytest.fixture
def gpus(monkeypatch):
    def have(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
        monkeypatch.setattr(spec, "gpu_count", lambda: n)
    return have


@pytest.mark.parametrize(("agent", "gpu_count", "backend", "slot"), [
    ("0/1", 1, "nccl", 0),     # one agent, one rank, one GPU
    ("1/2", 1, "gloo", 1),     # two agents of one rank each on one GPU: no GPU each
    ("1/2", 2, "nccl", 1),     # ... on two GPUs: the second agent's rank takes cuda:1
    ("0/2", 2, "nccl", 0),
])
def test_auto_counts_the_ranks_of_every_agent_on_the_machine(gpus, monkeypatch, agent, gpu_count,
                                                            backend, slot):
    gpus(gpu_count)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv(runfiles.ENV_LOCAL_AGENT, agent)
    assert dist.pick_backend("auto") == backend
    assert dist.local_slot()[0] == slot


def test_nccl_with_more_local_ranks_than_gpus_is_refused_before_starting(gpus, tmp_path):
    gpus(1)
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    with pytest.raises(LaunchConfigError, match="2 GPUs for nccl with nproc=1 x local_agents=2"):
        spec.make_spec(script, 1, backend="nccl", nnodes="1:2", local_agents=2)
    spec.make_spec(script, 1, backend="nccl")   # one rank, one GPU: fine


def _place_script(tmp_path) -> Path:
    """A script whose ranks report their agent's place on the machine and local_slot()."""
    script = tmp_path / "place.py"
    script.write_text("import os\nimport torch.distributed as dist\n"
                      "from labutils.dist import init, local_slot, report\ninit()\n"
                      f"report(place=os.environ.get({runfiles.ENV_LOCAL_AGENT!r}), slot=local_slot())\n"
                      "dist.barrier()\ndist.destroy_process_group()\n")
    return script


def test_each_rank_of_a_run_of_local_agents_knows_its_place_on_the_machine(tmp_path):
    from labutils import launch

    script = _place_script(tmp_path)
    result = launch(script, nproc=1, nnodes="1:2", local_agents=2, display="none",
                    log_dir=tmp_path / "runs", timeout=120)
    assert result.ok, result.headline()
    assert sorted(r["place"] for r in result.records if "place" in r) == ["0/2", "1/2"]


def test_hosts_of_a_virtual_cluster_share_the_machines_gpus(tmp_path):
    """Each host of a virtual cluster is one launcher on this machine: its ranks are
    told their place among every host's (on a one-GPU machine, lessons 01 and 07's
    2-host runs picked nccl on both hosts and NCCL refused: "Duplicate GPU detected")."""
    from labutils.cluster import virtual_cluster

    script = _place_script(tmp_path)
    with virtual_cluster(2) as cluster:
        result = cluster.launch(script, nproc=2, display="none", log_dir=tmp_path / "runs", timeout=120)
    assert result.ok, result.headline()
    places = sorted((r["rank"], r["place"], tuple(r["slot"])) for r in result.records if "place" in r)
    # host h's ranks: agent h of 2; local slots 0-1 on host 0, 2-3 on host 1, of 4
    assert places == [(0, "0/2", (0, 4)), (1, "0/2", (1, 4)), (2, "1/2", (2, 4)), (3, "1/2", (3, 4))]


def test_a_launcher_placed_next_to_others_counts_its_agents_within_its_place(tmp_path):
    """Host 1 of 2 with local_agents=2 on each host: agents 2 and 3 of the machine's 4."""
    from labutils import launch

    script = _place_script(tmp_path)
    result = launch(script, nproc=1, nnodes="1:2", local_agents=2, display="none",
                    env={runfiles.ENV_LOCAL_AGENT: "1/2"}, log_dir=tmp_path / "runs", timeout=120)
    assert result.ok, result.headline()
    assert sorted(r["place"] for r in result.records if "place" in r) == ["2/4", "3/4"]
