"""A rank's breakpoint() debugged from a terminal, a notebook pane or `labutils debug`.

Real runs: rank 1 of tests/scripts/breakpoint_rank1.py stops at breakpoint() (or
torch.distributed.breakpoint(rank=1)) while rank 0 waits in its all_reduce. The
console changes a variable of the rank, `c` lets the run finish, `q` fails it; the
hang watch stays quiet while the rank is in the debugger; nothing is left behind.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS, iopub_until

from labutils import launch
from labutils.notebook.display import Display, TextDisplay
from labutils.runtime.debugger import waiting_sockets
from labutils.runtime.procs import pid_alive

pytestmark = pytest.mark.slow
SCRIPT = SCRIPTS / "breakpoint_rank1.py"
LABUTILS = [sys.executable, "-m", "labutils.cli"]


DEBUGGER_OPEN = "this terminal is its debugger"


def _cli(commands: str, *extra: str, runs_dir: Path, delay_s: float = 0.0, env=None):
    """`labutils launch` in a terminal whose user types ``commands`` delay_s after the
    launcher said the terminal is a rank's debugger (at once if it never says so)."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([*LABUTILS, "launch", "-n", "2", "--hang-timeout", "2",
                             "--json", str(runs_dir / "summary.json"), str(SCRIPT), *extra],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=runs_dir, env={**os.environ, **(env or {})})
    assert proc.stdin is not None and proc.stdout is not None
    out: list[str] = []
    opened = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            out.append(line)
            if DEBUGGER_OPEN in line:
                opened.set()
        opened.set()  # the output ended: nothing to wait for

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    opened.wait(120)
    time.sleep(delay_s)
    try:
        proc.stdin.write(commands)
        proc.stdin.close()
    except BrokenPipeError:  # the run had ended already
        pass
    proc.wait(timeout=120)
    reader.join(30)
    return proc.returncode, "".join(out), json.loads((runs_dir / "summary.json").read_text())


def _gone(summary: dict) -> bool:
    return all(not pid_alive(r["pid"]) for r in summary.get("ranks", []) if r.get("pid"))


def test_the_terminal_of_labutils_launch_is_the_ranks_debugger(runs_dir):
    # the commands come 5 s after the debugger opened: the hang watch (2 s) must wait for it
    code, out, summary = _cli("p secret\nsecret = 99\nc\n", runs_dir=runs_dir, delay_s=5)
    assert code == 0, out
    assert "rank 1 stopped at breakpoint_rank1.py:15; this terminal is its debugger" in out
    assert "(Pdb rank 1) 41" in out
    assert "[rank 1] rank 1: secret 99, sum 4" in out and "[rank 0] rank 0: secret 40" in out
    # pdb's answers before what the rank printed once it went on
    assert out.index("rank 1 continues") < out.index("[rank 1] rank 1: secret 99"), out
    assert "hang" not in out.lower()


def test_pdbs_answers_come_before_the_lines_the_rank_printed_after_them(tmp_path, monkeypatch):
    """What pdb wrote before its rank went on is shown before the rank's next lines,
    however late the terminal's own thread runs: the display reads the debugger's
    socket before it writes a line (once, the run's lines came first under load)."""
    import io
    import socket as socketlib

    from labutils.notebook.display import TextDisplay

    path = tmp_path / "rank1.sock"
    server = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    typed_r, typed_w = os.pipe()
    monkeypatch.setattr(sys, "stdin", os.fdopen(typed_r))  # nobody types: the bridge waits
    out = io.StringIO()
    display = TextDisplay(out=out, limit=None, console=True)
    display.debugger(1, {"state": "waiting", "socket": str(path), "where": "train.py:9"})
    rank, _ = server.accept()
    for answer in ("(Pdb rank 1) ", "41\n(Pdb rank 1) ", "rank 1 continues\n"):
        rank.sendall(answer.encode())
    rank.close()  # pdb ended the session; the rank went on and printed:
    display.lines(1, "stdout", ["rank 1: secret 99"])
    text = out.getvalue()
    assert text.index("(Pdb rank 1) 41\n") < text.index("rank 1 continues") < \
        text.index("[rank 1] rank 1: secret 99"), text
    os.close(typed_w)
    server.close()


def test_quitting_the_debugger_ends_the_run_and_leaves_no_process(runs_dir):
    code, out, summary = _cli("q\n", runs_dir=runs_dir)
    assert code == 1, out
    assert summary["failure"]["rank"] == 1 and summary["failure"]["exc_type"] == "BdbQuit"
    assert "the debugger was quit (q)" in out
    assert _gone(summary)


def test_a_deep_temporary_folder_still_gives_the_rank_a_debugger(runs_dir):
    """A rank's debugger listens on a Unix socket in the temporary folder; a TMPDIR so
    deep that the socket's path is over 107 bytes once failed the rank with "AF_UNIX
    path too long" instead of stopping it at the breakpoint."""
    deep = runs_dir / ("a-deep-temporary-folder-" * 4)
    deep.mkdir(parents=True)
    code, out, summary = _cli("q\n", runs_dir=runs_dir, env={"TMPDIR": str(deep)})
    assert code == 1 and summary["failure"]["exc_type"] == "BdbQuit", out
    assert "AF_UNIX" not in out


@pytest.mark.parametrize("how", ["warm", "cold"])
def test_torch_distributed_breakpoint_reaches_the_console_too(runs_dir, how):
    """Warm ranks have torch.distributed already imported; cold ones import it later."""
    code, out, _ = _cli("up\np secret\nc\n", "--", "--torch", runs_dir=runs_dir,
                        env={"LABUTILS_START": how})
    assert code == 0, out
    assert "dist.breakpoint(rank=1)" in out and "(Pdb rank 1) 41" in out


def test_a_text_display_says_how_to_attach_and_labutils_debug_attaches(runs_dir):
    out = io.StringIO()
    attached = {}

    def attach() -> None:   # a learner's terminal, once the notebook says how
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "labutils debug" not in out.getvalue():
            time.sleep(0.1)
        note = next(line for line in out.getvalue().splitlines() if "labutils debug" in line)
        command = note.split("from a terminal: ", 1)[1].split()
        assert waiting_sockets(runs_dir / command[2]) != {}
        attached["run"] = subprocess.run([*LABUTILS, *command[1:]], input="p secret\nc\n",
                                         capture_output=True, text=True, timeout=60, cwd=runs_dir)

    runs_dir.mkdir(parents=True, exist_ok=True)
    helper = threading.Thread(target=attach)
    helper.start()
    here = os.getcwd()
    os.chdir(runs_dir)   # the note names the run folder relative to where it runs
    try:
        result = launch(SCRIPT, 2, display=TextDisplay(out=out, err=out), hang_timeout=2,
                        log_dir=runs_dir / "runs")
    finally:
        os.chdir(here)
    helper.join(timeout=60)
    assert result.ok, out.getvalue()
    run = attached["run"]
    assert run.returncode == 0 and "(Pdb rank 1) 41" in run.stdout, run.stdout + run.stderr
    assert "rank 1 stopped at breakpoint_rank1.py:15; the other ranks wait" in out.getvalue()
    again = subprocess.run([*LABUTILS, "debug", str(result.log_dir)], capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 2 and "waits for a debugger" in again.stderr
    assert again.stderr.count("\n") == 1


def test_with_nobody_to_type_the_breakpoint_is_passed_over(runs_dir, monkeypatch):
    result = launch(SCRIPT, 2, display=Display(), hang_timeout=2)
    assert result.ok
    assert [r.state for r in result.ranks] == ["done", "done"]
    # under the grader even a text display (a notebook run by papermill) passes it over
    monkeypatch.setenv("LABUTILS_GRADE_TAG", "test")
    out = io.StringIO()
    for extra in ([], ["--torch"]):
        result = launch(SCRIPT, 2, args=extra, display=TextDisplay(out=out, err=out),
                        hang_timeout=2)
        assert result.ok and "debugger" not in out.getvalue(), out.getvalue()


# ------------------------------------------------- the pane's text box, a real kernel

CELL = """\
import json
from labutils import launch
result = launch({script!r}, nproc=2, display="widgets", hang_timeout=2)
print("RESULT " + json.dumps({{"reason": result.reason, "pids": [r.pid for r in result.ranks],
                              "out": [r.stdout for r in result.ranks]}}))
"""


def _is_debug_box(msg) -> bool:
    state = msg["content"].get("data", {}).get("state", {})
    return (msg["msg_type"] == "comm_open" and state.get("_model_name") == "TextModel"
            and "pdb command for rank 1" in state.get("placeholder", ""))


def _pane_shows(text: str):
    def found(msg) -> bool:
        state = msg["content"].get("data", {}).get("state", {})
        return msg["msg_type"] == "comm_msg" and text in str(state.get("value", ""))
    return found


@pytest.mark.timeout(240)
def test_the_ranks_pane_takes_pdb_commands_while_the_cell_runs(kernel):
    kernel.execute(CELL.format(script=str(SCRIPT)))
    box = iopub_until(kernel, _is_debug_box, timeout=90)

    def type_in(command: str) -> None:
        kernel.shell_channel.send(kernel.session.msg("comm_msg", {
            "comm_id": box["content"]["comm_id"],
            "data": {"method": "update", "state": {"value": command}, "buffer_paths": []}}))

    time.sleep(3)   # longer than hang_timeout: the debugger keeps the hang watch quiet
    type_in("p secret")
    iopub_until(kernel, _pane_shows("(Pdb rank 1) p secret\n41"), timeout=30)
    type_in("secret = 99")
    time.sleep(1)
    type_in("c")
    printed = iopub_until(
        kernel, lambda m: m["msg_type"] == "stream" and "RESULT " in m["content"]["text"],
        timeout=60)
    result = json.loads(printed["content"]["text"].split("RESULT ", 1)[1])
    assert result["reason"] == "ok"
    assert "rank 1: secret 99, sum 4" in result["out"][1]
    assert all(pid and not pid_alive(pid) for pid in result["pids"])


def test_a_rank_gone_before_its_console_connects_ends_nothing_but_its_session(tmp_path):
    """The "waiting" event of a rank that torchrun ended meanwhile (a peer failed):
    no console can reach it, at once, and the displays go on."""
    import socket as socketlib
    import time

    from labutils.notebook.display import Display, TextDisplay
    from labutils.runtime.debugger import Console, DebuggerGone

    path = tmp_path / "rank0.sock"
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    listener.bind(str(path))
    listener.close()  # the socket file stays, nobody listens: connection refused
    for gone in (path, tmp_path / "removed.sock"):
        t0 = time.monotonic()
        with pytest.raises(DebuggerGone):
            Console(str(gone))
        assert time.monotonic() - t0 < 1.0
    event = {"state": "waiting", "socket": str(path), "where": "train.py:9"}
    Display().debugger(0, event)  # display="none": nothing to continue
    TextDisplay(limit=None).debugger(0, event)


def test_debug_says_why_it_has_nothing_to_attach_to(tmp_path, capsys, monkeypatch):
    """`labutils debug` without a rank to attach: one line that says what is there."""
    from labutils.cli import main as cli
    from labutils.runtime.runfiles import events_path

    def said(*args: str) -> str:
        assert cli(["debug", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        return err

    monkeypatch.chdir(tmp_path)
    assert "runs/gone: expected a run folder (runs/...), and there is no such folder" in said("runs/gone")
    (tmp_path / "notes.txt").write_text("not a run\n")
    assert "notes.txt: expected a run folder (runs/...), and it is a file" in said("notes.txt")
    run = tmp_path / "runs" / "a-run"
    run.mkdir(parents=True)
    assert said(str(run)) == (f"labutils debug: no rank of {run} waits for a debugger now; "
                               "expected a rank stopped at breakpoint()\n")
    # rank 0 waits at a breakpoint (its debugger's socket exists), rank 1 ended
    socket_path = tmp_path / "rank0.sock"
    socket_path.touch()
    for rank, events in ((0, [{"kind": "debugger", "state": "waiting", "socket": str(socket_path)}]),
                         (1, [{"kind": "exit", "code": 0}])):
        events_path(run, rank).parent.mkdir(parents=True)
        events_path(run, rank).write_text("".join(json.dumps(e) + "\n" for e in events))
    assert said(str(run), "--rank", "1") == (
        f"labutils debug: rank 1 of {run} does not wait for a debugger now; rank 0 does: "
        "leave out --rank or pick one of them\n")


@pytest.mark.parametrize("how", ["warm", "cold"])
def test_a_rank_ended_at_its_breakpoint_leaves_no_socket_folder(tmp_path, how):
    """Rank 0 waits at breakpoint() for a debugger nobody opens while rank 1 raises, so
    its agent ends rank 0 there. A rank removes its socket's folder when its session
    ends; this one never ends its session, and its folders were left in the temporary
    folder, one for every such run, until the launcher removed them."""
    out = io.StringIO()  # a notebook's text display: the rank waits for `labutils debug`
    with tempfile.TemporaryDirectory(prefix="dbg-") as tmp:  # short: the socket fits in it
        result = launch(SCRIPTS / "endings.py", 2, args=["breakpoint_peer", "1"],
                        display=TextDisplay(out=out, err=out), backend="gloo",
                        warm=how == "warm", timeout=90, env={"TMPDIR": tmp},
                        log_dir=tmp_path / "runs")
        assert result.start == how and result.failure is not None and result.failure.rank == 1
        events = [json.loads(line) for line in
                  (result.log_dir / "rank0" / "events.jsonl").read_text().splitlines()]
        sockets = [ev["socket"] for ev in events if ev.get("kind") == "debugger"
                   and ev.get("state") == "waiting"]
        assert len(sockets) == 1 and sockets[0].startswith(tmp), events
        assert not any(ev.get("state") == "ended" for ev in events), events
        assert not Path(sockets[0]).parent.exists()
