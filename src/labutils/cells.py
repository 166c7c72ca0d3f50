"""The rank side of a persistent world: every rank runs cells sent from the notebook
and keeps its variables between them (labutils.run.world is the notebook's side).

The world launches this file as the script of every rank, like any run: the worker
bootstrap runs it as ``__main__``, with its log files, stack dumps, progress events
and debugger. It joins the process group once (labutils.dist.init), connects to the
caller's Unix socket (ENV_WORLD_SOCKET) and says hello; then it answers one request
at a time, JSON lines both ways:

    {"op": "cell", "seq": N, "file": PATH}
        run the cell file in this rank's namespace, as IPython runs a cell: the value
        of a last expression is printed (repr) and sent back;
        -> {"seq": N, "rank": R, "ok": bool, "value": base64 pickle | None,
            "repr": str | None, "error": {...} | None, "interrupted": bool,
            "collectives": C, "names": [...]}
    {"op": "pull", "seq": N, "name": X}  ->  {"seq": N, "rank": R, "value": ..., "error": ...}
    {"op": "stop"}  ->  leaves the process group and ends the rank (exit code 0)

"collectives" is how many collectives this rank's default process group has run
(its sequence number): after an interrupted cell the caller compares them, and only
a world whose ranks agree is kept. "names" are the variables the cells defined, for
saying what a restart loses. The cell's own frames are in a file of the run folder,
so tracebacks, hang reports and the debugger show its lines; this loop's frames count
as the bootstrap's (runtime/frames.py) and are cut from them. A SIGINT (the caller's Stop or interrupt)
raises KeyboardInterrupt in the cell, which ends the cell, not the rank; when the
caller closes the socket (its kernel is gone), the rank ends.
"""

from __future__ import annotations

import ast
import base64
import builtins
import json
import os
import pickle
import signal
import socket
import sys
from typing import Any

from labutils.runtime import runfiles
from labutils.runtime.worker import describe_exception, flush_streams, write_stderr

# Names every rank's namespace starts with (not the learner's: a restart loses nothing of them).
PRELOADED = ("rank", "world_size", "device", "torch", "dist")


def collectives() -> int:
    """Collectives run so far by the default process group (-1 without one)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return -1
    try:
        group = dist.distributed_c10d._get_default_group()
        return int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return -1


def _encode(value: Any) -> str | None:
    try:
        return base64.b64encode(pickle.dumps(value)).decode()
    except Exception:  # noqa: BLE001 - an unpicklable value comes back as its repr only
        return None


def user_names(namespace: dict) -> list[str]:
    return sorted(n for n in namespace if not n.startswith("_") and n not in PRELOADED)


def run_cell(path: str, namespace: dict) -> dict:
    """Run one cell file in namespace; the reply's facts (without seq and rank)."""
    reply: dict[str, Any] = {"ok": True, "value": None, "repr": None, "error": None,
                             "interrupted": False}
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source, path)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        assert last is None or isinstance(last, ast.Expr)
        exec(compile(tree, path, "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), path, "eval"), namespace)
            if value is not None:
                namespace["_"] = value
                reply["repr"] = repr(value)
                print(reply["repr"])
                reply["value"] = _encode(value)
    except BaseException as exc:  # noqa: BLE001 - the cell ends; the rank goes on
        if exc.__traceback__ is not None:  # from the cell's own frames on
            exc.__traceback__ = exc.__traceback__.tb_next
        info = describe_exception(exc, path)
        reply.update(ok=False, error=info, interrupted=isinstance(exc, KeyboardInterrupt))
        write_stderr(info["traceback"])
        del exc
    flush_streams()
    reply["collectives"] = collectives()
    reply["names"] = user_names(namespace)
    return reply


def pull(name: str, namespace: dict, rank: int) -> dict:
    if name not in namespace:
        return {"value": None, "error": f"name {name!r} is not defined on rank {rank}",
                "missing": True}
    value = _encode(namespace[name])
    if value is None:
        return {"value": None, "error": f"{name} on rank {rank} cannot be pickled "
                                        f"({type(namespace[name]).__name__}); print it instead"}
    return {"value": value, "error": None}


def answer(request: dict, namespace: dict, rank: int) -> dict:
    """The reply to one request of the caller."""
    op = request.get("op")
    if op == "cell":
        reply = run_cell(request["file"], namespace)
    elif op == "pull":
        reply = pull(request["name"], namespace, rank)
    else:
        reply = {"error": f"unknown request {op!r}"}
    reply.update(seq=request.get("seq"), rank=rank)
    return reply


def main() -> None:
    import torch
    import torch.distributed as dist

    from labutils.dist import init

    # A Stop reaches the cell as KeyboardInterrupt (a forked rank starts with SIGINT's
    # default action, which would end the process).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path[0] = os.getcwd()  # the notebook's folder, as for %%torchrun, not this one's
    rank, world_size, device = init()
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins,
                                 "rank": rank, "world_size": world_size, "device": device,
                                 "torch": torch, "dist": dist}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ[runfiles.ENV_WORLD_SOCKET])
    conn.sendall(json.dumps({"hello": rank, "pid": os.getpid()}).encode() + b"\n")
    reader = conn.makefile("rb")
    while True:
        reply: dict | None = None
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            line = reader.readline()
            if not line:
                break  # the caller is gone
            request = json.loads(line)
            if request.get("op") == "stop":
                break
            reply = answer(request, namespace, rank)
        except KeyboardInterrupt:  # a Stop that came while no cell ran
            if reply is None:
                continue
        # SIGINT held while the reply goes out: half a reply would stall the caller
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        conn.sendall(json.dumps(reply).encode() + b"\n")
    conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
