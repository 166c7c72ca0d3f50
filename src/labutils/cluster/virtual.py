"""A virtual cluster on this machine: N hosts joined by a switch, each host's link
capped at a chosen rate, so a multi-node job's communication waits on a wire.

Why: on one machine over loopback, gloo's communication is CPU work that competes
with the ranks' computation for the same cores, so what makes distributed training
fast on a cluster (communication hidden behind computation, rings limited by link
bandwidth) cannot show. Network namespaces give each host its own interfaces;
veth pairs into a bridge (the switch, in a namespace of its own) make the cables;
a traffic-control HTB class on both ends of each cable caps it in both directions.
The kernel has no netem here, so links add bandwidth limits, not latency. How the
hosts are built, named and cleaned up is in labutils.cluster.netns; rates and the
measurement of a link in labutils.cluster.links.

Without root (or without the `ip` command) every host is this machine's loopback and
the cluster says so (mode "loopback", reason).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

from labutils.cluster.links import measure_link, parse_rate, rate_text
from labutils.cluster.netns import (
    build_hosts,
    cap_links,
    delete_hosts,
    host_names,
    in_namespace,
    link_counters,
)
from labutils.errors import LaunchConfigError, whole_number

if TYPE_CHECKING:
    from labutils.run.display import Display
    from labutils.run.result import RunResult

MAX_HOSTS = 8  # a bridge takes more; the 2-core machines the course targets run out first


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
    interfaces: Sequence[str | None] = field(default_factory=list)  # each host's end of its link
    namespaces: list[str | None] = field(default_factory=list)  # None: the caller's own
    switch: str | None = None
    link: dict | None = None
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
        """Bytes and packets through host's end of its link ({} on loopback).

        Args:
            host: which host, 0 to hosts-1.
        """
        if self.mode != "namespaces":
            return {}
        return link_counters(self.namespaces[host], str(self.interfaces[host]))

    def command(self, host: int, argv: list[str]) -> list[str]:
        """argv run on host (inside its namespace for hosts 1..N-1).

        Args:
            host: which host, 0 to hosts-1.
            argv: the command.
        """
        return in_namespace(self.namespaces[host] if self.mode == "namespaces" else None, argv)

    # ---------------------------------------------------------------- the links
    def set_link(self, link: str | int | float | None, *, measure: bool = True) -> dict | None:
        """Cap every host's link at rate link in both directions (None: uncap), then
        measure it from host 1 to host 0 unless measure=False. Returns self.link.

        Args:
            link: the rate in tc's units ("400mbit") or bits per second; None: uncapped.
            measure: measure the link once capped (about two seconds).
        """
        rate = None if link is None else parse_rate(link)
        self.link = None
        if self.mode != "namespaces" or self.hosts < 2:
            return None
        cap_links(rate, switch=str(self.switch), namespaces=self.namespaces,
                  interfaces=cast(list[str], self.interfaces))  # names, in namespaces mode
        if rate is not None:
            self.link = {"rate_bps": rate}
            if measure:
                self.link.update(self.measure())
        return self.link

    def measure(self, *, seconds: float = 2.0, rounds: int = 50) -> dict:
        """Measure the link between host 1 and host 0 for real: TCP throughput from
        host 1 to host 0 for `seconds` (the rate of its best quarter second), then the
        median round trip of one byte.
        Returns {"measured_bps", "rtt_ms"}.

        Args:
            seconds: how long host 1 sends.
            rounds: how many one-byte round trips.
        """
        if self.mode != "namespaces" or self.hosts < 2:
            raise RuntimeError("only a cluster of 2+ hosts in namespaces has a link to measure")
        return measure_link(self.addresses[0], on_sender=functools.partial(self.command, 1),
                            seconds=seconds, rounds=rounds)

    # ------------------------------------------------------------------ running
    def launch(self, script: str | os.PathLike, nproc: int = 1, *, rdzv_id: str | None = None,
               log_dir: str | os.PathLike | None = None, args: Sequence[str] = (),
               env: dict[str, str] | None = None, display: str | Display = "auto",
               node_timeout: float = 30.0, **launch_kwargs) -> RunResult:
        """Run script as a job of one node per host, nproc ranks per node (global rank
        = host * nproc + local rank); returns node 0's RunResult, which shows every
        rank (the nodes share the run folder) and carries result.cluster. A job that
        may restart (max_restarts) meets through c10d at host 0, each host giving its
        own address, and torchrun numbers the nodes (in the order of their addresses).

        Node 0 runs here through launch(); nodes 1..N-1 through `labutils launch` on
        their hosts, with the same nproc, args, env, backend, hang_timeout, timeout
        and max_restarts. They end with this process whatever happens; after node 0
        returns they have node_timeout seconds to finish writing before they are
        stopped. Other keyword arguments go to launch() of node 0.

        Args:
            script: the training script.
            nproc: ranks per node.
            rdzv_id: the job's rendezvous id; default: the script's name and a random tag.
            log_dir: where the run folder goes (launch()'s log_dir).
            args: the script's own arguments.
            env: extra environment variables for every rank.
            display: launch()'s display ("auto", "text", "none" or a Display), for node
                0's view of every rank.
            node_timeout: seconds nodes 1..N-1 get to finish after node 0 returned.
            **launch_kwargs: the rest of launch()'s options.
        """
        from labutils.run.launcher import launch, prepare
        from labutils.run.spec import runs_root
        from labutils.runtime import runfiles
        from labutils.runtime.procs import claim_port

        if self._closed:
            raise RuntimeError("this cluster is closed; make a new one with virtual_cluster()")
        if self.hosts == 1:  # one machine: a plain run, on this namespace
            result = launch(script, nproc, log_dir=log_dir, args=args, env=env,
                            display=display, **launch_kwargs)
            result.cluster = self.summary()
            return result
        rdzv_id = rdzv_id or f"{Path(str(script)).stem}-{uuid.uuid4().hex[:8]}"
        port = claim_port(self.addresses[0])  # claimed until the job is over
        endpoint = f"{self.addresses[0]}:{port.port}"
        root = runs_root(log_dir).resolve()
        ranked = not launch_kwargs.get("max_restarts")
        if not ranked:
            # c10d, node 0 hosting the rendezvous: said, not found out (torchrun would look
            # its host up by the machine's name, which does not resolve in a namespace)
            conf = launch_kwargs.get("rdzv_conf") or {}
            launch_kwargs = {**launch_kwargs, "rdzv_conf": {**conf, "is_host": "true"}}
        job = prepare(script, nproc, node_rank=0 if ranked else None, display=display,  # checks input
                      env=self._node_env(0, env, not ranked), nnodes=self.hosts, rdzv_endpoint=endpoint,
                      rdzv_id=rdzv_id, log_dir=root, args=args, **launch_kwargs)
        if not ranked:
            launch_kwargs = {**launch_kwargs, "rdzv_conf": {**conf, "is_host": "false"}}
        # one line for the whole cluster, not node 0's rendezvous address and interface
        job.node_notes = False
        job.notes.append(f"virtual cluster: {self.describe()}")
        nodes: list[tuple[subprocess.Popen, IO[bytes]]] = []
        try:
            for host in range(1, self.hosts):
                words = node_launch_words(script, nproc, hosts=self.hosts, host=host, ranked=ranked,
                                          endpoint=endpoint, rdzv_id=rdzv_id, log_dir=root,
                                          args=args, launch_kwargs=launch_kwargs)
                out = open(job.run_dir / f"node{host}.out", "wb")  # noqa: SIM115 - closed below
                proc = subprocess.Popen(
                    self.command(host, words), stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, **self._node_env(host, env, not ranked),
                         runfiles.ENV_DIE_WITH: str(os.getpid())})
                nodes.append((proc, out))
                threading.Thread(target=watch_node, args=(proc, job.run_dir, f"node{host}"),
                                 name=f"labutils-node{host}", daemon=True).start()
            result = job.run()
            result.cluster = self.summary()
            if self.mode == "namespaces":  # the summary on disk carries the link too
                result.write_json(runfiles.node_summary_path(job.run_dir, job.token))
            return result
        finally:
            _end_nodes(nodes, node_timeout)
            port.release()

    def _node_env(self, host: int, env: dict | None, c10d: bool = False) -> dict[str, str]:
        """The ranks' environment on host: labutils.dist.link_bytes() reads the link's
        name; every host is this machine, so its ranks share its GPUs with the other
        hosts' (labutils.dist.init() counts them all before choosing nccl)."""
        from labutils.runtime import runfiles

        name = self.interfaces[host] if self.mode == "namespaces" else None
        link = {runfiles.ENV_LINK: name} if name else {}
        # c10d: the address torchrun gives for this host (rendezvous and MASTER_ADDR); its
        # own guess, the machine's name, reaches no other host
        local = {"PET_LOCAL_ADDR": self.addresses[host]} if c10d else {}
        return {**(env or {}), **link, **local, runfiles.ENV_LOCAL_AGENT: f"{host}/{self.hosts}"}

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Delete the cluster's namespaces (and with them every cable and qdisc)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        delete_hosts(self.switch, self.namespaces)

    def __enter__(self) -> VirtualCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def node_launch_words(script: str | os.PathLike, nproc: int, *, hosts: int, host: int,
                      endpoint: str, rdzv_id: str, log_dir: Path, args: Sequence,
                      launch_kwargs: dict, ranked: bool = True) -> list[str]:
    """The `labutils launch` command that node `host` (1..hosts-1) of a job on a virtual
    cluster runs on its host: node 0's nproc, args and other launch() options, the
    rendezvous at node 0, the shared run folder (words from the one table of launch
    options, labutils.run.options).

    Args:
        script: the training script.
        nproc: ranks per node.
        hosts: nodes in the job, one per host.
        host: this node's rank.
        endpoint: node 0's rendezvous "ADDRESS:PORT".
        rdzv_id: the job's rendezvous id.
        log_dir: the runs folder every node writes into.
        args: the script's own arguments.
        launch_kwargs: node 0's other launch() options, passed on as they are.
        ranked: give the node its rank (torchrun's static rendezvous); False for a job
            that may restart, which meets through c10d (VirtualCluster.launch).
    """
    from labutils.run.options import node_words  # the run layer, imported back only here

    return [sys.executable, "-m", "labutils.cli", *node_words(
        script=str(Path(str(script)).resolve()), nproc=nproc, args=list(args), nnodes=hosts,
        node_rank=host if ranked else None, rdzv_endpoint=endpoint, rdzv_id=rdzv_id, log_dir=str(log_dir),
        **launch_kwargs)]


def _end_nodes(nodes: list[tuple[subprocess.Popen, IO[bytes]]], node_timeout: float) -> None:
    """Give the other nodes' launchers node_timeout seconds in all, then stop them."""
    from labutils.runtime.procs import stop_processes

    deadline = time.monotonic() + node_timeout
    for proc, out in nodes:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_processes([proc.pid])
            proc.wait()
        out.close()


def watch_node(proc: subprocess.Popen, run_dir: Path, token: str) -> None:
    """A node's launcher that ends before its agent ever ran (bad input, no namespace,
    a crash) would leave node 0 waiting at the rendezvous: end the job (stop.json)
    and say where that node's output is.

    Args:
        proc: the node's launcher.
        run_dir: the job's run folder.
        token: the node's name in it ("node1": node1.out, done-node1).
    """
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
    if not whole_number(hosts) or not 1 <= hosts <= MAX_HOSTS:
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
    switch, namespaces, interfaces = host_names(hosts)
    cluster = VirtualCluster(hosts=hosts, mode="namespaces", switch=switch,
                             namespaces=namespaces, interfaces=interfaces)
    atexit.register(cluster.close)
    try:
        cluster.addresses = build_hosts(switch=switch, namespaces=namespaces,
                                        interfaces=interfaces)
        if link is not None:
            cluster.set_link(link)
    except (OSError, subprocess.SubprocessError) as exc:
        cluster.close()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return _loopback(hosts, f"could not make network namespaces ({first}); every host "
                                "is this machine's loopback instead")
    return cluster
