"""The plumbing of a virtual cluster: hosts made of network namespaces, cables made of
veth pairs into a bridge, links capped by traffic-control HTB classes, and the cleaning
up of what dead owners left. The VirtualCluster that runs jobs on them is in
labutils.cluster.virtual.

Layout of a cluster of N hosts (names carry the owner's pid, see clean_stale()):

    host 0  = the caller's own network namespace (the notebook), interface lu<tag>h0
    host k  = namespace labutils-<pid>-<tag>-h<k>, interface lu<tag>h<k>
    switch  = namespace labutils-<pid>-<tag>-sw, bridge br0, one port s<k> per host

Each host reaches the cluster's subnet through a route of its own, which also sets the
TCP congestion control of every connection between hosts (TCP_CONGESTION).

Deleting the switch namespace deletes every cable (a veth pair dies with either end),
so nothing is left in the caller's namespace; the host namespaces are deleted too.
Everything here needs root (CAP_NET_ADMIN) and the ip and tc commands of iproute2;
each step raises OSError (or a subprocess error) when the kernel refuses.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

PREFIX = "labutils-"
SUBNETS = ipaddress.IPv4Network("10.214.0.0/16")  # one /24 per cluster
LOCK_PATH = Path("/run/lock/labutils-cluster.lock")
# TCP between the hosts uses cubic, Linux's usual default, whatever this machine's
# default is. With BBR (the default of some machines) every connection probes its
# minimum round trip every 10 s by cutting its window to 4 packets for 200 ms: on a
# capped link about one call in four of a ring's all_reduce came out 120-250 ms slow.
TCP_CONGESTION = "cubic"
_NAME = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]+)-(sw|h\d+)$")


# ------------------------------------------------------------------- commands
def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise OSError(done.stderr.strip() or f"{' '.join(argv)} failed")
    return done.stdout


def _ip(*args: str, ns: str | None = None) -> str:
    return _run(["ip", *(["-n", ns] if ns else []), *args])


def _tc(*args: str, ns: str | None = None) -> str:
    return _run(["tc", *(["-n", ns] if ns else []), *args])


def in_namespace(namespace: str | None, argv: list[str]) -> list[str]:
    """argv run inside namespace (None: as it is, in the caller's own).

    Args:
        namespace: a network namespace's name, or None.
        argv: the command.
    """
    return ["ip", "netns", "exec", namespace, *argv] if namespace else list(argv)


def list_namespaces() -> list[str]:
    """The names of every network namespace on this machine ([] where ip cannot say)."""
    try:
        out = _ip("-j", "netns", "list")
    except (OSError, subprocess.SubprocessError):
        return []
    return [entry["name"] for entry in json.loads(out or "[]")]


def pids_in(namespace: str) -> list[int]:
    """The pids of the processes inside a network namespace (none if it is gone)."""
    try:
        return [int(p) for p in _run(["ip", "netns", "pids", namespace]).split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def _delete_namespace(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=20, check=False)
    shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def clean_stale() -> list[str]:
    """Delete what clusters of dead callers left (a caller killed with -9 cannot clean
    up): every labutils namespace whose owner pid is gone and inside which no process
    runs any more. Returns the names deleted. Called whenever a cluster is made."""
    from labutils.runtime.procs import pid_alive

    owners: dict[tuple[str, str], list[str]] = {}
    for name in list_namespaces():
        m = _NAME.match(name)
        if m:
            owners.setdefault((m.group(1), m.group(2)), []).append(name)
    deleted = []
    for (pid, _tag), names in owners.items():
        if int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        if any(pids_in(n) for n in names):  # its ranks are still dying: next time
            continue
        for name in sorted(names, key=lambda n: not n.endswith("-sw")):  # the switch first
            _delete_namespace(name)
            deleted.append(name)
    return deleted


@contextlib.contextmanager
def _creation_lock():
    """One cluster is made at a time on this machine (they pick free subnets)."""
    import fcntl

    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUBNETS that no interface of this namespace uses."""
    import psutil

    used = {ipaddress.ip_address(a.address) for addrs in psutil.net_if_addrs().values()
            for a in addrs if a.family == socket.AF_INET}
    subnets = list(SUBNETS.subnets(new_prefix=24))
    start = os.getpid() % len(subnets)
    for k in range(len(subnets)):
        net = subnets[(start + k) % len(subnets)]
        if not any(a in net for a in used):
            return net
    raise OSError(f"no free /24 left in {SUBNETS}")


# ----------------------------------------------------------- building hosts
def host_names(hosts: int) -> tuple[str, list[str | None], list[str]]:
    """New names for a cluster of this process: (switch, each host's namespace (None
    for host 0, the caller's own), each host's interface). Nothing is made yet.

    Args:
        hosts: how many hosts.
    """
    tag = uuid.uuid4().hex[:6]
    base = f"{PREFIX}{os.getpid()}-{tag}"
    return (f"{base}-sw", [None] + [f"{base}-h{k}" for k in range(1, hosts)],
            [f"lu{tag}h{k}" for k in range(hosts)])


def build_hosts(*, switch: str, namespaces: list[str | None], interfaces: list[str]) -> list[str]:
    """Make the switch and the hosts, each host's interface cabled to a port of the
    bridge, with an address of a free subnet; first delete what dead owners left.
    Returns each host's address. On an error the caller deletes what was made
    (delete_hosts), since part of it may be.

    Args:
        switch: the switch namespace's name (host_names()).
        namespaces: each host's namespace, None for the caller's own.
        interfaces: each host's end of its cable.
    """
    with _creation_lock():
        clean_stale()
        net = _free_subnet()
        addresses = [str(net[k + 1]) for k in range(len(namespaces))]
        _ip("netns", "add", switch)
        _ip("link", "set", "lo", "up", ns=switch)
        _ip("link", "add", "br0", "type", "bridge", ns=switch)
        _ip("link", "set", "br0", "up", ns=switch)
        # torch's sockets are dual-stack: peers show up as ::ffff:a.b.c.d, and a
        # name that /etc/hosts lacks becomes a DNS lookup (and a warning) per connection
        names = "".join(f"{a} node{k}\n::ffff:{a} node{k}\n" for k, a in enumerate(addresses))
        for k, (ns, dev) in enumerate(zip(namespaces, interfaces)):
            if ns:
                _ip("netns", "add", ns)
                _ip("link", "set", "lo", "up", ns=ns)
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")
            _ip("link", "add", dev, "type", "veth", "peer", "name", f"s{k}", "netns", switch, ns=ns)
            _ip("link", "set", f"s{k}", "master", "br0", "up", ns=switch)
            # the subnet's route is ours, not the kernel's, to carry the congestion control
            _ip("addr", "add", f"{addresses[k]}/{net.prefixlen}", "dev", dev, "noprefixroute", ns=ns)
            _ip("link", "set", dev, "up", ns=ns)
            _ip("route", "add", str(net), "dev", dev, "src", addresses[k],
                "congctl", TCP_CONGESTION, ns=ns)
    return addresses


def delete_hosts(switch: str | None, namespaces: list[str | None]) -> None:
    """Delete the switch (and with it every cable and qdisc), then the hosts' namespaces.

    Args:
        switch: the switch namespace's name, or None.
        namespaces: each host's namespace, None for the caller's own (left alone).
    """
    if switch:
        _delete_namespace(switch)
    for ns in namespaces:
        if ns:
            _delete_namespace(ns)


# ------------------------------------------------------------------ the links
def cap_links(rate: int | None, *, switch: str, namespaces: list[str | None],
              interfaces: list[str]) -> None:
    """Cap every host's link at rate bits per second in both directions: an HTB class
    on the host's end and on the switch's end of its cable. None: uncapped.

    Args:
        rate: bits per second, or None.
        switch: the switch namespace's name.
        namespaces: each host's namespace, None for the caller's own.
        interfaces: each host's end of its cable.
    """
    for host, (host_ns, host_dev) in enumerate(zip(namespaces, interfaces)):
        for ns, dev in ((host_ns, host_dev), (switch, f"s{host}")):
            subprocess.run(["tc", *(["-n", ns] if ns else []), "qdisc", "del", "dev", dev,
                            "root"], capture_output=True, timeout=20, check=False)
            if rate is None:
                continue
            _tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10", ns=ns)
            # quantum set explicitly: one class, and HTB's default warns at high rates
            _tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                "rate", f"{rate}bit", "ceil", f"{rate}bit", "quantum", "60000", ns=ns)


def link_counters(namespace: str | None, interface: str) -> dict[str, int]:
    """Bytes and packets through an interface, as the kernel counts them.

    Args:
        namespace: where the interface is, None for the caller's own namespace.
        interface: its name.
    """
    out = _ip("-s", "-j", "link", "show", interface, ns=namespace)
    s = json.loads(out)[0]["stats64"]
    return {"tx_bytes": s["tx"]["bytes"], "rx_bytes": s["rx"]["bytes"],
            "tx_packets": s["tx"]["packets"], "rx_packets": s["rx"]["packets"]}
