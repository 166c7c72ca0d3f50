"""The warm agent forks its ranks with torchrun's stop signals held until the rank has
the handlers a cold rank starts with (agent.hold_signals_across_fork, worker.fresh_start).

Each case runs in a Python process of its own, which plays the warm agent: it installs
a SIGTERM handler that raises, as torchrun's agent does (torch's
_terminate_process_handler raises SignalException), and forks a rank with
multiprocessing's fork start method, as torchrun's function entry point does. A rank
stopped between its fork and the reset of those handlers raised the agent's exception
and exited 1; a cold rank stopped as it starts dies of SIGTERM.

The agent also names torch's rendezvous events without inspect.stack()
(agent.name_rendezvous_events_cheaply): the same names, without a walk of sys.modules
per frame.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

AGENT = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time
    from labutils.runtime import agent, worker

    def raising(signum, frame):  # what torchrun's agent installs
        raise RuntimeError(f"the agent's handler ran in {os.getpid()}")

    signal.signal(signal.SIGTERM, raising)
    if sys.argv[1] == "held":
        agent.hold_signals_across_fork()

    def rank(case):
        if case == "stopped":
            os.kill(os.getpid(), signal.SIGTERM)  # the stop comes before the reset
        worker.fresh_start()
        if case == "own fork":  # a DataLoader worker of the rank: SIGTERM ends it at once
            child = os.fork()
            if child == 0:
                time.sleep(30)
                os._exit(0)
            os.kill(child, signal.SIGTERM)
            _, status = os.waitpid(child, 0)
            print("own fork", os.WTERMSIG(status) if os.WIFSIGNALED(status) else status)
        print("rank went on", flush=True)

    process = multiprocessing.get_context("fork").Process(target=rank, args=(sys.argv[2],))
    process.start()
    process.join(60)
    print("exitcode", process.exitcode)
    # the agent's own signals are its own again once the fork is done
    print("agent mask", sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
""")


def _agent(held: str, case: str) -> str:
    done = subprocess.run([sys.executable, "-c", AGENT, held, case], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_a_rank_stopped_before_its_reset_dies_of_the_signal_as_a_cold_rank_does():
    out = _agent("held", "stopped")
    assert f"exitcode {-signal.SIGTERM}" in out, out
    assert "the agent's handler ran" not in out and "rank went on" not in out, out
    assert "agent mask []" in out, out


def test_without_the_hold_the_agents_handler_runs_in_the_rank():
    """What the hold is for: the same stop, forked without it."""
    out = _agent("plain", "stopped")
    assert "the agent's handler ran" in out and "exitcode 1" in out, out


@pytest.mark.parametrize("case", ["not stopped", "own fork"])
def test_a_rank_not_stopped_runs_with_every_signal_let_in(case):
    out = _agent("held", case)
    assert "rank went on" in out and "exitcode 0" in out, out
    if case == "own fork":
        assert f"own fork {signal.SIGTERM.value}" in out, out


def test_rendezvous_events_get_the_names_torch_gives_them_without_inspect_stack(monkeypatch):
    """torch names each rendezvous event after the method that recorded it (the caller of
    `_record`), by inspect.stack(); the agent's replacement reads the same frame."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from labutils.runtime import agent

    torchs = dynamic_rendezvous.get_method_name
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", torchs)  # put back afterwards
    agent.name_rendezvous_events_cheaply()
    cheap = dynamic_rendezvous.get_method_name
    assert cheap is not torchs

    def _record(name_of):   # as torch's _record: the name is its caller's
        return name_of()

    def _add_to_participants(name_of):
        return _record(name_of)

    def deep(name_of, depth):
        return name_of(depth=depth)

    assert _add_to_participants(torchs) == _add_to_participants(cheap) == "_add_to_participants"
    assert deep(torchs, 1) == deep(cheap, 1) == "deep"
    assert deep(torchs, 10_000) == deep(cheap, 10_000) == "no_method_name"

    def refused(*args, **kwargs):
        raise AssertionError("inspect.stack() called")

    monkeypatch.setattr(inspect, "stack", refused)
    assert _add_to_participants(cheap) == "_add_to_participants"
