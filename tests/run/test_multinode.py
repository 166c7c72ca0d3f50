"""A job across machines: two nodes of two ranks each, one launch() per node.

Each node is a host of a virtual cluster (labutils.cluster): node 0 in the test's own
network namespace, node 1 in a namespace of its own, each with a link into one bridge,
so every byte between the nodes crosses both links, as between two hosts on a switch.
Where namespaces cannot be made (not root, no `ip`), the same tests run both nodes on
loopback and say why.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import warnings

import psutil
import pytest
from endings_table import ENDINGS, attempts_verdict, check_verdict
from endings_table import SCRIPT as ENDINGS_SCRIPT
from helpers import SCRIPTS, stop_once

from labutils.runtime import runfiles
from labutils.cli import build_parser, launch_kwargs
from labutils.run.spec import make_spec, torchrun_command
from labutils.run.display import Display
from labutils.errors import LaunchConfigError
from labutils.cluster import VirtualCluster, virtual_cluster
from labutils.run.network import interface_env, route_interface

pytestmark = pytest.mark.timeout(180)

PAYLOAD = 1 << 18  # floats per all_reduce: 1 MiB, so the traffic stands out on the pair
STEPS = 3

JOB = textwrap.dedent(f"""
    import os, sys, time
    import torch
    import torch.distributed as dist
    from labutils.dist import init, report

    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    if mode == "early" and int(os.environ["GROUP_RANK"]) == 1:
        raise ConnectionError("node 1 cannot reach node 0")  # before init_process_group
    rank, world, _ = init()
    t = torch.full(({PAYLOAD},), float(rank))
    for step in range({STEPS}):
        if step == 1 and rank == 3 and mode == "fail":
            raise ValueError("planted failure on rank 3")
        if step == 1 and rank == 3 and mode == "hang":
            time.sleep(600)
        dist.all_reduce(t)
        report(step=step, total={STEPS})
        if mode == "slow":
            time.sleep(1.0)
    print(f"rank {{rank}} of {{world}} on node {{os.environ['GROUP_RANK']}} "
          f"sum {{t[0].item():.0f}} via {{os.environ.get('GLOO_SOCKET_IFNAME', 'default')}}")
""")


@pytest.fixture(scope="module")
def hosts():
    with virtual_cluster(2) as h:
        if h.mode != "namespaces":
            warnings.warn(f"2-node tests run on loopback: {h.reason}", stacklevel=1)
        print(f"\n2-node tests: {h.mode}" + (f" ({h.reason})" if h.reason else
                                               f" {h.addresses} over {h.interfaces}"))
        yield h


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return path


def _leftovers(run_dir) -> list[psutil.Process]:
    """Processes of this run still alive (their environment names its run folder)."""
    left = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(runfiles.ENV_RUN_DIR) == str(run_dir):
                left.append(proc)
        except (psutil.Error, OSError):
            pass
    return left


def test_two_nodes_one_display_global_ranks(hosts, job, tmp_path, capsys):
    before = hosts.counters(0)
    result = hosts.launch(job, 2, log_dir=tmp_path / "runs", display="text",
                              hang_timeout=30, timeout=120)
    shown = capsys.readouterr().out
    assert result.ok, result
    assert result.world_size == 4
    assert [r.rank for r in result.ranks] == [0, 1, 2, 3]
    total = sum(range(4)) * 4 ** (STEPS - 1)  # each all_reduce sums 4 equal values after the first
    for rank in range(4):
        node = rank // 2
        line = f"rank {rank} of 4 on node {node} sum {total}"
        assert line in result.ranks[rank].stdout
        assert f"[rank {rank}] {line}" in shown  # node 0 shows node 1's ranks too
    # Each node's own summary, and node 1 says it ran its two ranks.
    node1 = json.loads(runfiles.node_summary_path(result.log_dir, "node1").read_text())
    assert node1["ok"] is True
    assert sorted(r["rank"] for r in node1["ranks"]) == [0, 1, 2, 3]
    assert {r["rank"]: r["exit_code"] for r in node1["ranks"]} == {0: 0, 1: 0, 2: 0, 3: 0}
    if os.environ.get(runfiles.ENV_START) != "cold":
        # Both nodes start warm: node 0 from this process's server, node 1 from a server its
        # own launcher started on its host (its ranks' interface, below, says which host).
        assert (result.start, node1["start"]) == ("warm", "warm"), (result.start_reason, node1["start_reason"])
    if hosts.mode == "namespaces":
        assert f"via {hosts.interfaces[0]}" in result.ranks[0].stdout
        assert f"via {hosts.interfaces[1]}" in result.ranks[2].stdout
        after = hosts.counters(0)
        # A ring all-reduce sends 2(n-1)/n of the data per rank; two ranks per node, each
        # with one neighbour across the cable: at least one payload crosses per step.
        crossed = after["tx_bytes"] - before["tx_bytes"]
        assert crossed >= STEPS * PAYLOAD * 4, (crossed, after, before)
        assert after["rx_bytes"] - before["rx_bytes"] >= STEPS * PAYLOAD * 4
        assert "virtual cluster: 2 hosts in network namespaces on a bridge" in shown
        assert result.cluster == {"hosts": 2, "mode": "namespaces", "reason": "", "link": None}
    else:
        assert "on this machine's loopback" in shown
    # the cluster's one line, not node 0's rendezvous address and network interface
    assert "node 0 of 2" not in shown and "ranks talk over" not in shown, shown
    assert not _leftovers(result.log_dir)


def test_failure_on_the_other_node_is_the_root_cause(hosts, job, tmp_path):
    result = hosts.launch(job, 2, args=["fail"], log_dir=tmp_path / "runs",
                              display="none", hang_timeout=30, timeout=120)
    assert not result.ok
    assert result.failure is not None
    assert (result.failure.rank, result.failure.exc_type) == (3, "ValueError")
    assert "planted failure on rank 3" in result.failure.message
    assert 3 not in result.failure.victims
    assert set(result.failure.victims) <= {0, 1, 2}
    assert result.exit_status == 1
    assert not _leftovers(result.log_dir)


@pytest.mark.parametrize("how", ["sigterm", "breakpoint_peer"])
def test_endings_across_nodes_get_the_verdict_of_one_machine(hosts, tmp_path, how):
    """tests/run/test_endings.py's contract across two virtual nodes, rank 3 (node 1)
    failing. sigterm: it sends itself SIGTERM, and a launcher that follows node 1
    through the shared run folder, without knowing what node 1's launcher signalled,
    still names rank 3, not rank 0's lost connection. breakpoint_peer: ranks 0-2 wait at
    a breakpoint while rank 3 raises; node 1's launcher, whose input is the null device,
    once took its terminal for their debugger, read its end and quit rank 0 (BdbQuit,
    "also failed"), instead of leaving it as a victim."""
    result = hosts.launch(ENDINGS_SCRIPT, 2, args=[how, "3"], log_dir=tmp_path / "runs",
                          display="none", hang_timeout=30, timeout=120)
    check_verdict(result.to_json(), how, 4, 3)
    assert not _leftovers(result.log_dir)


@pytest.mark.parametrize("how", ["sys_exit", "segfault"])
def test_a_restarted_job_says_the_same_of_each_attempt_on_every_node(hosts, tmp_path, how):
    """A job that may restart meets through c10d, a store of its own per attempt (with
    node ranks, torch's static rendezvous kept one store, and every restart failed in
    init_process_group: "Gloo connectFullMesh failed ... Connection refused", the
    restarted ranks reading the first attempt's addresses). Rank 3 ends the same way in
    both attempts: the first is "restarted", the second "failed", and each names rank 3
    with its exit status, as one machine's run does (tests/run/test_endings.py)."""
    result = hosts.launch(ENDINGS_SCRIPT, 2, args=[how, "3"], log_dir=tmp_path / "runs",
                          display="none", hang_timeout=30, timeout=150, max_restarts=1)
    summary = result.to_json()
    check_verdict(summary, how, 4, 3)
    first, last = attempts_verdict(summary)
    assert (first["outcome"], last["outcome"]) == ("restarted", "failed"), (first, last)
    assert first == {**last, "outcome": "restarted", "restart_count": 0}, (first, last)
    assert last["exit_code"] == ENDINGS[how][2] and ENDINGS[how][4] in last["why"], last
    assert not _leftovers(result.log_dir)


def test_a_job_across_nodes_recovers_from_a_fault(hosts, tmp_path):
    """Rank 3 killed at step 1 (an injected fault): both nodes restart their ranks, which
    meet again at node 0's address and finish."""
    job = tmp_path / "job.py"
    job.write_text(JOB.replace("report(step=step, total=", "report(master=os.environ['MASTER_ADDR'], "
                               "node=os.environ['GROUP_RANK'], step=step, total="))
    result = hosts.launch(job, 2, args=["ok"], log_dir=tmp_path / "runs", display="none",
                          hang_timeout=30, timeout=150, max_restarts=1, fault={"rank": 3, "step": 1})
    assert result.ok, result.headline()
    attempts = result.to_json()["attempts"]
    assert [(a["outcome"], a["failed_rank"]) for a in attempts] == [("restarted", 3), ("ok", None)]
    last = [r for r in result.records if r["step"] == STEPS - 1]
    assert sorted(r["rank"] for r in last) == [0, 1, 2, 3]
    assert {r["master"] for r in last} == {hosts.addresses[0]}  # rank 0's store, on node 0
    assert {r["node"] for r in last} == {"0", "1"}  # two ranks on each node
    assert sorted(r["node"] for r in last).count("0") == 2
    assert not _leftovers(result.log_dir)


def test_a_node_restarted_for_the_other_nodes_failure_keeps_its_restart_count(hosts, tmp_path):
    """Rank 3 (node 1) exits 3 once while node 0's ranks wait outside any collective: node
    1's agent restarts after a failure, node 0's because the rendezvous has a node waiting
    (its ranks stopped with SIGTERM, no failure of theirs). Each agent counts its own
    restarts, so node 0's ranks start the second attempt with TORCHELASTIC_RESTART_COUNT 0,
    node 1's with 1: the launcher still tells the attempts apart (each round's store has a
    port of its own) and names rank 3 in the first."""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import datetime, os, sys, time
        import torch, torch.distributed as dist
        from labutils.dist import report
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        rank, world = dist.get_rank(), dist.get_world_size()
        report(step=0, total=2, restart=os.environ["TORCHELASTIC_RESTART_COUNT"],
               node=os.environ["GROUP_RANK"])
        # Rank 3 ends once every rank is past init_process_group: a peer still connecting
        # to it fails there (a loaded machine once kept rank 0 in gloo's connectFullMesh).
        open(f"{sys.argv[1]}.up{rank}", "w").close()
        if rank == world - 1 and not os.path.exists(sys.argv[1]):
            while not all(os.path.exists(f"{sys.argv[1]}.up{r}") for r in range(world)):
                time.sleep(0.05)
            open(sys.argv[1], "w").close()
            sys.exit(3)
        time.sleep(10)  # outside any collective when rank 3 ends (a margin for a loaded machine)
        t = torch.ones(1)
        dist.all_reduce(t)
        report(step=1, total=2, sum=t.item())
    """))
    result = hosts.launch(job, 2, args=[str(tmp_path / "failed-once")], log_dir=tmp_path / "runs",
                          display="none", hang_timeout=30, timeout=150, max_restarts=1)
    assert result.ok, result.headline()
    first, last = result.to_json()["attempts"]
    assert (first["outcome"], first["failed_rank"], last["outcome"]) == ("restarted", 3, "ok")
    assert "exit code 3" in first["why"] and first["exit_codes"]["3"] == 3
    assert {first["exit_codes"][str(r)] for r in (0, 1, 2)} == {-15}  # stopped, not failed
    counts = {(r["node"], r["restart"]) for r in result.records if r["step"] == 0}
    assert counts == {("0", "0"), ("1", "0"), ("1", "1")}, counts  # node 0 never counted one
    assert sorted(r["sum"] for r in result.records if r["step"] == 1) == [4.0] * 4
    assert not _leftovers(result.log_dir)


def test_other_node_failing_before_init_is_a_failure_not_a_hang(hosts, job, tmp_path):
    result = hosts.launch(job, 2, args=["early"], log_dir=tmp_path / "runs",
                              display="none", hang_timeout=60, timeout=120)
    assert result.reason == "failed", result.headline()
    assert result.failure.rank in (2, 3)
    assert result.failure.exc_type == "ConnectionError"
    assert result.duration_s < 60  # not left waiting for a hang_timeout or gloo's timeout
    assert not _leftovers(result.log_dir)


def test_hang_on_the_other_node_reads_its_stack(hosts, job, tmp_path):
    result = hosts.launch(job, 2, args=["hang"], log_dir=tmp_path / "runs",
                              display="none", hang_timeout=4, timeout=120)
    assert result.reason == "hang"
    assert result.hang is not None
    assert result.hang.stragglers == [3]
    # Rank 3's stack came through the run folder (stack-request.json), not a signal.
    lines = JOB.splitlines()
    sleep_line = next(i for i, ln in enumerate(lines, 1) if "time.sleep(600)" in ln)
    reduce_line = next(i for i, ln in enumerate(lines, 1) if "dist.all_reduce" in ln)
    assert result.hang.waiting[3].endswith(f"job.py:{sleep_line}")
    assert all(result.hang.waiting[r].endswith(f"job.py:{reduce_line}") for r in (0, 1, 2))
    assert runfiles.stack_request_path(result.log_dir).exists()
    stop = json.loads(runfiles.stop_path(result.log_dir).read_text())
    assert stop == {"by": "node0", "reason": "hang"}
    assert not _leftovers(result.log_dir)


class _StopAfterFirstRecord(Display):
    def record(self, rank, values):
        self.stop_requested.set()


def test_stop_on_node_0_stops_node_1(hosts, job, tmp_path):
    result = hosts.launch(job, 2, args=["slow"], log_dir=tmp_path / "runs",
                              display=_StopAfterFirstRecord(), hang_timeout=30, timeout=120)
    assert result.reason == "stopped"
    node1 = json.loads(runfiles.node_summary_path(result.log_dir, "node1").read_text())
    assert node1["ok"] is False
    assert "ended the job (stopped)" in (result.log_dir / "node1.out").read_text()
    assert not _leftovers(result.log_dir)


def test_a_stopped_job_says_where_each_rank_on_each_node_was(hosts, tmp_path):
    """Node 0 stops its ranks at once, node 1 once it reads stop.json: node 1's ranks,
    waiting in barrier() for node 0's, fail there ("Connection closed by peer") before
    their own SIGTERM comes, and exit 1. They were missing from "where each rank was"
    (read only from stacks a SIGTERM dumped); their exception's line places them."""
    script = SCRIPTS / "waits_for_a_flag.py"
    lines = script.read_text().splitlines()
    loop, barrier = (next(i for i, t in enumerate(lines, 1) if t.endswith(tag))
                     for tag in ("# waits here", "# rank 0 waits here"))
    result = hosts.launch(script, 2, log_dir=tmp_path / "runs", display=stop_once(lambda d: len(d.started) == 4),
                          hang_timeout=None, timeout=120)
    assert result.reason == "stopped" and result.at_stop is not None, result.summary()
    at = result.at_stop
    waiting = {rank: where.rsplit("/", 1)[-1] for rank, where in at.waiting.items()}
    assert (waiting, at.stragglers) == (
        {0: f"waits_for_a_flag.py:{barrier}", 1: f"waits_for_a_flag.py:{loop + 1}",
         2: f"waits_for_a_flag.py:{barrier}", 3: f"waits_for_a_flag.py:{barrier}"}, [1]), \
        result.summary()
    assert at.calls == {0: "barrier", 1: "", 2: "barrier", 3: "barrier"}, result.summary()
    assert not _leftovers(result.log_dir)


# ------------------------------------------------------------------ no processes
def test_multinode_spec_and_torchrun_command(job):
    spec = make_spec(job, 2, nnodes=2, node_rank=1, rdzv_endpoint="10.1.2.3:29500",
                     rdzv_id="job-7")
    assert spec.multinode and not spec.elastic and spec.world_size == 4
    cmd = torchrun_command(spec, port=1, run_id="ignored")
    args = cmd[cmd.index("labutils.runtime.agent") + 1:]
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    assert (parsed.nnodes, parsed.node_rank, parsed.rdzv_backend, parsed.rdzv_endpoint,
            parsed.rdzv_id) == ("2", 1, "static", "10.1.2.3:29500", "job-7")
    elastic = make_spec(job, 2, nnodes="1:3", rdzv_endpoint="head:29400", rdzv_id="j")
    parsed = get_args_parser().parse_args(
        torchrun_command(elastic, port=1, run_id="x")[3:])
    assert (parsed.nnodes, parsed.rdzv_backend, parsed.rdzv_endpoint) == ("1:3", "c10d",
                                                                          "head:29400")
    assert "is_host" not in parsed.rdzv_conf  # torchrun finds out which node hosts it
    assert elastic.world_size == 6


@pytest.mark.parametrize("kwargs, what", [
    (dict(node_rank=0), "node_rank"),
    (dict(rdzv_id="a"), "rdzv_id"),
    (dict(rdzv_endpoint="10.0.0.1", rdzv_id="a", nnodes=2), "rdzv_endpoint"),
    (dict(rdzv_endpoint="h:99999", rdzv_id="a", nnodes=2), "rdzv_endpoint"),
    (dict(rdzv_endpoint="h:1", nnodes=2), "rdzv_id"),
    (dict(rdzv_endpoint="h:1", rdzv_id="a b", nnodes=2), "rdzv_id"),
    (dict(rdzv_endpoint="h:1", rdzv_id="a", nnodes=2, node_rank=2), "node_rank"),
    (dict(rdzv_endpoint="h:1", rdzv_id="a", nnodes="1:2", node_rank=0), "nnodes"),
    (dict(rdzv_endpoint="h:1", rdzv_id="a", nnodes=2, local_agents=2), "local_agents"),
    (dict(rdzv_endpoint="h:1", rdzv_id="a", nnodes=2, node_rank=0, max_restarts=1), "node_rank"),
])
def test_bad_multinode_input_is_one_line(job, kwargs, what):
    with pytest.raises(LaunchConfigError) as err:
        make_spec(job, 2, **kwargs)
    assert err.value.what == what
    assert "\n" not in str(err.value) and f"{what}: expected " in str(err.value)


def test_unresolvable_endpoint_fails_before_anything_starts(job, tmp_path):
    from labutils.run.launcher import launch

    with pytest.raises(LaunchConfigError, match="rdzv_endpoint: expected a host"):
        launch(job, 2, nnodes=2, node_rank=0, rdzv_endpoint="no-such-host.invalid:29500",
               rdzv_id="x", log_dir=tmp_path, display="none")
    assert not (tmp_path / "x").exists()


def test_reusing_a_finished_job_name_is_refused(job, tmp_path):
    from labutils.run.launcher import launch

    (tmp_path / "done-job").mkdir()
    (tmp_path / "done-job" / "summary-node0.json").write_text("{}")
    with pytest.raises(LaunchConfigError, match="pick a new rdzv_id"):
        launch(job, 2, nnodes=2, node_rank=0, rdzv_endpoint="127.0.0.1:29500",
               rdzv_id="done-job", log_dir=tmp_path, display="none")


def test_interface_for_the_endpoint():
    assert route_interface("127.0.0.1:1")[0] is not None
    assert interface_env("127.0.0.1:1", {}) == ({}, None)  # loopback: gloo's own choice
    chosen, line = interface_env("127.0.0.1:1", {"GLOO_SOCKET_IFNAME": "eth9"})
    assert chosen == {} and "as given" in line


def test_virtual_cluster_interfaces(hosts):
    if hosts.mode != "namespaces":
        pytest.skip(hosts.reason)
    chosen, line = interface_env(f"{hosts.addresses[0]}:1", {})
    assert chosen == {"GLOO_SOCKET_IFNAME": hosts.interfaces[0],
                      "NCCL_SOCKET_IFNAME": hosts.interfaces[0]}
    assert hosts.interfaces[0] in line
    assert hosts.command(1, ["true"])[:4] == ["ip", "netns", "exec", hosts.namespaces[1]]
    assert hosts.command(0, ["true"]) == ["true"]


def test_cli_node_flags(job):
    ns = build_parser().parse_args(["launch", "-n", "2", "--nnodes", "2", "--node-rank", "1",
                                    "--rdzv-endpoint", "node0:29500", "--rdzv-id", "j1",
                                    str(job)])
    ns.script_args = []
    kw = launch_kwargs(ns)
    assert (kw["nnodes"], kw["node_rank"], kw["rdzv_endpoint"], kw["rdzv_id"]) == \
        (2, 1, "node0:29500", "j1")


def test_cli_usage_error_for_a_bad_node_rank(job, tmp_path):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "labutils.cli", "launch", "-n", "2",
                           "--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint",
                           "127.0.0.1:29500", "--rdzv-id", "j", str(job)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("labutils launch: --node-rank: ")


def test_without_root_both_nodes_run_on_loopback_and_say_why(job, tmp_path, monkeypatch, capsys):
    """What a learner without root gets: the same job, both nodes on this machine."""
    import labutils.cluster.virtual as cluster

    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    with virtual_cluster(2) as hosts:
        assert hosts.mode == "loopback"
        assert "need root" in hosts.reason
        assert hosts.counters(0) == {}
        result = hosts.launch(job, 1, log_dir=tmp_path / "runs",
                                  display="text", hang_timeout=30, timeout=120)
    shown = capsys.readouterr().out
    assert result.ok, result
    assert [r.rank for r in result.ranks] == [0, 1]
    assert "on this machine's loopback, links not shaped: network namespaces need root" in shown
    assert result.cluster["mode"] == "loopback"
    assert not _leftovers(result.log_dir)


def test_node_1_that_cannot_start_ends_the_job_at_once(job, tmp_path):
    """Node 1's launcher fails before its ranks start (here: its namespace is missing):
    node 0 must not wait at the rendezvous; it stops and says why."""
    gone = VirtualCluster(hosts=2, mode="namespaces", namespaces=[None, "labutils-no-such-namespace"],
                          addresses=["127.0.0.1", "127.0.0.1"], interfaces=[None, None])
    lines = []

    class Notes(Display):
        def note(self, text):
            lines.append(text)

    result = gone.launch(job, 2, log_dir=tmp_path / "runs", display=Notes(),
                              hang_timeout=30, timeout=120)
    assert result.reason == "stopped"
    assert result.duration_s < 20
    assert any("node1's launcher ended the job (it exited with status" in ln for ln in lines), lines
    assert not _leftovers(result.log_dir)


def test_a_lone_node_says_it_waits_for_the_others(job, tmp_path, monkeypatch, capsys):
    import labutils.run.follow as follow
    import labutils.run.launcher as launcher

    monkeypatch.setattr(follow, "WAIT_NOTE_S", 1.0)
    from labutils.runtime.procs import free_port

    result = launcher.launch(job, 1, nnodes=2, node_rank=0, rdzv_id="lonely",
                             rdzv_endpoint=f"127.0.0.1:{free_port()}", log_dir=tmp_path,
                             display="text", timeout=4)
    shown = capsys.readouterr().out
    assert result.reason == "timeout"
    assert "node 0 of 2: rank 0 here" in shown
    assert "the job waits until all 2 nodes have joined" in shown
    assert not _leftovers(result.log_dir)
