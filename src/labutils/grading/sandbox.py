"""Run one command of a submission inside the strongest sandbox this machine allows.

    python -m labutils.grading.sandbox SPEC_JSON -- COMMAND...

SPEC_JSON (one argument) says where the command runs and what it may do::

    {"cwd": "/tmp/.../work", "readonly": ["/path/to/labs/01", "/path/to/out", ...],
     "isolate": true, "limits": {"memory_bytes": ..., "file_bytes": ..., "processes": ...},
     "env": {...}, "report": "/path/enforced.json"}

Each measure is tried on its own and what held is written to ``report``:

- namespaces (Linux; root, or unprivileged user namespaces): a PID namespace (the
  command and everything it starts die together when the sandbox ends; kill(-1) and
  killing a parent cannot reach outside), a network namespace with only loopback
  (torchrun and the Jupyter kernel talk over 127.0.0.1; nothing else is reachable), a
  mount namespace in which the grader's files (the lab, the output folder, the
  grader's own code and the Python installation) are mounted read-only;
- hidden paths: each path of "hide" (the lab's hidden checks, the solutions) is covered
  in the mount namespace, a file by an unreadable empty file and a folder by an empty
  unreadable tmpfs: opening one is a permission error;
- user: as root, the command becomes the unprivileged "user" [uid, gid] of the spec (an
  id of its own per submission), so files of other users are read and written by the
  usual permissions only; the grader first checks that this user can reach the Python
  installation and the working folder, and keeps root (with no capabilities) where not;
- capabilities: as root, every capability is dropped, so the command cannot undo the
  mounts or leave the namespaces; no_new_privs stops setuid programs giving them back;
- rlimits: address space per process (memory; the grader leaves it out for a CUDA
  build of torch and says why in "memory_note"), file size (output written to disk),
  core dumps off, and the number of processes where the kernel enforces it (not for
  root in the initial user namespace).

Where namespaces are refused (a container without CAP_SYS_ADMIN, say), or only some of
the steps succeed (a container that lets an unprivileged user create a user namespace
but not write its id maps: tried first in a throwaway child), the command still runs,
with the rlimits, in its own session and in no new namespace; the supervisor then relies
on its own process-tree tracking, and the grader on copies and hashes.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import resource
import signal
import socket
import struct
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# Flags a remount must keep (in a user namespace the kernel refuses to drop them).
_ST_FLAGS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
             os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME,
             os.ST_RELATIME: MS_RELATIME}
_CAP_VERSION_3 = 0x20080522
_MAX_CAP = 63
SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _call(name: str, *args) -> None:
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _mount(source, target, fstype, flags: int, data: str | None = None) -> None:
    _call("mount", None if source is None else source.encode(), target.encode(),
          None if fstype is None else fstype.encode(), ctypes.c_ulong(flags),
          None if data is None else data.encode())


def _map_ids() -> None:
    """In a fresh user namespace, map our own uid and gid (all an unprivileged user may)."""
    uid, gid = os.geteuid(), os.getegid()
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def _unshare(outer_uid: int, enforced: dict) -> None:
    """Enter new mount, network and PID namespaces (with a user namespace when not root),
    noted in enforced["namespaces"] as soon as they exist: a failure after that leaves
    half a sandbox, which cannot be undone."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    if outer_uid != 0:
        flags |= CLONE_NEWUSER
    _call("unshare", ctypes.c_int(flags))
    enforced["namespaces"] = ["pid", "net", "mount"] + (["user"] if outer_uid != 0 else [])
    if outer_uid != 0:
        _map_ids()


def _why_no_namespaces(outer_uid: int) -> str | None:
    """Make the namespaces in a throwaway child first: None when they can be made, else
    why not. unshare cannot be undone, and some containers let an unprivileged user
    create a user namespace but not write its id maps: a process that got that far
    would run the command with its children in a PID namespace of their own while
    /proc still shows the old one, so the pids its runs report would name other
    processes (a rank's pid 6 being the grader's)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        try:
            _unshare(outer_uid, {})
            _loopback_up()
            os._exit(0)
        except BaseException as exc:  # noqa: BLE001 - any failure is the answer
            os.write(write_end, str(exc).encode()[:500])
            os._exit(1)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        why = answer.read().decode(errors="replace")
    _, raw = os.waitpid(child, 0)
    return None if os.waitstatus_to_exitcode(raw) == 0 else why or "the namespaces could not be made"


def _loopback_up() -> None:
    """Bring up lo in the new network namespace (SIOCGIFFLAGS / SIOCSIFFLAGS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, req))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 0x1))  # IFF_UP


def _readonly(paths: list[str], enforced: dict) -> None:
    """Bind each path onto itself read-only; record which are, and why others are not."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount leaks to the host
    for path in dict.fromkeys(os.path.realpath(p) for p in paths):
        if not os.path.exists(path):
            continue
        try:
            keep = sum(ms for st, ms in _ST_FLAGS.items() if os.statvfs(path).f_flag & st)
            _mount(path, path, None, MS_BIND | MS_REC)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
            enforced["readonly"].append(path)
        except OSError as exc:  # the grader's copies and rewrites still protect results
            enforced.setdefault("readonly_errors", []).append(f"{path}: {exc}")


def _hide(paths: list[str], stub: str | None, enforced: dict) -> None:
    """Cover each path: a file by `stub` (an empty file nobody may read), a folder by an
    empty tmpfs nobody may enter. Called after _readonly, in the mount namespace."""
    for path in dict.fromkeys(os.path.realpath(p) for p in paths):
        if not os.path.exists(path):
            continue
        try:
            if os.path.isdir(path):
                _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY,
                       "mode=000,size=4k")
            elif stub:
                _mount(stub, path, None, MS_BIND)
                _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            else:
                raise OSError(errno.EINVAL, "no stub file to cover a file with")
            enforced["hidden"].append(path)
        except OSError as exc:
            enforced.setdefault("hidden_errors", []).append(f"{path}: {exc}")


def _become(user: list[int]) -> None:
    """Root becomes the submission's own unprivileged user (every capability goes)."""
    uid, gid = user
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _drop_bounding_set() -> None:
    """No capability can come back, whatever runs later (needs root's CAP_SETPCAP)."""
    for cap in range(_MAX_CAP + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the last capability this kernel knows


def _drop_capabilities() -> None:
    """Root without capabilities: no remounting, no leaving namespaces, no DAC override."""
    header = struct.pack("Ii", _CAP_VERSION_3, 0)
    data = ctypes.create_string_buffer(24)  # two empty (effective, permitted, inheritable)
    _call("capset", ctypes.c_char_p(header), data)


def set_limits(limits: dict, uid: int) -> list[str]:
    """rlimits for the command, which runs as uid."""
    held = []
    pairs = [("memory_bytes", resource.RLIMIT_AS, "memory per process"),
             ("file_bytes", resource.RLIMIT_FSIZE, "file size")]
    if uid != 0:  # the kernel never counts processes against root's limit
        pairs.append(("processes", resource.RLIMIT_NPROC, "processes"))
    for key, which, name in pairs:
        value = limits.get(key)
        if value:
            shown = f"{name} <= {int(value)}"
            if which == resource.RLIMIT_NPROC:
                # the kernel counts every thread of the user against RLIMIT_NPROC, and torch
                # starts a thread per core for each of its pools: allowed processes times
                # threads_per_process(), above the user's own (a fork bomb still stops
                # there; the supervisor counts the processes themselves)
                shown += f" (threads <= {int(value) * threads_per_process()} in all)"
                value = value * threads_per_process() + _threads_of(uid)
            resource.setrlimit(which, (int(value), int(value)))
            held.append(shown)
    if limits.get("memory_note"):   # why memory_bytes is not applied (a CUDA build)
        held.insert(0, str(limits["memory_note"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return held


def threads_per_process() -> int:
    """Threads one process of a submission may hold on average: torch's intra-op and
    inter-op pools (a thread per core each) and 32 more (the kernel's, gloo's, autograd's)."""
    return 2 * (os.cpu_count() or 1) + 32


def _threads_of(uid: int) -> int:
    """Threads of every process of uid (what RLIMIT_NPROC counts)."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                pass
    return count


def _exec(spec: dict, command: list[str], enforced: dict, outer_uid: int) -> None:
    """Last steps in the process that becomes the command."""
    user = spec.get("user") if outer_uid == 0 else None
    enforced["limits"] = set_limits(spec.get("limits", {}), user[0] if user else outer_uid)
    if outer_uid == 0 and (user or enforced.get("namespaces")):
        try:
            _drop_bounding_set()
            if user:
                _become(user)   # setuid away from root clears the capabilities it held
                enforced["user"] = f"uid {user[0]}"
            _drop_capabilities()
            enforced["capabilities"] = "all dropped"
        except OSError as exc:
            enforced["capabilities"] = f"kept ({exc})"
    if outer_uid == 0 and not user:
        enforced["user"] = f"root ({spec.get('user_why') or 'kept'})"
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    report = spec.get("_report_fd")
    if report is not None:  # opened before the mounts went read-only
        os.write(report, json.dumps(enforced).encode())
        os.close(report)
    os.chdir(spec["cwd"])
    os.execvpe(command[0], command, spec.get("env") or dict(os.environ))


def _fail(spec: dict, message: str) -> int:
    """The sandbox could not be set up: say so in the report (the grader's problem)."""
    print(f"sandbox: {message}", file=sys.stderr)
    report = spec.pop("_report_fd", None)
    if report is not None:
        os.write(report, json.dumps({"error": message}).encode())
    return SETUP_FAILED


def _init(child: int) -> int:
    """PID 1 of the namespace: reap everything, return the command's exit status."""
    status = 1
    while True:
        try:
            pid, raw = os.waitpid(-1, 0)
        except ChildProcessError:
            return status
        if pid == child:
            status = os.waitstatus_to_exitcode(raw)
            return status if status >= 0 else 128 - status


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m labutils.grading.sandbox SPEC_JSON -- COMMAND...", file=sys.stderr)
        return 2
    spec, command = json.loads(argv[0]), argv[2:]
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # die with the supervisor
    outer_uid = os.geteuid()
    if spec.get("report"):
        spec["_report_fd"] = os.open(spec["report"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    enforced: dict = {"namespaces": [], "readonly": [], "hidden": [], "network": "not isolated"}
    why_not = _why_no_namespaces(outer_uid) if spec.get("isolate", True) else None
    if why_not:  # the command runs in no new namespace: never in half a sandbox
        enforced["namespaces_error"] = why_not
    if spec.get("isolate", True) and not why_not:
        try:
            _unshare(outer_uid, enforced)
            _loopback_up()
            enforced["network"] = "loopback only"
            _readonly(spec.get("readonly", []), enforced)
            _hide(spec.get("hide", []), spec.get("hide_stub"), enforced)
        except OSError as exc:
            if enforced["namespaces"]:  # half a sandbox: a grader problem, said clearly
                return _fail(spec, f"namespaces created, then {exc}")
            enforced["namespaces_error"] = str(exc)
    if "pid" not in enforced["namespaces"]:
        _exec(spec, command, enforced, outer_uid)  # same pid: the supervisor tracks it
    child = os.fork()
    if child == 0:  # PID 1 of the new namespace
        try:
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            command_pid = os.fork()
            if command_pid == 0:
                _exec(spec, command, enforced, outer_uid)
            os._exit(_init(command_pid))
        except BaseException as exc:  # noqa: BLE001 - never fall back into the parent's code
            os._exit(_fail(spec, str(exc)))
    _, raw = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(raw)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
