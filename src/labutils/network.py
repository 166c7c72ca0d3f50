"""Networking for jobs across machines: which interface the ranks should use, and
"machines" made of Linux network namespaces so a multi-node job can run on one host.

Two facts drive this module (both seen with torch 2.13 and gloo):

- gloo picks its interface by resolving the machine's hostname. On a host where
  the name resolves to 127.0.x.1 (the default on Debian, and on every namespace
  of one host) each rank then offers a loopback address to its peers, and ranks
  of another machine fail with "connectFullMesh ... Connection refused". Setting
  GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for nccl) to the interface that reaches
  the rendezvous endpoint fixes it; route_interface() finds that interface.
- A network namespace has its own interfaces, addresses and routes. Two
  namespaces joined by a veth pair behave like two machines on one cable: a
  rank's traffic to the other "machine" leaves through one end of the pair and
  arrives at the other, and the pair's byte counters show it.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from labutils.errors import LaunchConfigError

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def resolve_host(host: str) -> str:
    """An IPv4 address for host (an address stays as it is)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds address, or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def route_interface(endpoint: str) -> tuple[str | None, str | None]:
    """(interface, local address) this machine uses to reach endpoint "HOST:PORT".

    No packet is sent: connecting a UDP socket only asks the kernel for the route.
    (None, None) when the host cannot be resolved or reached.
    """
    host = endpoint.rpartition(":")[0].strip("[]")
    try:
        address = resolve_host(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            local = sock.getsockname()[0]
    except OSError:
        return None, None
    return interface_of(local), local


def interface_env(endpoint: str, env: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME for the interface that reaches endpoint,
    unless env already names one; and a line saying what was chosen (None: nothing).

    Loopback is left alone: a job whose endpoint is on this machine's loopback runs
    on this machine only, where gloo's own choice works.
    """
    if any(var in env for var in IFNAME_VARS):
        chosen = ", ".join(f"{v}={env[v]}" for v in IFNAME_VARS if v in env)
        return {}, f"network interface as given: {chosen}"
    name, local = route_interface(endpoint)
    if name is None:
        return {}, (f"could not tell which interface reaches {endpoint}; if ranks of other "
                    "machines cannot connect, set GLOO_SOCKET_IFNAME (env=...)")
    if ipaddress.ip_address(local).is_loopback:
        return {}, None
    return {var: name for var in IFNAME_VARS}, \
        f"ranks talk over {name} ({local}): GLOO_SOCKET_IFNAME={name}"


# ------------------------------------------------------------ virtual machines
@dataclass
class VirtualHosts:
    """Two "machines" on this host: node 0 is the namespace of the caller, node 1 a
    network namespace of its own, joined by a veth pair with an address at each end.

    mode is "namespaces" when that worked, else "loopback" (both nodes share this
    machine's loopback; reason says why namespaces could not be made). Use it as a
    context manager: leaving removes the namespace and the pair.
    """

    mode: str = "loopback"
    reason: str = ""
    addresses: list[str] = field(default_factory=lambda: ["127.0.0.1", "127.0.0.1"])
    interfaces: list[str | None] = field(default_factory=lambda: [None, None])
    namespace: str | None = None
    _made: list = field(default_factory=list)

    def command(self, node: int, argv: list[str]) -> list[str]:
        """argv run on node (inside its namespace for node 1 in "namespaces" mode)."""
        if node == 0 or self.mode != "namespaces":
            return list(argv)
        return ["ip", "netns", "exec", self.namespace, *argv]

    def counters(self, node: int = 0) -> dict[str, int]:
        """Bytes and packets through node's end of the pair ({} in loopback mode)."""
        if self.mode != "namespaces":
            return {}
        stats = Path("/sys/class/net") / str(self.interfaces[0]) / "statistics"
        if node != 0:
            out = _ip(["-n", self.namespace, "-s", "-j", "link", "show", self.interfaces[1]])
            import json

            s = json.loads(out)[0]["stats64"]
            return {"tx_bytes": s["tx"]["bytes"], "rx_bytes": s["rx"]["bytes"],
                    "tx_packets": s["tx"]["packets"], "rx_packets": s["rx"]["packets"]}
        return {k: int((stats / k).read_text()) for k in
                ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}

    def close(self) -> None:
        for undo in reversed(self._made):
            subprocess.run(undo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=10, check=False)
        self._made.clear()
        if self.namespace:
            shutil.rmtree(Path("/etc/netns") / self.namespace, ignore_errors=True)

    def __enter__(self) -> VirtualHosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ip(args: list[str]) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise OSError(done.stderr.strip() or f"ip {' '.join(args)} failed")
    return done.stdout


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 in 10.213.0.0/16 that no interface here uses."""
    import psutil

    used = {ipaddress.ip_address(a.address) for addrs in psutil.net_if_addrs().values()
            for a in addrs if a.family == socket.AF_INET}
    base = ipaddress.ip_network("10.213.0.0/16")
    start = (os.getpid() * 4) % base.num_addresses
    for k in range(base.num_addresses // 4):
        net = ipaddress.ip_network(f"{base[(start + 4 * k) % base.num_addresses]}/30")
        if not any(a in net for a in used):
            return net
    raise OSError("no free /30 left in 10.213.0.0/16")


def virtual_hosts() -> VirtualHosts:
    """Two machines for a 2-node job on this host: namespaces when possible, else loopback.

    Needs root (CAP_NET_ADMIN) and the ip command (Debian package iproute2). The
    namespace gets an /etc/netns/<name>/hosts naming both nodes node0 and node1, so
    torch can resolve the peer's address (`ip netns exec` shows it as /etc/hosts).
    """
    if os.geteuid() != 0:
        return VirtualHosts(reason="network namespaces need root (CAP_NET_ADMIN); "
                                   "both nodes run on this machine's loopback instead")
    if shutil.which("ip") is None:
        return VirtualHosts(reason="the ip command (Debian package iproute2) is missing; "
                                   "both nodes run on this machine's loopback instead")
    tag = uuid.uuid4().hex[:6]
    hosts = VirtualHosts(mode="namespaces", namespace=f"labutils-{tag}",
                         interfaces=[f"lu{tag}a", f"lu{tag}b"])
    a, b = hosts.interfaces
    try:
        net = _free_subnet()
        hosts.addresses = [str(net[1]), str(net[2])]
        _ip(["netns", "add", hosts.namespace])
        hosts._made.append(["ip", "netns", "del", hosts.namespace])
        _ip(["link", "add", a, "type", "veth", "peer", "name", b])
        hosts._made.append(["ip", "link", "del", a])  # deletes both ends
        _ip(["link", "set", b, "netns", hosts.namespace])
        _ip(["addr", "add", f"{hosts.addresses[0]}/30", "dev", a])
        _ip(["link", "set", a, "up"])
        _ip(["-n", hosts.namespace, "addr", "add", f"{hosts.addresses[1]}/30", "dev", b])
        _ip(["-n", hosts.namespace, "link", "set", b, "up"])
        _ip(["-n", hosts.namespace, "link", "set", "lo", "up"])
        etc = Path("/etc/netns") / hosts.namespace
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(
            f"127.0.0.1 localhost\n{hosts.addresses[0]} node0\n{hosts.addresses[1]} node1\n")
    except (OSError, subprocess.SubprocessError) as exc:
        hosts.close()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return VirtualHosts(reason=f"could not make network namespaces ({first}); "
                                   "both nodes run on this machine's loopback instead")
    return hosts


def check_endpoint_host(endpoint: str) -> None:
    """A clear error before any process starts when the endpoint's host cannot be resolved."""
    host = endpoint.rpartition(":")[0].strip("[]")
    try:
        resolve_host(host)
    except OSError:
        raise LaunchConfigError("rdzv_endpoint", expected="a host this machine can resolve",
                         given=endpoint,
                         fix="use node 0's IP address, or a name in /etc/hosts or DNS") from None


def launch_two_nodes(script, nproc: int = 2, *, hosts: VirtualHosts | None = None,
                     rdzv_id: str | None = None, log_dir=None, args=(), env=None,
                     display="auto", node_timeout: float = 30.0, **launch_kwargs):
    """Run script as a 2-node job on virtual hosts: node 1 through `labutils launch`
    in its namespace (or on loopback), node 0 through launch() here, which shows
    every rank of both nodes (they share the run folder) and returns the RunResult.

    hosts: from virtual_hosts() (made and removed here when None). Node 1 gets the
    same nproc, args, env, backend, hang_timeout and timeout; it ends with this
    process whatever happens, and after node 0 returns it has node_timeout seconds
    to finish writing before it is stopped.
    """
    import sys

    from labutils import runfiles
    from labutils._proc import free_port, stop_processes
    from labutils.config import runs_root
    from labutils.launcher import prepare

    own = hosts is None
    hosts = virtual_hosts() if own else hosts
    try:
        rdzv_id = rdzv_id or f"{Path(str(script)).stem}-{uuid.uuid4().hex[:8]}"
        endpoint = f"{hosts.addresses[0]}:{free_port(hosts.addresses[0])}"
        root = runs_root(log_dir).resolve()
        common = dict(nnodes=2, rdzv_endpoint=endpoint, rdzv_id=rdzv_id, log_dir=root,
                      args=args, env=env, **launch_kwargs)
        job = prepare(script, nproc, node_rank=0, display=display, **common)  # checks input
        job.notes.append(
            f"node 1 runs in network namespace {hosts.namespace} ({hosts.addresses[1]}; "
            f"node 0 here is {hosts.addresses[0]}, joined by the veth pair "
            f"{hosts.interfaces[0]}-{hosts.interfaces[1]})" if hosts.mode == "namespaces"
            else f"both nodes on this machine: {hosts.reason}")
        argv = [sys.executable, "-m", "labutils.cli", "launch", "-n", str(nproc),
                "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint,
                "--rdzv-id", rdzv_id, "--log-dir", str(root)]
        for flag, key in (("--backend", "backend"), ("--hang-timeout", "hang_timeout"),
                          ("--timeout", "timeout"), ("--max-restarts", "max_restarts")):
            if key in launch_kwargs:
                value = launch_kwargs[key]
                argv += [flag, "0" if value is None else str(value)]
        argv += [str(Path(str(script)).resolve()), "--", *map(str, args)]
        out = open(job.run_dir / "node1.out", "wb")  # noqa: SIM115 - closed below
        node1 = subprocess.Popen(
            hosts.command(1, argv), stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {}), runfiles.ENV_DIE_WITH: str(os.getpid())})
        import threading

        threading.Thread(target=_watch_node, args=(node1, job.run_dir, "node1"),
                         name="labutils-node1", daemon=True).start()
        try:
            return job.run()
        finally:
            try:
                node1.wait(timeout=node_timeout)
            except subprocess.TimeoutExpired:
                stop_processes([node1.pid])
                node1.wait()
            out.close()
    finally:
        if own:
            hosts.close()


def _watch_node(proc: subprocess.Popen, run_dir: Path, token: str) -> None:
    """A node's launcher that ends before its agent ever ran (bad input, no namespace,
    a crash) would leave node 0 waiting at the rendezvous: end the job (stop.json)
    and say where node 1's output is."""
    import json

    from labutils import runfiles

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
    tmp = path.with_suffix(f".{os.getpid()}.watch.tmp")
    tmp.write_text(json.dumps({"by": f"{token}'s launcher", "reason": f"it exited with status "
                               f"{code} before its ranks started{tail}"}))
    os.replace(tmp, path)
