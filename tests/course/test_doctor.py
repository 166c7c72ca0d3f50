"""`labutils doctor`: the environment report, and its advice about threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def doctor(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")} | env_extra
    done = subprocess.run([sys.executable, "-m", "labutils.cli", "doctor", "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_report_says_what_the_machine_has():
    report = doctor({})
    assert report["cpu_cores"] == len(os.sched_getaffinity(0))
    assert report["recommended_world_size"] >= 2 and report["backends"]["gloo"] is True
    assert not any("_NUM_THREADS" in a for a in report["advice"])


@pytest.mark.parametrize("value, advised", [("64", True), ("1", False)])
def test_threads_from_the_environment_that_overfill_the_cores_are_named(value, advised):
    """The launcher gives each rank 1 thread unless OMP_NUM_THREADS is set, as torchrun
    does; a value set for another machine made each DDP step of 2 ranks on 2 cores 3.3x
    to 3.6x slower (2 threads each, torch's cap at the cores)."""
    report = doctor({"OMP_NUM_THREADS": value})
    said = [a for a in report["advice"] if a.startswith("OMP_NUM_THREADS=")]
    assert bool(said) == advised, report["advice"]
    if advised:
        assert said[0].startswith(f"OMP_NUM_THREADS={value} in the environment: each rank computes "
                                  "with ") and said[0].endswith("unset it (each rank then gets 1) "
                                                                "or set it to 1")


@pytest.mark.parametrize("env, named", [
    ({"MKL_NUM_THREADS": "64"}, "MKL_NUM_THREADS=64"),
    # torch reads MKL_NUM_THREADS first: the launcher's OMP_NUM_THREADS=1 does not help
    ({"MKL_NUM_THREADS": "4", "OMP_NUM_THREADS": "1"}, "MKL_NUM_THREADS=4"),
    ({"MKL_NUM_THREADS": "8", "OMP_NUM_THREADS": "8"}, "MKL_NUM_THREADS=8 and OMP_NUM_THREADS=8"),
    ({"MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "8"}, None),  # torch takes 1 thread
])
def test_the_variable_torch_takes_its_threads_from_is_the_one_named(env, named):
    report = doctor(env)
    said = [a for a in report["advice"] if "_NUM_THREADS=" in a]
    assert [a.split(" in the environment:")[0] for a in said] == ([named] if named else []), \
        report["advice"]


def test_a_machine_whose_ranks_see_a_gpu_is_told_why_its_runs_start_cold():
    """On such a machine every run starts cold, gloo ones too (run/warm.py): the advice
    says so and how to hide the GPUs; a machine without GPUs is told nothing of it."""
    from labutils.course.doctor import gpu_advice

    said = gpu_advice(1, starts_cold=True)
    assert said[0].startswith("use backend='nccl'") and said[1].startswith("runs start cold here")
    assert "CUDA_VISIBLE_DEVICES=" in said[1]
    assert gpu_advice(1, starts_cold=False) == said[:1]   # GPUs torch sees, not NVIDIA's driver
    assert gpu_advice(0, starts_cold=False) == []
    report = doctor({})
    if not report["gpus"]:
        assert not any("cold" in a for a in report["advice"])
