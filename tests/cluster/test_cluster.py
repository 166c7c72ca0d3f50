"""The virtual cluster: N hosts in network namespaces on a bridge, links capped by HTB.

The links are checked for real: the measured rate is near the rate set, an all_reduce
across the hosts cannot beat the cap, and every ending (a run, a failure, an interrupt,
a kill -9 of the caller) leaves no namespace, interface or qdisc behind. Without root
the cluster falls back to loopback (tests/run/test_multinode.py runs a job that way).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from labutils.cluster import clean_stale, parse_rate, rate_text, virtual_cluster
from labutils.cluster.links import arrived_bytes, best_rate
from labutils.cluster.netns import list_namespaces
from labutils.errors import LaunchConfigError

pytestmark = pytest.mark.timeout(240)

PAYLOAD_MIB = 8

JOB = textwrap.dedent(f"""
    import os, sys, time
    import torch
    import torch.distributed as dist
    from labutils.dist import init, report

    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    rank, world, _ = init()
    t = torch.ones({PAYLOAD_MIB} << 18)
    dist.all_reduce(t)  # warm-up: connections made
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(t)
    report(seconds=time.perf_counter() - start, value=t[0].item(),
           ifname=os.environ.get("GLOO_SOCKET_IFNAME"))
    if mode == "fail" and rank == 1:
        raise ValueError("planted failure on rank 1")
    if mode == "wait":
        print("ready", flush=True)
        time.sleep(600)
""")


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return path


def _ours(tag_or_pid: str) -> dict[str, list[str]]:
    """What of a cluster exists: namespaces, links in this namespace, /etc/netns dirs."""
    names = [n for n in list_namespaces() if tag_or_pid in n]
    links = [ln for ln in subprocess.run(["ip", "-o", "link"], capture_output=True,
                                         text=True).stdout.splitlines() if f"lu{tag_or_pid}" in ln]
    etc = [p.name for p in (Path("/etc/netns").glob(f"*{tag_or_pid}*"))]
    return {"namespaces": names, "links": links, "etc": etc}


def _gone(tag: str, within: float = 15.0) -> dict:
    """Wait until nothing of the cluster tagged tag is left (the kernel deletes a
    namespace's interfaces asynchronously); return what is left at the end."""
    deadline = time.monotonic() + within
    while True:
        left = _ours(tag)
        if not any(left.values()) or time.monotonic() > deadline:
            return {k: v for k, v in left.items() if v}
        time.sleep(0.2)


def _tag(cluster) -> str:
    return cluster.switch.split("-")[2]


@pytest.fixture(scope="module")
def namespaces_allowed():
    with virtual_cluster(2) as c:
        if c.mode != "namespaces":
            pytest.skip(f"virtual cluster on loopback here: {c.reason}")


# ----------------------------------------------------------------- no processes
@pytest.mark.parametrize("text, bits", [
    ("400mbit", 400_000_000), ("1gbit", 10**9), ("200Mbit", 200_000_000),
    ("50mbps", 400_000_000), ("1.5gbit", 1_500_000_000), ("800kbit", 800_000),
    (250_000_000, 250_000_000),
])
def test_rates(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["fast", "400", "10bit", "-5mbit", "400 mbit/s", True, None, [1],
                                 "500gbit"])
def test_bad_rate_is_one_line(bad):
    with pytest.raises(LaunchConfigError) as err:
        parse_rate(bad)
    assert err.value.what == "link" and "\n" not in str(err.value)


@pytest.mark.parametrize("hosts", [0, 9, 2.0, True, "2"])
def test_bad_host_count_fails_before_anything_is_made(hosts):
    before = list_namespaces()
    with pytest.raises(LaunchConfigError, match="hosts: expected an int from 1 to 8"):
        virtual_cluster(hosts)
    with pytest.raises(LaunchConfigError, match="link: expected"):
        virtual_cluster(2, link="quick")
    assert list_namespaces() == before


def test_rate_text():
    assert rate_text(400e6) == "400 Mbit/s"
    assert rate_text(1.5e9) == "1.5 Gbit/s"
    assert rate_text(95.6e6) == "95.6 Mbit/s"


def test_a_links_rate_is_its_best_quarter_second():
    """A link idle now and then (its sender or receiver waiting for a core) reads its
    rate where it was kept busy; a span shorter than the window reads as a whole."""
    per_10ms = 48e6 / 100  # bytes in 10 ms at 48 MB/s
    samples, total = [], 0
    for i in range(200):  # 2 s, sampled every 10 ms, with a 100 ms stall in each 500 ms
        samples.append((i * 0.01, total))
        total += 0 if i % 50 < 10 else per_10ms
    assert best_rate(samples, 0.25) == pytest.approx(384e6)
    whole = (samples[-1][1] - samples[0][1]) * 8 / (samples[-1][0] - samples[0][0])
    assert whole < 0.85 * 384e6
    assert best_rate(samples[:10], 0.25) == pytest.approx(0.0)  # nine stalled steps
    assert best_rate(samples[10:20], 0.25) == pytest.approx(384e6)
    assert best_rate(samples[:1], 0.25) == 0.0


def test_the_bytes_that_arrived_are_counted_before_they_are_read():
    """The rate is timed by the kernel's count of arrived bytes: a reader that comes late
    finds them counted already, so its late reads do not look like a burst."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as sender:
        conn, _ = server.accept()
        with conn:
            if arrived_bytes(conn) is None:
                pytest.skip("this kernel does not count a connection's arrived bytes (TCP_INFO)")
            assert arrived_bytes(conn) == 0
            sender.settimeout(10)  # 10 kB fit in any receive window; a surprise is an error
            sender.sendall(bytes(10_000))
            deadline = time.monotonic() + 10
            while arrived_bytes(conn) < 10_000 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert arrived_bytes(conn) == 10_000  # none of it read yet
            got = 0
            while got < 10_000:
                got += len(conn.recv(1 << 20))
            assert arrived_bytes(conn) == 10_000


def test_without_root_it_says_loopback(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    c = virtual_cluster(3, link="200mbit")
    assert (c.mode, c.link, c.addresses) == ("loopback", None, ["127.0.0.1"] * 3)
    assert c.describe().startswith("3 hosts on this machine's loopback, links not shaped: "
                                   "network namespaces need root")
    assert c.summary()["mode"] == "loopback" and c.counters(1) == {}


# ---------------------------------------------------------------- real links
def test_links_are_capped_and_measured(namespaces_allowed):
    with virtual_cluster(3, link="200mbit") as c:
        tag = _tag(c)
        first = c.link
        assert first["rate_bps"] == 200e6
        # HTB shapes what it sends; TCP's headers and acks take a few percent
        assert 0.80 * 200e6 <= first["measured_bps"] <= 1.02 * 200e6, first
        assert 0 < first["rtt_ms"] < 50
        assert "capped at 200 Mbit/s each way (measured" in c.describe()
        faster = c.set_link("400mbit")
        assert 0.80 * 400e6 <= faster["measured_bps"] <= 1.02 * 400e6, faster
        shown = subprocess.run(["tc", "-n", c.switch, "qdisc", "show", "dev", "s2"],
                               capture_output=True, text=True).stdout
        assert "htb" in shown
        assert c.set_link(None) is None
        shown = subprocess.run(["tc", "-n", c.switch, "qdisc", "show", "dev", "s2"],
                               capture_output=True, text=True).stdout
        assert "htb" not in shown
        assert c.measure()["measured_bps"] > 1.5 * 400e6  # uncapped: as fast as memory copies
        assert len(_ours(tag)["namespaces"]) == 3
    assert _gone(tag) == {}


# The congestion control of one end of a TCP connection: the server side (argv: "serve",
# address) prints its port, accepts one connection and prints it; the client side
# (argv: "connect", address, port) connects and prints its own.
_CC_PROBE = """
import socket, sys
def cc(s):
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode()
if sys.argv[1] == "serve":
    server = socket.create_server((sys.argv[2], 0))
    print(server.getsockname()[1], flush=True)
    accepted, _ = server.accept()
    print(cc(accepted), flush=True)
else:
    client = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=20)
    print(cc(client), flush=True)
"""


def _congestion_controls(server_cmd: list[str], client_cmd: list[str], address: str) -> list[str]:
    """[client's, server's] congestion control for a connection to address."""
    server = subprocess.Popen([*server_cmd, sys.executable, "-c", _CC_PROBE, "serve", address],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        client = subprocess.run([*client_cmd, sys.executable, "-c", _CC_PROBE, "connect", address, port],
                                capture_output=True, text=True, timeout=30)
        return [client.stdout.strip(), server.communicate(timeout=30)[0].strip()]
    finally:
        server.kill()
        server.wait()


def test_tcp_between_hosts_uses_cubic_whatever_the_machine_default(namespaces_allowed):
    """BBR's probe of the round trip every 10 s stalls a connection for 200 ms, which
    made about one all_reduce in four slow on a capped link: the hosts' routes set cubic."""
    default = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    with virtual_cluster(3) as c:
        for server, client in ((2, 0), (0, 1), (1, 2)):
            assert _congestion_controls(c.command(server, []), c.command(client, []),
                                        c.addresses[server]) == ["cubic", "cubic"], (server, client, default)
    # the machine's own connections keep its default
    assert _congestion_controls([], [], "127.0.0.1") == [default, default]


@pytest.mark.slow
def test_a_job_across_three_hosts_waits_on_the_wire(namespaces_allowed, job, tmp_path):
    """An all_reduce over capped links cannot beat them: the ring sends 2(n-1)/n of the
    data through every host's link, so it takes at least that over the rate."""
    rate = 200e6
    with virtual_cluster(3, link="200mbit") as c:
        tag = _tag(c)
        before = [c.counters(h) for h in range(3)]
        result = c.launch(job, 1, log_dir=tmp_path / "runs", display="none",
                          hang_timeout=60, timeout=120)
        after = [c.counters(h) for h in range(3)]
    assert result.ok, result.headline()
    assert result.cluster["hosts"] == 3 and result.cluster["link"]["rate_bps"] == rate
    assert json.loads((result.log_dir / "summary-node0.json").read_text())["cluster"] == \
        result.cluster
    values = {r["rank"]: r for r in result.records}
    assert sorted(values) == [0, 1, 2]
    assert {v["value"] for v in values.values()} == {9.0}  # two all_reduces of ones
    assert {v["ifname"] for v in values.values()} == {f"lu{tag}h{h}" for h in range(3)}
    data = PAYLOAD_MIB * 2**20
    floor = 2 * 2 / 3 * data * 8 / rate
    for v in values.values():
        assert v["seconds"] >= 0.9 * floor, (v, floor)
    for h in range(3):  # two all_reduces plus the rendezvous and barrier
        sent = after[h]["tx_bytes"] - before[h]["tx_bytes"]
        assert 2 * 4 / 3 * data <= sent <= 2 * 4 / 3 * data * 1.2 + 2**20, (h, sent)
    assert _gone(tag) == {}


@pytest.mark.slow
def test_a_failed_run_leaves_nothing(namespaces_allowed, job, tmp_path):
    with virtual_cluster(2, link="400mbit") as c:
        tag = _tag(c)
        result = c.launch(job, 1, args=["fail"], log_dir=tmp_path / "runs", display="none",
                          hang_timeout=60, timeout=120)
    assert result.reason == "failed" and result.failure.rank == 1
    assert _gone(tag) == {}


DRIVER = textwrap.dedent("""
    import json, sys
    from labutils.cluster import virtual_cluster

    with virtual_cluster(2, link="400mbit") as c:
        print(json.dumps({"tag": c.switch.split("-")[2]}), flush=True)
        c.launch(sys.argv[1], 1, args=["wait"], log_dir=sys.argv[2], display="text",
                 hang_timeout=None, timeout=120)
""")


def _driver(job, tmp_path):
    """A caller in its own process: makes a cluster, runs a job that waits, prints lines."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), str(job), str(tmp_path / "runs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    tag, ready, deadline = None, 0, time.monotonic() + 90
    while ready < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            tag = json.loads(line)["tag"]
        ready += line.strip().endswith("] ready")
    assert tag and ready == 2, "the driver's ranks did not start"
    return proc, tag


def _ranks_of(run_root) -> list[int]:
    import psutil

    from labutils.runtime import runfiles

    left = []
    for proc in psutil.process_iter():
        try:
            if str(run_root) in proc.environ().get(runfiles.ENV_RUN_DIR, ""):
                left.append(proc.pid)
        except (psutil.Error, OSError):
            pass
    return left


@pytest.mark.slow
def test_an_interrupted_caller_leaves_nothing(namespaces_allowed, job, tmp_path):
    proc, tag = _driver(job, tmp_path)
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in out
    assert _gone(tag) == {}
    assert not _ranks_of(tmp_path / "runs")


@pytest.mark.slow
def test_a_caller_killed_with_9_is_cleaned_by_the_next_cluster(namespaces_allowed, job, tmp_path):
    proc, tag = _driver(job, tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    from labutils.cluster.netns import pids_in

    def inside() -> list[int]:  # node 1's launcher and its warm server included
        return [pid for name in _ours(tag)["namespaces"] for pid in pids_in(name)]

    deadline = time.monotonic() + 30  # its ranks and node launchers die with it
    while (_ranks_of(tmp_path / "runs") or inside()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ranks_of(tmp_path / "runs") and not inside()
    assert len(_ours(tag)["namespaces"]) == 2  # nobody was left to delete them...
    with virtual_cluster(1):  # ...until the next cluster is made
        pass
    assert _gone(tag) == {}


def test_stale_cleaning_spares_live_owners(namespaces_allowed):
    with virtual_cluster(2) as c:
        tag = _tag(c)
        assert c.switch not in clean_stale()  # owned by this live process
        assert len(_ours(tag)["namespaces"]) == 2
    assert _gone(tag) == {}


def test_a_rank_reads_its_hosts_link_only_on_a_cluster(monkeypatch):
    from labutils.dist import link_bytes
    from labutils.runtime import runfiles

    monkeypatch.delenv(runfiles.ENV_LINK, raising=False)
    assert link_bytes() is None  # not on a virtual cluster
    monkeypatch.setenv(runfiles.ENV_LINK, "lo")
    counters = link_bytes()
    assert set(counters) == {"sent", "received"} and counters["sent"] >= 0
    monkeypatch.setenv(runfiles.ENV_LINK, "no-such-link")
    with pytest.raises(RuntimeError, match="LABUTILS_LINK=no-such-link"):
        link_bytes()
