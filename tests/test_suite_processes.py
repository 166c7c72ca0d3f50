"""benchmarks/suite_processes.py: a command's CPU by kind of process, from the kernel's
process accounting, counting the command's own descendants only."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import suite_processes as sp


def test_comp_t_times_and_v3_records_are_read():
    assert (sp.comp_t(0x1FFF), sp.comp_t((1 << 13) | 5), sp.comp_t((2 << 13) | 3)) == (8191, 40, 192)
    one = sp.RECORD.pack(0, 3, 0, 0, 0, 0, 41, 7, 1_700_000_000, 250.0,
                         150, (1 << 13) | 5, 0, 0, 0, 0, 0, 0, b"pt_elastic")
    rows = sp.records(one + one.replace(b"pt_elastic", b"python\0\0\0\0"))
    assert rows[0] == {"pid": 41, "ppid": 7, "btime": 1_700_000_000, "cpu_s": 1.9, "comm": "pt_elastic"}
    assert rows[1]["comm"] == "python"
    with pytest.raises(ValueError, match="version 2, expected 3"):
        sp.records(one[:1] + bytes([2]) + one[2:])


def test_each_process_gets_its_kind_from_its_command_line_or_thread_name():
    py = "/venv/bin/python"
    cases = {
        (f"{py} -u -m labutils.runtime.server 5", "python"): "warm servers",
        (f"{py} -u -m labutils.runtime.server 5", "pt_elastic"): "warm runs",  # a fork of it
        (f"{py} -m labutils.runtime.agent --nnodes 1", "pt_elastic"): "torchrun agents started cold",
        (f"{py} -u -m labutils.runtime.worker train.py", "python"): "ranks started cold",
        (f"{py} -m ipykernel_launcher -f k.json", "python"): "notebook kernels",
        (f"{py} -m labutils.grading.runner --checks c", "python"): "the grader's check runners",
        (f"{py} -m labutils.grading.sandbox {{}}", "python"): "the grader's supervisors",
        ("", "cc1plus"): "the C++ compiler",
        ("", "ld"): "the C++ compiler",
        ("", "ldconfig"): "other: ldconfig",
        ("", "python"): "other Python processes",
    }
    for (line, comm), expected in cases.items():
        assert sp.kind(line, comm).startswith(expected), (line, comm, sp.kind(line, comm))


def test_only_the_commands_descendants_count_orphans_included():
    rows = [{"pid": 10, "ppid": 1, "parent": 2},    # the command (its shell's child)
            {"pid": 11, "ppid": 10, "parent": 10},  # its child
            {"pid": 12, "ppid": 1, "parent": 11},   # an orphan of 11: init adopted it
            {"pid": 13, "ppid": 12, "parent": None},  # never seen by the sampler
            {"pid": 20, "ppid": 1, "parent": 3}]    # another process of the machine
    assert [r["pid"] for r in sp.descendants(rows, 10)] == [10, 11, 12, 13]


def _may_account() -> bool:
    """CAP_SYS_PACCT in this process's effective set: acct(2) needs it (root has it,
    unless a container dropped it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 20 & 1)
    return False


@pytest.mark.skipif(not _may_account(), reason="process accounting (acct(2)) needs CAP_SYS_PACCT")
def test_a_commands_child_is_counted_and_a_neighbour_is_not(tmp_path):
    """A neighbour that ends while the command runs has its record in the machine's one
    accounting file; only the command's own child is counted. The CPU a record holds is
    the kernel's tick samples less what the host stole from this virtual machine: a
    loaded CI host wrote 0.4 and then 0.1 for a child that burned 0.6 s on its own clock,
    so it is bounded above (not the neighbour's too), never below."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass"
    started, go = tmp_path / "started", tmp_path / "go"
    command = ["sh", "-c", f'touch "{started}"; "{sys.executable}" -c "{burn.format(0.3)}"; '
               f'while [ ! -e "{go}" ]; do sleep 0.05; done; exit 3']

    def measured():
        with sp.held():
            return sp.account(command)

    neighbour = None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(measured)
        try:
            while not started.exists() and not result.done():
                time.sleep(0.02)
            if started.exists():  # accounting is on: this one ends while it is
                neighbour = subprocess.Popen([sys.executable, "-c", burn.format(0.3)])
                neighbour.wait()
        finally:
            go.touch()
        try:
            code, rows, root, wall = result.result()
        except SystemExit as exc:  # this suite is being measured: a second measure would end it
            if sp.RUNNING in str(exc):
                pytest.skip(str(exc))
            raise
    assert code == 3 and neighbour is not None
    assert neighbour.pid in [r["pid"] for r in rows], rows  # in the file
    mine = sp.descendants(rows, root)
    assert neighbour.pid not in [r["pid"] for r in mine], mine
    pythons = [r for r in mine if r["kind"] == "other Python processes"]
    assert len(pythons) == 1 and pythons[0]["ppid"] == root, mine
    assert 0 <= pythons[0]["cpu_s"] < 1.0, pythons
    assert sum(r["cpu_s"] for r in mine) < 1.0, mine


def test_the_report_counts_by_kind_and_leaves_out_kinds_under_a_twentieth_of_a_second():
    rows = [{"kind": "warm runs", "cpu_s": 2.0}, {"kind": "warm runs", "cpu_s": 1.0},
            {"kind": "other: sh", "cpu_s": 0.04}, {"kind": "other Python processes", "cpu_s": 1.0}]
    lines = sp.report(rows, 2.0).splitlines()
    assert lines[1].split() == ["3.0", "74.3%", "2", "warm", "runs"]
    assert lines[2].split() == ["1.0", "24.8%", "1", "other", "Python", "processes"]
    assert len(lines) == 4 and "other: sh" not in lines[3]
    assert lines[3] == "4 CPU-s in 2 s (2.02 cores on average), 4 processes ended"


def test_the_servers_are_counted_by_who_started_them_without_their_forks():
    server = "/venv/bin/python -u -m labutils.runtime.server 5"
    rows = [{"pid": 1, "ppid": 0, "parent": 0, "kind": "pytest and its xdist workers", "line": "pytest", "cpu_s": 1.0},
            {"pid": 2, "ppid": 1, "parent": 1, "kind": "warm servers", "line": server, "cpu_s": 2.5},
            {"pid": 3, "ppid": 2, "parent": 2, "kind": "warm servers", "line": server, "cpu_s": 0.2},  # a keeper
            {"pid": 4, "ppid": 1, "parent": 1, "kind": "notebook kernels", "line": "ipykernel_launcher", "cpu_s": 1.0},
            {"pid": 5, "ppid": 4, "parent": 4, "kind": "warm servers", "line": server, "cpu_s": 3.0},
            {"pid": 6, "ppid": 1, "parent": 1, "kind": "warm servers", "line": server, "cpu_s": 2.0}]
    lines = sp.servers_started(rows).splitlines()
    assert lines[0] == "3 warm servers started, 8 CPU-s (without their keepers and runs), by:"
    assert lines[1].split() == ["4.5", "2", "pytest", "and", "its", "xdist", "workers"]
    assert lines[2].split() == ["3.0", "1", "notebook", "kernels"]
    assert sp.servers_started(rows[:1]) == ""
    assert sp.report(rows, 1.0).splitlines()[-1].split()[:2] == ["3.0", "1"]


def test_a_second_measure_refuses_while_one_runs():
    """The kernel keeps one accounting file: a measure started while another holds the
    lock (this file's test inside a measured suite, a suite beside another) refuses."""
    import fcntl

    with open(sp.LOCK, "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a measure running now does
        except BlockingIOError:
            pass  # a measure runs on this machine now: it holds the lock for us
        with pytest.raises(SystemExit, match=sp.RUNNING):
            sp.measure(["true"])


def test_bad_arguments_get_one_line_before_anything_is_measured(capsys):
    """--help printed a traceback (it was taken for the command to run): now usage, and
    one line for an unknown option, no command, or a command that is not there."""
    with pytest.raises(SystemExit) as done:
        sp.command_of(["--help"])
    assert done.value.code == 0 and "usage: suite_processes.py -- COMMAND" in capsys.readouterr().out
    for argv, said in ((["--cores", "2"], "unknown option --cores"), ([], "usage:"), (["--"], "usage:"),
                       (["--", "no-such-program-here"], "no-such-program-here: no such command")):
        with pytest.raises(SystemExit, match=said) as done:
            sp.command_of(argv)
        assert "\n" not in str(done.value.code)
    assert sp.command_of(["--", "make", "test"]) == ["make", "test"]
    assert sp.command_of(["true"]) == ["true"]
