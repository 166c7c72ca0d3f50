"""runtime/procs.py: the rendezvous port a launch picks."""

from __future__ import annotations

import socket

from labutils.runtime import procs


def test_a_free_port_is_free_on_every_address_and_below_the_ephemeral_range():
    low, _ = procs._ephemeral_range()
    ports = {procs.free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), ports
    for port in ports:
        with socket.socket() as store:  # what torchrun's store does with it
            store.bind(("", port))


def test_a_port_taken_on_one_address_is_not_free_for_a_store_on_all_of_them():
    with socket.socket() as other:  # a gloo or kernel listener on loopback
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        assert not procs._bindable(taken, "127.0.0.1")
        assert not procs._bindable(taken, "10.214.97.1")  # another address: still taken


def _draws(monkeypatch, *ports: int) -> None:
    """claim_port's draws come out as `ports`, in this order, then at random."""
    queue = list(ports)
    real = procs.random.randrange
    monkeypatch.setattr(procs.random, "randrange",
                        lambda a, b: queue.pop(0) if queue else real(a, b))


def test_a_port_another_launcher_has_drawn_is_not_drawn_again_before_its_store_binds_it(
        monkeypatch):
    """Two launchers of the suite drew the same free port within a second; the second
    agent found it bound, joined the first run's store as a client, and its ranks were
    ended with the first run (a segfault ending read as SIGTERM). A drawn port is claimed
    until the run that drew it is over."""
    import subprocess
    import sys

    other = subprocess.Popen(
        [sys.executable, "-c", "from labutils.runtime import procs; import sys; "
         "print(procs.free_port(), flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        drawn = int(other.stdout.readline())
        assert procs._bindable(drawn, "127.0.0.1")  # nothing listens on it yet
        _draws(monkeypatch, drawn, drawn)
        mine = procs.claim_port()
        assert mine.port != drawn
    finally:
        other.communicate("")
    _draws(monkeypatch, drawn)  # its holder gone, the port can be drawn again
    with procs.claim_port() as again:
        assert again.port == drawn
    mine.release()


def test_a_claim_is_let_go_when_released_or_dropped(monkeypatch):
    claim = procs.claim_port()
    port = claim.port
    _draws(monkeypatch, port)
    second = procs.claim_port()
    assert second.port != port
    second.release()
    claim.release()
    claim.release()  # twice: nothing more
    _draws(monkeypatch, port)
    dropped = procs.claim_port()
    assert dropped.port == port
    del dropped  # gone with its last reference
    _draws(monkeypatch, port)
    assert procs.claim_port().port == port
