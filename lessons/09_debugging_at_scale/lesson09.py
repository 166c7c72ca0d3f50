"""Helpers for the lesson 09 notebook: readings of the runs' errors, the flight
recorder's dumps and fr_trace's report, py-spy's and the launcher's stacks side by
side, a terminal that types into a rank's debugger, and the self-check. The rank
scripts do not import this.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from labutils.course import selfcheck
from labutils.course.tables import text_table
from labutils.runtime.runfiles import ENV_RUNS_DIR, shorten_build_paths

# -------------------------------------------------------------- errors of the ranks


def last_error(stderr: str) -> str:
    """The last line of a rank's error output that names an exception, build paths cut."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Quit)\b", line)]
    return shorten_build_paths((named or lines or [""])[-1])


def abort_lines(stderr: str) -> list[str]:
    """The C++ runtime's report of an exception nothing caught, from a rank's stderr: the
    'terminate called after throwing ...' line and the 'what():' line after it, build
    paths cut ([] when the rank wrote no such report)."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("terminate called after throwing"):
            return [shorten_build_paths(text.rstrip()) for text in lines[i:i + 2]]
    return []


def gloo_message(line: str) -> str:
    """An error line without its exception name and gloo's [source.cc:NN] prefix."""
    text = line.split(": ", 1)[1] if re.match(r"^[\w.]+: ", line) else line
    return re.sub(r"^\[[^\]]*\]\s*", "", text)


_OWN_CALL = (r"on ranks\. Rank {rank} is running collective: CollectiveFingerPrint\("
             r"SequenceNumber=(\d+),? ?OpType=(\w+)(?:, TensorShape=(\[[^\]]*\]))?")


def monitored_barrier_line(stderr: str) -> str | None:
    """What monitored_barrier logged on a rank ("[Rank 0]: Ranks 2, 3 failed to pass ..." on
    rank 0, "Rank 1 successfully reached monitoredBarrier, ..." on the others), without the
    log prefix (time, source file)."""
    found = re.findall(r"^\[rank\d+\]:\[\w+ [^\]]*\] (.*monitoredBarrier.*)$", stderr, re.M)
    return found[-1].strip() if found else None


def own_fingerprint(stderr: str, rank: int) -> str | None:
    """How a rank describes its own call in DETAIL's mismatch error: sequence number,
    operation and shape (what it says of the other rank's call is left out)."""
    m = re.search(_OWN_CALL.format(rank=rank), stderr)
    if m is None:
        return None
    shape = f", shape {m.group(3)}" if m.group(3) is not None else ""
    return f"call #{m.group(1)}: {m.group(2)}{shape}"


def counts_table(run) -> str:
    """Per rank of class_counts.py: its own counts, the sums one class at a time, and the
    sums of one tensor in a fixed order."""
    rows = []
    for rec in sorted(run.records, key=lambda r: r["rank"]):
        classes = list(rec["correct"])
        fmt = lambda d: " ".join(f"{c}={d[c]}" for c in classes)  # noqa: E731
        rows.append([rec["rank"], " ".join(rec["order"]), fmt(rec["own"]), fmt(rec["summed"]),
                     fmt(rec["correct"])])
    return text_table(["rank", "Counter order", "own counts", "summed class by class",
                       "summed as one tensor"], rows)


# ------------------------------------------------------------------ flight recorder


def fr_dumps(folder: str | os.PathLike, prefix: str = "rank_") -> dict[int, dict]:
    """rank -> the unpickled flight-recorder dump of that rank, from <folder>/<prefix><rank>."""
    dumps = {}
    for path in Path(folder).glob(f"{prefix}*"):
        tail = path.name[len(prefix):]
        if tail.isdigit():
            dumps[int(tail)] = pickle.loads(path.read_bytes())
    return dict(sorted(dumps.items()))


def fr_table(dumps: dict[int, dict], *, last: int = 3) -> str:
    """The last entries of each rank's dump: sequence number, operation, input sizes, state."""
    rows = []
    for rank, dump in dumps.items():
        for e in dump["entries"][-last:]:
            rows.append([rank, e["collective_seq_id"], e["profiling_name"], e["input_sizes"],
                         e["state"]])
    return text_table(["rank", "collective_seq_id", "profiling_name", "input_sizes", "state"],
                      rows)


def fr_verdict(output: str, *, script: str) -> str:
    """fr_trace's report, short: a crash as its last line; a finding without the notice
    about tabulate, and its stack trace cut to the frames in `script`."""
    lines = [line for line in output.splitlines() if line.strip()
             and not line.startswith("tabulate is not installed")]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        return "fr_trace crashed: " + lines[-1]
    out = []
    for line in lines:
        m = re.match(r"^\s*(\S+) at (.+):(\d+)$", line)
        if m is None:
            out.append(line.rstrip())
        elif os.path.basename(m.group(2)) == script:
            out.append(f"  {m.group(1)} at {script}:{m.group(3)}")
    return "\n".join(out) or "(fr_trace printed nothing)"


# ------------------------------------------------------------------------ py-spy


def py_spy_stacks(stdout: str) -> dict[int, str]:
    """rank -> what straggler.py's watchdog printed for it (a stack or a refusal)."""
    found: dict[int, list[str]] = {}
    current = None
    for line in stdout.splitlines():
        m = re.match(r"^py-spy dump --pid <rank (\d+)>$", line)
        if m:
            current = found.setdefault(int(m.group(1)), [])
        elif current is not None and (line.startswith(("Thread ", "    ", "py-spy "))):
            current.append(line)
        else:
            current = None
    return {rank: "\n".join(lines) for rank, lines in sorted(found.items())}


def innermost_line(stack: str, script: str) -> str | None:
    """The innermost "file:line" of `script` in a py-spy stack ("func (file:line)" frames)
    or in a faulthandler-style one ('File "...", line N in func')."""
    for line in stack.splitlines():
        m = re.search(r"\((?:.*/)?([^/()]+):(\d+)\)\s*$", line) or \
            re.search(r'File "(?:.*/)?([^/"]+)", line (\d+)', line)
        if m and m.group(1) == script:
            return f"{script}:{m.group(2)}"
    return None


def stacks_side_by_side(run, script: str) -> str:
    """Per rank: the script line py-spy found innermost, and the launcher's waiting line."""
    spied = py_spy_stacks(run.ranks[0].stdout)
    rows = []
    for rank in sorted(run.hang.waiting):
        seen = innermost_line(spied.get(rank, ""), script)
        launcher = os.path.basename(run.hang.waiting[rank])
        rows.append([rank, seen or "(no stack: see above)", launcher, "yes" if seen == launcher else "no"])
    return text_table(["rank", "py-spy: innermost line of the script", "launcher's hang report", "same"],
                      rows)


# ------------------------------------------------------------- a terminal debugger


class TerminalSession:
    """A terminal that attaches to a rank stopped at a breakpoint, as a learner would
    with `labutils debug RUN_FOLDER --rank R`, and types the given pdb commands.

    Start it before the launch() that will stop; it waits in a thread for the run
    folder whose rank R waits for a debugger. In JupyterLab the rank's pane is the
    debugger, so it does nothing there.
    """

    def __init__(self, commands: list[str], *, script: str, rank: int = 1,
                 runs: str | os.PathLike | None = None, timeout_s: float = 60.0) -> None:
        from labutils.notebook.modes import choose_mode

        self.commands, self.script, self.rank = commands, script, rank
        self.runs = Path(runs or os.environ.get(ENV_RUNS_DIR) or "runs")
        self.timeout_s = timeout_s
        self.pane = choose_mode() == "widgets"
        self.output: str | None = None
        self._stop = threading.Event()
        self._since = time.time() - 1.0
        self._thread = threading.Thread(target=self._attach, daemon=True)
        if not self.pane:
            self._thread.start()

    def _waiting_folder(self) -> Path | None:
        from labutils.runtime.debugger import waiting_sockets

        for folder in sorted(self.runs.glob(f"*-{self.script}-*"), reverse=True):
            if folder.stat().st_mtime >= self._since and self.rank in waiting_sockets(folder):
                return folder
        return None

    def _attach(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            folder = self._waiting_folder()
            if folder is not None:
                command = [sys.executable, "-m", "labutils.cli", "debug", str(folder),
                           "--rank", str(self.rank)]
                try:
                    done = subprocess.run(command, input="\n".join(self.commands) + "\n",
                                          capture_output=True, text=True, timeout=self.timeout_s)
                    self.output = done.stdout + done.stderr
                except subprocess.TimeoutExpired:
                    self.output = f"(the debugger did not answer within {self.timeout_s:g} s)"
                return
            time.sleep(0.1)

    def transcript(self) -> str:
        """What the terminal showed, machine paths shortened (call it after the run)."""
        if self.pane:
            return f"(JupyterLab: rank {self.rank}'s pane was the debugger)"
        self._thread.join(timeout=5.0)
        self._stop.set()
        if self.output is None:
            return "(no rank waited for a debugger)"
        text = self.output.replace(os.getcwd() + os.sep, "")
        return re.sub(r"/\S*/site-packages/", ".../site-packages/", text).rstrip()


# ------------------------------------------------------------------- self-check

EXPECTED = {
    "q1_timeout_minutes": (30, "1800000 ms; gloo's default, as default_pg_timeout printed"),
    "q2_detail_catches": (False, "every call is an all_reduce of shape [8]: the fingerprints are the same"),
    "q3_monitored_rank": (0, "rank 0 waits for a message from every other rank"),
    "q4_fr_entries_default": (2000, "the world of one in section 4 kept 2000 of 2500 calls"),
    "q5_first_bad_collective": (7, "the first line of fr_trace's report, after the pg_config fix"),
    "q6_prctl_option": ("PR_SET_PTRACER", "allow_tracing() in stack_dump.py"),
}


def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (None: not answered yet)."""
    selfcheck.check_answers(answers, EXPECTED, text="contains")
