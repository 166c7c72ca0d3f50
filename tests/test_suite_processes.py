"""benchmarks/suite_processes.py: a command's CPU by kind of process, from the kernel's
process accounting, counting the command's own descendants only."""

from __future__ import annotations

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
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass"
    neighbour = subprocess.Popen([sys.executable, "-c", burn.format(3.0)])
    try:
        time.sleep(0.2)
        code, text = sp.measure(["sh", "-c", f'"{sys.executable}" -c "{burn.format(0.6)}"; exit 3'])
    except SystemExit as exc:  # this suite is being measured: a second measure would end it
        if sp.RUNNING in str(exc):
            pytest.skip(str(exc))
        raise
    finally:
        neighbour.kill()
        neighbour.wait()
    assert code == 3
    python = next(line for line in text.splitlines() if line.endswith("other Python processes"))
    # One Python process: the child, not the neighbour. Its CPU is the kernel's
    # accounting, tick samples less the time a busy host took from this virtual machine
    # (steal), while the child stops on its own clock at 0.6 s: a loaded CI machine
    # recorded 0.4. So: counted, and not more than its own.
    assert python.split()[2] == "1", text
    assert 0.2 <= float(python.split()[0]) < 1.5, text


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
