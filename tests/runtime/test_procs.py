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
