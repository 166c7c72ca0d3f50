"""A virtual cluster on this machine: N hosts joined by a switch, each host's link
capped at a chosen rate, so a multi-node job's communication waits on a wire.

Why: on one machine over loopback, gloo's communication is CPU work that competes
with the ranks' computation for the same cores, so what makes distributed training
fast on a cluster (communication hidden behind computation, rings limited by link
bandwidth) cannot show. Network namespaces give each host its own interfaces;
veth pairs into a bridge (the switch, in a namespace of its own) make the cables;
a traffic-control HTB class on both ends of each cable caps it in both directions.
The kernel has no netem here, so links add bandwidth limits, not latency.

Layout of a cluster of N hosts (names carry the owner's pid, see clean_stale()):

    host 0  = the caller's own network namespace (the notebook), interface lu<tag>h0
    host k  = namespace labutils-<pid>-<tag>-h<k>, interface lu<tag>h<k>
    switch  = namespace labutils-<pid>-<tag>-sw, bridge br0, one port s<k> per host

Deleting the switch namespace deletes every cable (a veth pair dies with either end),
so nothing is left in the caller's namespace; the host namespaces are deleted too.
Without root (or without the `ip` command) every host is this machine's loopback and
the cluster says so (mode "loopback", reason).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from labutils.errors import LaunchConfigError

MAX_HOSTS = 8  # a bridge takes more; the 2-core machines the course targets run out first
PREFIX = "labutils-"
SUBNETS = ipaddress.ip_network("10.214.0.0/16")  # one /24 per cluster
LOCK_PATH = Path("/run/lock/labutils-cluster.lock")
_NAME = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]+)-(sw|h\d+)$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_rate(link: str | int | float) -> int:
    """A link rate in bits per second from "400mbit", "1gbit", "200M" or a number.

    tc's units: "bit" is bits per second, "bps" bytes per second (so "50mbps" is
    400 Mbit/s). Raises LaunchConfigError for anything else.
    """
    if isinstance(link, bool) or not isinstance(link, (str, int, float)):
        raise LaunchConfigError("link", expected='a rate such as "400mbit" or "1gbit"',
                                given=repr(link), fix='pass link="400mbit" (bits per second)')
    if isinstance(link, (int, float)):
        bits = float(link)
    else:
        m = _RATE.match(link)
        if not m:
            raise LaunchConfigError("link", expected='a rate such as "400mbit" or "1gbit"',
                                    given=repr(link),
                                    fix='a number with kbit, mbit or gbit, e.g. "200mbit"')
        bits = float(m.group(1)) * _UNIT[m.group(2).lower()]
        if (m.group(3) or "").lower() == "bps":
            bits *= 8
    if not 10**5 <= bits <= 10**11:
        raise LaunchConfigError("link", expected="a rate between 100kbit and 100gbit",
                                given=repr(link), fix='e.g. link="400mbit"')
    return int(bits)


def rate_text(bits_per_s: float) -> str:
    """400000000 -> "400 Mbit/s"."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            value = bits_per_s / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{bits_per_s:.0f} bit/s"


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


def _namespaces() -> list[str]:
    try:
        out = _ip("-j", "netns", "list")
    except (OSError, subprocess.SubprocessError):
        return []
    return [entry["name"] for entry in json.loads(out or "[]")]


def _pids_in(namespace: str) -> list[int]:
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
    for name in _namespaces():
        m = _NAME.match(name)
        if m:
            owners.setdefault((m.group(1), m.group(2)), []).append(name)
    deleted = []
    for (pid, _tag), names in owners.items():
        if int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        if any(_pids_in(n) for n in names):  # its ranks are still dying: next time
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


# ---------------------------------------------------------- measuring a link
# Runs in host 1's namespace with a bare interpreter (no torch, no labutils): sends
# for SECONDS on one connection, then bounces one byte ROUNDS times on a second one.
_SENDER = """
import socket, sys, time
host, port, seconds, rounds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
bulk = socket.create_connection((host, port), timeout=30)
block = bytes(1 << 18)
end = time.monotonic() + seconds
while time.monotonic() < end:
    bulk.sendall(block)
bulk.shutdown(socket.SHUT_WR)
bulk.recv(1)  # host 0 has counted every byte
bulk.close()
ping = socket.create_connection((host, port), timeout=30)
ping.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(rounds):
    t = time.perf_counter()
    ping.sendall(b"x")
    ping.recv(1)
    times.append(time.perf_counter() - t)
print(" ".join(f"{t:.9f}" for t in times))
"""


def _receive(server: socket.socket, rounds: int, out: dict) -> None:
    """Host 0's side of a measurement: count the bulk bytes, then echo the pings."""
    try:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            total, first, last = 0, None, None
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    break
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    total += len(data)  # bytes that arrived after the first read
                last = now
            out["bits_per_s"] = total * 8 / (last - first) if first and last > first else 0.0
            conn.sendall(b"k")
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds):
                if conn.recv(1) == b"":
                    break
                conn.sendall(b"x")
    except OSError as exc:
        out["error"] = str(exc)


# --------------------------------------------------------------------- cluster
@dataclass
class VirtualCluster:
    """N hosts for a multi-node job on this machine; see the module docstring.

    mode is "namespaces" (each host a network namespace, traffic between hosts
    crossing the hosts' links) or "loopback" (every host is this machine's loopback;
    reason says why). link is None while unshaped, else {"rate_bps", "measured_bps",
    "rtt_ms"} of the last set_link(). Use it as a context manager or call close();
    it is also closed when the interpreter exits.
    """

    hosts: int
    mode: str = "loopback"
    reason: str = ""
    addresses: list[str] = field(default_factory=list)
    interfaces: list[str | None] = field(default_factory=list)  # each host's end of its link
    namespaces: list[str | None] = field(default_factory=list)  # None: the caller's own
    switch: str | None = None
    link: dict | None = None
    _rate: int | None = None
    _closed: bool = False

    # ---------------------------------------------------------------- reading
    def summary(self) -> dict:
        """What a run on this cluster reports about it (result.cluster, summary.json)."""
        return {"hosts": self.hosts, "mode": self.mode, "reason": self.reason,
                "link": dict(self.link) if self.link else None}

    def describe(self) -> str:
        """One line for a notebook: which mode produced the figures, and the link."""
        hosts = f"{self.hosts} host{'s' if self.hosts != 1 else ''}"
        if self.mode != "namespaces":
            return f"{hosts} on this machine's loopback, links not shaped: {self.reason}"
        if self.hosts == 1:
            return f"{hosts} (no link: its ranks talk locally)"
        if not self.link:
            return f"{hosts} in network namespaces on a bridge, links not capped"
        return (f"{hosts} in network namespaces on a bridge, each host's link capped at "
                f"{rate_text(self.link['rate_bps'])} each way (measured "
                f"{rate_text(self.link['measured_bps'])}, round trip "
                f"{self.link['rtt_ms'] * 1e3:.0f} µs)")

    def counters(self, host: int = 0) -> dict[str, int]:
        """Bytes and packets through host's end of its link ({} on loopback)."""
        if self.mode != "namespaces":
            return {}
        out = _ip("-s", "-j", "link", "show", str(self.interfaces[host]), ns=self.namespaces[host])
        s = json.loads(out)[0]["stats64"]
        return {"tx_bytes": s["tx"]["bytes"], "rx_bytes": s["rx"]["bytes"],
                "tx_packets": s["tx"]["packets"], "rx_packets": s["rx"]["packets"]}

    def command(self, host: int, argv: list[str]) -> list[str]:
        """argv run on host (inside its namespace for hosts 1..N-1)."""
        ns = self.namespaces[host] if self.mode == "namespaces" else None
        return ["ip", "netns", "exec", ns, *argv] if ns else list(argv)

    # ---------------------------------------------------------------- the links
    def set_link(self, link: str | int | float | None, *, measure: bool = True) -> dict | None:
        """Cap every host's link at rate link in both directions (None: uncap), then
        measure it from host 1 to host 0 unless measure=False. Returns self.link."""
        rate = None if link is None else parse_rate(link)
        if self.mode != "namespaces" or self.hosts < 2:
            self._rate, self.link = rate, None
            return None
        for host in range(self.hosts):
            for ns, dev in ((self.namespaces[host], self.interfaces[host]),
                            (self.switch, f"s{host}")):
                subprocess.run(["tc", *(["-n", ns] if ns else []), "qdisc", "del", "dev", dev,
                                "root"], capture_output=True, timeout=20, check=False)
                if rate is None:
                    continue
                _tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10",
                    ns=ns)
                # quantum set explicitly: one class, and HTB's default warns at high rates
                _tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                    "rate", f"{rate}bit", "ceil", f"{rate}bit", "quantum", "60000", ns=ns)
        self._rate = rate
        self.link = None
        if rate is not None:
            self.link = {"rate_bps": rate}
            if measure:
                self.link.update(self.measure())
        return self.link

    def measure(self, *, seconds: float = 1.0, rounds: int = 50) -> dict:
        """Measure the link between host 1 and host 0 for real: TCP throughput from
        host 1 to host 0 for `seconds`, then the median round trip of one byte.
        Returns {"measured_bps", "rtt_ms"}."""
        if self.mode != "namespaces" or self.hosts < 2:
            raise RuntimeError("only a cluster of 2+ hosts in namespaces has a link to measure")
        server = socket.create_server((self.addresses[0], 0))
        port = server.getsockname()[1]
        out: dict = {}
        receiver = threading.Thread(target=_receive, args=(server, rounds, out), daemon=True)
        receiver.start()
        try:
            done = subprocess.run(
                self.command(1, [sys.executable, "-S", "-c", _SENDER, self.addresses[0],
                                 str(port), str(seconds), str(rounds)]),
                capture_output=True, text=True, timeout=seconds + 30)
        finally:
            receiver.join(timeout=10)
            server.close()
        if done.returncode != 0 or "error" in out:
            raise OSError(f"measuring the link failed: {out.get('error') or done.stderr.strip()}")
        rtts = [float(t) for t in done.stdout.split()]
        return {"measured_bps": out.get("bits_per_s", 0.0),
                "rtt_ms": statistics.median(rtts) * 1e3 if rtts else float("nan")}

    # ------------------------------------------------------------------ running
    def launch(self, script, nproc: int = 1, *, rdzv_id: str | None = None, log_dir=None,
               args=(), env=None, display="auto", node_timeout: float = 30.0,
               **launch_kwargs):
        """Run script as a job of one node per host, nproc ranks per node (global rank
        = host * nproc + local rank); returns node 0's RunResult, which shows every
        rank (the nodes share the run folder) and carries result.cluster.

        Node 0 runs here through launch(); nodes 1..N-1 through `labutils launch` on
        their hosts, with the same nproc, args, env, backend, hang_timeout, timeout
        and max_restarts. They end with this process whatever happens; after node 0
        returns they have node_timeout seconds to finish writing before they are
        stopped. Other keyword arguments go to launch() of node 0.
        """
        from labutils.runtime import runfiles
        from labutils.runtime.procs import free_port, stop_processes
        from labutils.run.spec import runs_root
        from labutils.run.launcher import launch, prepare

        if self._closed:
            raise RuntimeError("this cluster is closed; make a new one with virtual_cluster()")
        if self.hosts == 1:  # one machine: a plain run, on this namespace
            result = launch(script, nproc, log_dir=log_dir, args=args, env=env,
                            display=display, **launch_kwargs)
            result.cluster = self.summary()
            return result
        rdzv_id = rdzv_id or f"{Path(str(script)).stem}-{uuid.uuid4().hex[:8]}"
        endpoint = f"{self.addresses[0]}:{free_port(self.addresses[0])}"
        root = runs_root(log_dir).resolve()
        def node_env(host: int) -> dict[str, str]:  # labutils.dist.link_bytes() reads it
            name = self.interfaces[host] if self.mode == "namespaces" else None
            link = {runfiles.ENV_LINK: name} if name else {}
            return {**(env or {}), **link}

        job = prepare(script, nproc, node_rank=0, display=display, env=node_env(0),  # checks input
                      nnodes=self.hosts, rdzv_endpoint=endpoint, rdzv_id=rdzv_id, log_dir=root,
                      args=args, **launch_kwargs)
        job.notes.append(f"virtual cluster: {self.describe()}")
        argv = [sys.executable, "-m", "labutils.run.cli", "launch", "-n", str(nproc),
                "--nnodes", str(self.hosts), "--rdzv-endpoint", endpoint,
                "--rdzv-id", rdzv_id, "--log-dir", str(root)]
        for flag, key in (("--backend", "backend"), ("--hang-timeout", "hang_timeout"),
                          ("--timeout", "timeout"), ("--max-restarts", "max_restarts")):
            if key in launch_kwargs:
                value = launch_kwargs[key]
                argv += [flag, "0" if value is None else str(value)]
        tail = [str(Path(str(script)).resolve()), "--", *map(str, args)]
        nodes: list[tuple[subprocess.Popen, object]] = []
        try:
            for host in range(1, self.hosts):
                out = open(job.run_dir / f"node{host}.out", "wb")  # noqa: SIM115 - closed below
                proc = subprocess.Popen(
                    self.command(host, [*argv, "--node-rank", str(host), *tail]),
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, **node_env(host), runfiles.ENV_DIE_WITH: str(os.getpid())})
                nodes.append((proc, out))
                threading.Thread(target=watch_node, args=(proc, job.run_dir, f"node{host}"),
                                 name=f"labutils-node{host}", daemon=True).start()
            result = job.run()
            result.cluster = self.summary()
            if self.mode == "namespaces":  # the summary on disk carries the link too
                result.write_json(runfiles.node_summary_path(job.run_dir, job.token))
            return result
        finally:
            deadline = time.monotonic() + node_timeout
            for proc, out in nodes:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    stop_processes([proc.pid])
                    proc.wait()
                out.close()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Delete the cluster's namespaces (and with them every cable and qdisc)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        if self.switch:
            _delete_namespace(self.switch)
        for ns in self.namespaces:
            if ns:
                _delete_namespace(ns)

    def __enter__(self) -> VirtualCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _loopback(hosts: int, reason: str) -> VirtualCluster:
    return VirtualCluster(hosts=hosts, mode="loopback", reason=reason,
                          addresses=["127.0.0.1"] * hosts, interfaces=[None] * hosts,
                          namespaces=[None] * hosts)


def virtual_cluster(hosts: int = 2, *, link: str | int | float | None = None) -> VirtualCluster:
    """N hosts on a switch, each host's link capped at `link` (e.g. "400mbit") in both
    directions, measured once made; network namespaces when this process may make
    them (root, CAP_NET_ADMIN, the ip and tc commands of iproute2), else loopback.

    Args:
        hosts: how many hosts, 1 to MAX_HOSTS; host 0 is this process's own network.
        link: the rate of every host's link (tc units: "400mbit", "1gbit"), or None
            for links as fast as the machine can copy.
    """
    if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
        raise LaunchConfigError("hosts", expected=f"an int from 1 to {MAX_HOSTS}",
                                given=repr(hosts), fix="e.g. virtual_cluster(2, link=\"400mbit\")")
    if link is not None:
        parse_rate(link)  # a bad rate fails before anything is made
    if os.geteuid() != 0:
        return _loopback(hosts, "network namespaces need root (CAP_NET_ADMIN); every host "
                                "is this machine's loopback instead")
    missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
    if missing:
        return _loopback(hosts, f"the {' and '.join(missing)} command (Debian package iproute2) "
                                "is missing; every host is this machine's loopback instead")
    tag = uuid.uuid4().hex[:6]
    base = f"{PREFIX}{os.getpid()}-{tag}"
    cluster = VirtualCluster(hosts=hosts, mode="namespaces", switch=f"{base}-sw",
                             namespaces=[None] + [f"{base}-h{k}" for k in range(1, hosts)],
                             interfaces=[f"lu{tag}h{k}" for k in range(hosts)])
    atexit.register(cluster.close)
    try:
        with _creation_lock():
            clean_stale()
            net = _free_subnet()
            cluster.addresses = [str(net[k + 1]) for k in range(hosts)]
            _ip("netns", "add", cluster.switch)
            _ip("link", "set", "lo", "up", ns=cluster.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=cluster.switch)
            _ip("link", "set", "br0", "up", ns=cluster.switch)
            # torch's sockets are dual-stack: peers show up as ::ffff:a.b.c.d, and a
            # name that /etc/hosts lacks becomes a DNS lookup (and a warning) per connection
            names = "".join(f"{a} node{k}\n::ffff:{a} node{k}\n"
                            for k, a in enumerate(cluster.addresses))
            for k in range(hosts):
                ns, dev = cluster.namespaces[k], cluster.interfaces[k]
                if ns:
                    _ip("netns", "add", ns)
                    _ip("link", "set", "lo", "up", ns=ns)
                    etc = Path("/etc/netns") / ns
                    etc.mkdir(parents=True, exist_ok=True)
                    (etc / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")
                _ip("link", "add", dev, "type", "veth", "peer", "name", f"s{k}",
                    "netns", cluster.switch, ns=ns)
                _ip("link", "set", f"s{k}", "master", "br0", "up", ns=cluster.switch)
                _ip("addr", "add", f"{cluster.addresses[k]}/{net.prefixlen}", "dev", dev, ns=ns)
                _ip("link", "set", dev, "up", ns=ns)
        if link is not None:
            cluster.set_link(link)
    except (OSError, subprocess.SubprocessError) as exc:
        cluster.close()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return _loopback(hosts, f"could not make network namespaces ({first}); every host "
                                "is this machine's loopback instead")
    return cluster


def watch_node(proc: subprocess.Popen, run_dir: Path, token: str) -> None:
    """A node's launcher that ends before its agent ever ran (bad input, no namespace,
    a crash) would leave node 0 waiting at the rendezvous: end the job (stop.json)
    and say where that node's output is."""
    from labutils.runtime import runfiles

    code = proc.wait()
    if runfiles.node_done_path(run_dir, token).exists() or runfiles.stop_path(run_dir).exists():
        return  # it ran: the launchers' own files tell node 0 how it ended
    tail = ""
    try:
        lines = (run_dir / f"{token}.out").read_text(errors="replace").strip().splitlines()
        tail = f": {lines[-1].strip()}" if lines else ""
    except OSError:
        pass
    path = runfiles.stop_path(run_dir)
    runfiles.write_atomic(path, json.dumps({"by": f"{token}'s launcher", "reason": f"it exited "
                                            f"with status {code} before its ranks started{tail}"}))
