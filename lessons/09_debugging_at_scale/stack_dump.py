"""A live process's Python stack with py-spy, from inside the job.

py-spy reads another process's memory through ptrace. Linux allows that to root, to
a process with CAP_SYS_PTRACE, and to a process of the same user, except that with
Yama's kernel.yama.ptrace_scope=1 (Ubuntu's default) only for the tracer's own
descendants. Ranks are siblings, not descendants of each other, so a rank that wants
to be inspected says so with prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) (allow_tracing).
In a container without CAP_SYS_PTRACE that is enough for a tracer of the same user;
scope 2 needs CAP_SYS_PTRACE and scope 3 forbids ptrace altogether.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys

PR_SET_PTRACER = 0x59616D61  # "Yama"
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
FIX = ("allow ptrace: run py-spy as root or with CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE), "
       "or set kernel.yama.ptrace_scope=0")


def allow_tracing() -> bool:
    """Let any process of this user trace this one; False where the call is refused or
    means nothing (no Yama, not Linux): then the usual ptrace rules apply."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0) == 0


def py_spy_dump(pid: int, *, timeout_s: float = 20.0) -> str:
    """`py-spy dump --pid PID`, cut to the main thread's frames down to the script's top
    level; or one line saying why there is no stack, and how to fix it."""
    beside_python = os.path.join(os.path.dirname(sys.executable), "py-spy")
    exe = beside_python if os.path.exists(beside_python) else "py-spy"
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=timeout_s, env={**os.environ, "NO_COLOR": "1", "CLICOLOR": "0"})
    except FileNotFoundError:
        return "py-spy is not installed: pip install py-spy"
    except subprocess.TimeoutExpired:
        return f"py-spy gave no answer within {timeout_s:g} s"
    if out.returncode != 0:
        return refusal(out.stderr)
    return main_thread(out.stdout)


def refusal(stderr: str) -> str:
    """One line for a py-spy that failed: the reason, and for a refused ptrace the fix."""
    text = stderr.lower()
    if "permission denied" in text or "operation not permitted" in text:
        return f"py-spy was refused (permission denied): {FIX}"
    if "no such file" in text or "no such process" in text:
        return "py-spy found no such process: it has ended"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return "py-spy failed: " + (lines[0] if lines else "no message")


def main_thread(dump: str) -> str:
    """The main thread of a py-spy dump (the one named MainThread, else the first: py-spy
    names threads only when the process imported threading), from its innermost frame
    down to the first <module> frame, the script's top level; below it is how the
    process was started."""
    threads: list[list[str]] = []
    for line in re.sub(r"\x1b\[[0-9;]*m", "", dump).splitlines():  # no colours
        if line.startswith("Thread "):
            threads.append([line.rstrip()])
        elif threads and line.strip():
            threads[-1].append(line.rstrip())
    if not threads:
        return dump.strip()
    main = next((t for t in threads if '"MainThread"' in t[0]), threads[0])
    top = next((i for i, line in enumerate(main) if line.strip().startswith("<module> ")), len(main) - 1)
    return "\n".join(main[: top + 1])
