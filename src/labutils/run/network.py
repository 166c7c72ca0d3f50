"""Networking for jobs across machines: which interface the ranks should use.
(Machines made of network namespaces, to run such a job on one host, are in
labutils.cluster.virtual.)

The fact that drives this module (seen with torch 2.13 and gloo):

- gloo picks its interface by resolving the machine's hostname. On a host where
  the name resolves to 127.0.x.1 (the default on Debian, and on every namespace
  of one host) each rank then offers a loopback address to its peers, and ranks
  of another machine fail with "connectFullMesh ... Connection refused". Setting
  GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for nccl) to the interface that reaches
  the rendezvous endpoint fixes it; route_interface() finds that interface.
"""

from __future__ import annotations

import ipaddress
import socket

from labutils.errors import LaunchConfigError

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def resolve_host(host: str) -> str:
    """An IPv4 address for host (an address stays as it is).

    Args:
        host: a name or an address.
    """
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds address, or None.

    Args:
        address: an IPv4 address.
    """
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def route_interface(endpoint: str) -> tuple[str | None, str | None]:
    """(interface, local address) this machine uses to reach endpoint "HOST:PORT".

    No packet is sent: connecting a UDP socket only asks the kernel for the route.
    (None, None) when the host cannot be resolved or reached.

    Args:
        endpoint: "HOST:PORT".
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

    Args:
        endpoint: the rendezvous "HOST:PORT".
        env: the variables the ranks get already.
    """
    if any(var in env for var in IFNAME_VARS):
        chosen = ", ".join(f"{v}={env[v]}" for v in IFNAME_VARS if v in env)
        return {}, f"network interface as given: {chosen}"
    name, local = route_interface(endpoint)
    if name is None or local is None:  # local is None only with name
        return {}, (f"could not tell which interface reaches {endpoint}; if ranks of other "
                    "machines cannot connect, set GLOO_SOCKET_IFNAME (env=...)")
    if ipaddress.ip_address(local).is_loopback:
        return {}, None
    return {var: name for var in IFNAME_VARS}, \
        f"ranks talk over {name} ({local}): GLOO_SOCKET_IFNAME={name}"


def check_endpoint_host(endpoint: str) -> None:
    """A clear error before any process starts when the endpoint's host cannot be resolved.

    Args:
        endpoint: the rendezvous "HOST:PORT".
    """
    host = endpoint.rpartition(":")[0].strip("[]")
    try:
        resolve_host(host)
    except OSError:
        raise LaunchConfigError("rdzv_endpoint", expected="a host this machine can resolve",
                         given=endpoint,
                         fix="use node 0's IP address, or a name in /etc/hosts or DNS") from None
