"""The follow loop and the ending without torchrun: recorded runs of the endings table
(tests/data/recorded, made by tests/run/replay.py) replayed through a fake back end must
give the verdict the endings table requires, as the real runs do (test_endings.py)."""

from __future__ import annotations

import json

import pytest
from endings_table import SCRIPT, check_verdict, verdict
from replay import RECORDINGS, ReplayAgents

from labutils.run.display import Display
from labutils.run.follow import Run
from labutils.run.spec import make_spec, new_run_dir

RECORDED = sorted(p for p in RECORDINGS.iterdir() if (p / "recording.json").exists())


def replay(recording, tmp_path) -> dict:
    meta = json.loads((recording / "recording.json").read_text())
    spec = make_spec(SCRIPT, meta["nproc"], args=[meta["how"], str(meta["failing"])])
    backends: list[ReplayAgents] = []

    def backend(spec, run_dir):
        backends.append(ReplayAgents(spec, run_dir, recording))
        return backends[0]

    run = Run(spec, new_run_dir(spec.script, tmp_path), Display(), backend=backend)
    summary = run.run().to_json()
    assert backends[0].stopped == [([], summary["reason"])]  # no recorded pid signalled
    return summary


def test_every_ending_has_a_recording_warm_and_cold():
    names = {p.name for p in RECORDED}
    from endings_table import ENDINGS

    assert names == {f"{how}-{start}" for how in ENDINGS if how != "stuck"
                     for start in ("warm", "cold")}


@pytest.mark.parametrize("recording", RECORDED, ids=[p.name for p in RECORDED])
def test_a_replayed_run_gets_the_verdict_of_its_ending(recording, tmp_path):
    meta = json.loads((recording / "recording.json").read_text())
    summary = replay(recording, tmp_path)
    assert summary["start"] == meta["start"]
    check_verdict(summary, meta["how"], meta["nproc"], meta["failing"])


@pytest.mark.parametrize("how", sorted({p.name.rsplit("-", 1)[0] for p in RECORDED}))
def test_a_replayed_warm_run_and_cold_run_get_the_same_verdict(how, tmp_path):
    warm = replay(RECORDINGS / f"{how}-warm", tmp_path)
    cold = replay(RECORDINGS / f"{how}-cold", tmp_path)
    assert verdict(warm, how) == verdict(cold, how)


def test_a_second_ctrl_c_during_the_stop_asks_the_back_end_to_end_at_once(tmp_path):
    """A second press that lands as the back end begins to stop (SLURM: after stop.json
    is written, before its first squeue) is a second stop, ``again``: the SLURM back end
    then cancels the job at once instead of waiting for the nodes (CI saw the press taken
    for the first one, and the job end without scancel)."""
    recording = RECORDINGS / "exception-cold"
    calls: list[tuple[str, bool]] = []

    class PressedTwice(ReplayAgents):
        def stop(self, ranks, reason, note, *, again=False):
            calls.append((reason, again))
            if len(calls) == 1:
                raise KeyboardInterrupt  # the second press, in the first stop

    meta = json.loads((recording / "recording.json").read_text())
    spec = make_spec(SCRIPT, meta["nproc"], args=[meta["how"], str(meta["failing"])])
    run = Run(spec, new_run_dir(spec.script, tmp_path), Display(),
              backend=lambda spec, run_dir: PressedTwice(spec, run_dir, recording))
    with pytest.raises(KeyboardInterrupt, match="every rank was stopped"):
        run.run()
    assert calls == [("failed", False), ("interrupted", True)]


def test_a_run_whose_agent_lost_its_rendezvous_store_blames_the_agent_not_a_rank(tmp_path):
    """Recorded (replay.record_store_lost): the agent had joined another run's store,
    which ended; torchrun ended both ranks with SIGTERM and exited with its own error.
    No rank failed: the root cause is torchrun's, where it once read "rank 0: SIGTERM,
    the process ended without an exit code we could read" (run 122, 2026-11-30)."""
    from labutils.run.spec import make_spec
    from replay import FOREVER, INCIDENTS

    recording = INCIDENTS / "store_lost-cold"
    spec = make_spec(FOREVER, 2)
    run = Run(spec, new_run_dir(spec.script, tmp_path), Display(),
              backend=lambda spec, run_dir: ReplayAgents(spec, run_dir, recording))
    summary = run.run().to_json()
    failure = summary["failure"]
    assert summary["reason"] == "failed"
    assert (failure["rank"], failure["kind"]) == (-1, "torchrun"), failure
    assert "lost the connection to its rendezvous store" in failure["message"], failure
    assert [r["state"] for r in summary["ranks"]] == ["killed", "killed"]
    assert [r["exit_code"] for r in summary["ranks"]] == [-15, -15]
