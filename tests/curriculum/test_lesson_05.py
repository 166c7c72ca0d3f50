"""Lesson 05's resumable training: its parts in process, and kills for real.

The notebook kills once per run; here one run is killed at 10 different steps (two
of them in the middle of a checkpoint write) and must still end bit for bit where
the uninterrupted run ends.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from helpers import LESSONS
import torch

from labutils import launch
from labutils.course.lesson import load

LESSON = LESSONS / "05_elastic_training"
TRAIN = LESSON / "train_resumable.py"
LIMITS = {"hang_timeout": 90, "timeout": 600, "display": "none"}


@pytest.fixture
def lesson():
    return load(LESSON, "checkpoint"), load(LESSON, "parts")


def final_hashes(result) -> set[str]:
    return {rec["params_sha256"] for rec in result.records if "params_sha256" in rec}


# ------------------------------------------------------------------------ in process

@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("batches_done", [0, 1, 3])
def test_sampler_position_is_a_prefix_of_the_epoch_whatever_the_world_size(
        lesson, world_size, batches_done):
    _, parts = lesson
    dataset, batch = parts.make_dataset(), 32 // world_size
    full = list(parts.ResumableSampler(dataset, num_replicas=1, rank=0, seed=0))
    position = batches_done * 32
    rest = []
    for rank in range(world_size):
        sampler = parts.ResumableSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
        sampler.set_position(position)
        mine = list(sampler)
        assert len(mine) == len(sampler) == (len(dataset) - position) // world_size
        rest.extend(mine)
    assert sorted(rest) == sorted(full[position:])
    assert len(rest) // batch >= 1


def test_sampler_position_must_split_evenly(lesson):
    _, parts = lesson
    sampler = parts.ResumableSampler(parts.make_dataset(), num_replicas=2, rank=0, seed=0)
    with pytest.raises(ValueError, match="multiple of the world size"):
        sampler.set_position(3)


def test_rng_state_survives_weights_only_load(lesson, tmp_path):
    checkpoint, _ = lesson
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.normal()  # a cached gaussian is part of numpy's state too
    saved = checkpoint.rng_state()
    expected = (torch.rand(3), np.random.normal(size=3), random.random())
    checkpoint.write_checkpoint({"rng": saved}, tmp_path / "latest.pt")
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    loaded = checkpoint.read_checkpoint(tmp_path / "latest.pt", torch.device("cpu"))
    checkpoint.set_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(3), expected[0])
    assert (np.random.normal(size=3) == expected[1]).all()
    assert random.random() == expected[2]


class Crash(Exception):
    pass


def crash():
    raise Crash


def test_crash_halfway_keeps_the_atomic_checkpoint_and_breaks_the_naive_one(lesson, tmp_path):
    checkpoint, _ = lesson
    for writer in ("atomic", "naive"):
        path = tmp_path / writer / "latest.pt"
        path.parent.mkdir()
        checkpoint.write_checkpoint({"step": torch.tensor(1)}, path, writer=writer)
        with pytest.raises(Crash):
            checkpoint.write_checkpoint({"step": torch.tensor(2), "big": torch.zeros(10_000)},
                                        path, writer=writer, halfway=crash)
        if writer == "atomic":
            assert checkpoint.read_checkpoint(path, torch.device("cpu"))["step"] == 1
            assert Path(f"{path}.tmp").exists()
        else:
            with pytest.raises(Exception):  # noqa: B017 - torch 2.13 says OSError, older RuntimeError
                checkpoint.read_checkpoint(path, torch.device("cpu"))
    assert checkpoint.read_checkpoint(tmp_path / "none.pt", torch.device("cpu")) is None


# ------------------------------------------------------------------------ for real

def test_ten_kills_at_different_steps_end_bitwise_equal_to_an_uninterrupted_run(runs_dir, tmp_path):
    steps = "40"
    reference = launch(TRAIN, 2, args=[str(tmp_path / "ref"), "--steps", steps], **LIMITS)
    assert reference.ok, reference.summary()
    (want,) = final_hashes(reference)
    # Steps 2..38, both ranks, two kills inside a checkpoint write (saves follow steps
    # 3, 7, 11, ...: report(step=S, phase="save") is the write after step S).
    faults = [{"rank": 1, "step": 2}, {"rank": 0, "step": 5}, {"rank": 0, "step": 7, "phase": "save"},
              {"rank": 1, "step": 10}, {"rank": 0, "step": 14}, {"rank": 1, "step": 17},
              {"rank": 0, "step": 23, "phase": "save"}, {"rank": 1, "step": 26},
              {"rank": 0, "step": 31}, {"rank": 1, "step": 38}]
    killed = launch(TRAIN, 2, args=[str(tmp_path / "killed"), "--steps", steps],
                    max_restarts=len(faults), fault=faults, **LIMITS)
    assert killed.ok, killed.summary()
    assert [a["outcome"] for a in killed.attempts] == ["restarted"] * len(faults) + ["ok"]
    assert [a["injected"] for a in killed.attempts[:-1]] == faults
    assert final_hashes(killed) == {want}
    # Every step's loss equals the reference's, in every attempt that trained it.
    ref_loss = {rec["step"]: rec["loss"] for rec in reference.records if rec["rank"] == 0 and "loss" in rec}
    trained = [(rec["step"], rec["loss"]) for rec in killed.records if rec["rank"] == 0 and "loss" in rec]
    assert len(trained) > int(steps) and all(ref_loss[s] == loss for s, loss in trained)


def test_the_store_check_needs_a_port_of_its_own_for_every_attempt_and_never_the_agents():
    """lesson05.store_per_attempt on hand-made records: True only for what launch() sets
    up (each attempt on a new MASTER_PORT, no agent store); each way the shared store
    shows itself turns it False."""
    L = load(LESSON, "lesson05")

    def run(*attempts):   # per attempt, each rank's (port, agent store)
        return type("Run", (), {"records": [
            {"rank": rank, "restart": restart, "master_port": port, "agent_store": agent}
            for restart, ranks in enumerate(attempts) for rank, (port, agent) in enumerate(ranks)]
            + [{"rank": 0, "restart": 0, "step": 0, "loss": 1.0}]})()

    assert L.store_per_attempt(run([(5001, False)] * 2, [(5002, False)] * 2))
    assert not L.store_per_attempt(run([(5001, True)] * 2, [(5001, True)] * 2))   # the agent's
    assert not L.store_per_attempt(run([(5001, False)] * 2, [(5001, False)] * 2))  # one port for both
    assert not L.store_per_attempt(run([(5001, True)] * 2, [(5002, True)] * 2))    # new ports, shared
    assert not L.store_per_attempt(run([(5001, False)] * 2, [(5002, False), (5003, False)]))
    assert not L.store_per_attempt(run([(5001, False)] * 2))   # never restarted
