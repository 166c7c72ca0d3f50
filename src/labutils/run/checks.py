"""The checks of single launch() inputs: the script, fault injection, the node count,
a job across machines, rendezvous settings. Each returns the input in the form the
launcher uses, or raises LaunchConfigError with one line: expected, given, how to fix.
make_spec (labutils.run.spec) calls them in turn.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from labutils.errors import LaunchConfigError, ScriptSyntaxError, whole_number

MAX_LOCAL_AGENTS = 8  # agents ("nodes") simulated on one machine
MAX_NODES = 1024  # machines in one multi-node job


def public_fault(fault: dict) -> dict:
    """A checked fault without the launcher's bookkeeping (what result.attempts shows).

    Args:
        fault: one entry of check_faults' list.
    """
    return {k: v for k, v in fault.items() if k != "restart"}


def check_script(script: str | os.PathLike) -> Path:
    """The script as an absolute path, or a one-line error (missing, not .py, bad syntax).

    Args:
        script: the path launch() was given.
    """
    if not isinstance(script, (str, os.PathLike)) or not str(script):
        raise LaunchConfigError("script", expected="a path to a .py file", given=script,
                                fix='pass the training script, e.g. launch("train.py", nproc=2)')
    path = Path(script).expanduser()
    if not path.exists():
        raise LaunchConfigError(
            "script", expected="an existing file", given=str(script),
            fix=f"check the name; the current folder is {os.getcwd()}",
        )
    if not path.is_file() or path.suffix != ".py":
        raise LaunchConfigError(
            "script", expected="a Python file ending in .py", given=str(script),
            fix="pass the .py file that each rank should run",
        )
    source = path.read_bytes()
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise ScriptSyntaxError(str(script), exc.lineno, exc.msg) from None
    except ValueError as exc:  # null bytes
        raise ScriptSyntaxError(str(script), None, str(exc)) from None
    path = path.resolve()
    check_no_shadowing(path)
    return path


# The top-level modules a rank has loaded once it imported torch, torch._dynamo (DDP's
# constructor imports it) and the launcher's bootstrap (torch 2.13, Linux), less those no
# file can replace: Python's built-in and frozen modules, and encodings (loaded at start).
# tests/run/test_config.py recomputes the list and fails when torch imports one not here.
TORCH_IMPORTS = frozenset([
    "argparse", "array", "ast", "asyncio", "base64", "binascii", "bisect", "bz2",
    "cProfile", "calendar", "cmath", "collections", "colorsys", "concurrent", "contextlib",
    "contextvars", "copy", "copyreg", "csv", "ctypes", "dataclasses", "datetime", "decimal",
    "difflib", "dis", "email", "enum", "fcntl", "fnmatch", "fractions", "functools",
    "getpass", "gettext", "glob", "grp", "gzip", "hashlib", "heapq", "hmac", "http",
    "importlib", "inspect", "ipaddress", "json", "keyword", "linecache", "locale",
    "logging", "lzma", "math", "mmap", "mpmath", "multiprocessing", "numbers", "numpy",
    "opcode", "operator", "pathlib", "pickle", "pickletools", "pkgutil", "platform",
    "pprint", "profile", "pstats", "queue", "quopri", "random", "re", "reprlib", "secrets",
    "select", "selectors", "shlex", "shutil", "signal", "socket", "ssl", "statistics",
    "string", "struct", "subprocess", "sympy", "sysconfig", "tarfile", "tempfile",
    "termios", "textwrap", "threading", "timeit", "token", "tokenize", "torch", "torchgen",
    "tqdm", "traceback", "types", "typing", "typing_extensions", "unicodedata", "unittest",
    "urllib", "uuid", "warnings", "weakref", "zipfile", "zlib",
])


def _shadowing(folder: Path) -> list[tuple[str, Path]]:
    """(module, file) for each file of folder that an import of one of TORCH_IMPORTS
    would load in its place with folder first on sys.path: NAME.py, or NAME/__init__.py."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return []
    found = []
    for entry in entries:
        name = entry.name.removesuffix(".py")
        if name not in TORCH_IMPORTS:
            continue
        path = Path(entry.path) if entry.name.endswith(".py") else Path(entry.path) / "__init__.py"
        if path.is_file():
            found.append((name, path))
    return found


def check_no_shadowing(script: Path) -> None:
    """A one-line error when the script's folder (first on a rank's sys.path, as under
    torchrun) or the current folder (first on the path of the launcher's own processes,
    started with python -m) holds a file named like a module torch imports: `import
    torch` would load the learner's file instead, and fail or misbehave in a cold start
    and under torchrun, while a warm rank, forked with torch already imported, would
    never see it. Refused before anything starts, so that warm and cold say the same.

    Args:
        script: the script's absolute path.
    """
    folders = [script.parent]
    try:
        if Path.cwd() != script.parent:
            folders.append(Path.cwd())
    except OSError:  # the current folder was deleted: nothing in it can be imported
        pass
    for folder in folders:
        for name, path in _shadowing(folder):
            module = "the torch package" if name == "torch" else f"the module {name}, which torch imports"
            what = path if path.parent == folder else path.parent  # NAME.py, or the package NAME
            if folder == script.parent:
                where, why = "the script's folder", (f"a rank's `import torch` would load it in place "
                                                     f"of {module} (under torchrun too)")
            else:
                where, why = "the current folder", (f"the launcher's processes, started here, would "
                                                    f"load it in place of {module}; or start from "
                                                    "another folder")
            raise LaunchConfigError(where, expected="no file named like a module torch imports",
                                    given=str(what), fix=f"rename it (e.g. my_{what.name}): {why}")


_FAULT_FIX = ('pass fault={"rank": 1, "step": 5}, {"rank": 1, "step": (3, 8), "seed": 0}, '
              '{"agent": 1, "step": 5} or a list of such dicts, one per attempt')


def _fault_step(fault: dict):
    step = fault["step"]
    if isinstance(step, (tuple, list)) and len(step) == 2 and all(
            whole_number(v) for v in step) and 0 <= step[0] <= step[1]:
        import random

        step = random.Random(fault.get("seed", 0)).randint(step[0], step[1])
    if not whole_number(step) or step < 0:
        raise LaunchConfigError("fault step", expected="a step >= 0 or a (low, high) range",
                                given=fault["step"], fix=_FAULT_FIX)
    return step


def _one_fault(fault, world_size: int, local_agents: int, min_nodes: int) -> dict:
    """One fault as {"rank": R, "step": S[, "phase": P]} or {"agent": A, "step": S}."""
    keys = set(fault) if isinstance(fault, dict) else set()
    if not isinstance(fault, dict) or "step" not in fault or \
            len(keys & {"rank", "agent"}) != 1 or keys - {"rank", "agent", "step", "seed", "phase"}:
        raise LaunchConfigError("fault", expected="a dict with 'rank' and 'step' (or 'agent' and 'step')",
                                given=fault, fix=_FAULT_FIX)
    if "agent" in fault:
        agent = fault["agent"]
        if local_agents < 2:
            raise LaunchConfigError(
                "fault agent", expected="a run with several agents", given=f"local_agents={local_agents}",
                fix='pass e.g. nnodes="1:2", local_agents=2 to have an agent that can leave')
        if not whole_number(agent) or not 1 <= agent < local_agents:
            raise LaunchConfigError(
                "fault agent", expected=f"an agent in 1..{local_agents - 1} (agent 0 hosts the "
                "rendezvous: without it no agent can meet again)", given=agent, fix=_FAULT_FIX)
        if local_agents - 1 < min_nodes:
            raise LaunchConfigError(
                "fault agent", expected=f"nnodes MIN <= {local_agents - 1} so the agents left "
                "can carry on", given=f"MIN={min_nodes}",
                fix=f'pass nnodes="{local_agents - 1}:{local_agents}"')
        if "phase" in fault:
            raise LaunchConfigError("fault", expected="no 'phase' for an agent fault",
                                    given=fault, fix=_FAULT_FIX)
        return {"agent": agent, "step": _fault_step(fault)}
    rank = fault["rank"]
    if not whole_number(rank) or not 0 <= rank < world_size:
        raise LaunchConfigError("fault rank", expected=f"a rank in 0..{world_size - 1}",
                                given=rank, fix=_FAULT_FIX)
    checked = {"rank": rank, "step": _fault_step(fault)}
    if "phase" in fault:
        if not isinstance(fault["phase"], str) or not fault["phase"]:
            raise LaunchConfigError("fault phase", expected="a non-empty string", given=fault["phase"],
                                    fix='pass e.g. "phase": "save" to match report(step=S, phase="save")')
        checked["phase"] = fault["phase"]
    return checked


def check_faults(fault, *, world_size: int, max_restarts: int, local_agents: int = 1,
                 min_nodes: int = 1) -> list[dict]:
    """Fault-injection requests as a list of checked faults, the k-th for restart k.

    Accepts one fault (for the first attempt) or a list of faults, one per attempt:

    - {"rank": R, "step": S}: SIGKILL rank R inside its report(step=S);
    - {"rank": R, "step": (lo, hi), "seed": k}: a step drawn from lo..hi (inclusive)
      with that seed, so the run can be repeated;
    - "phase": P added to a rank fault matches only report(step=S, phase=P), e.g. a
      report made in the middle of writing a checkpoint;
    - {"agent": A, "step": S}: stop agent A and its ranks (SIGKILL, as when a machine
      dies) the moment one of A's ranks reports step S; needs several agents.

    Each entry of a list is for one attempt: the k-th fires when torchrun's restart
    count (TORCHELASTIC_RESTART_COUNT) is k. Every fault needs a restart to recover
    from, so max_restarts must be at least the number of faults.

    Args:
        fault: one fault, a list of them, or None.
        world_size: the run's ranks (a rank fault names one of them).
        max_restarts: torchrun's restarts, at least one per fault.
        local_agents: agents on this machine (an agent fault names one of 1..N-1).
        min_nodes: nnodes' MIN (the agents left after an agent fault must reach it).
    """
    if fault is None:
        return []
    faults = list(fault) if isinstance(fault, (list, tuple)) else [fault]
    if not faults:
        raise LaunchConfigError("fault", expected="a fault dict or a non-empty list of them",
                                given=fault, fix=_FAULT_FIX)
    checked = [{"restart": k, **_one_fault(f, world_size, local_agents, min_nodes)}
               for k, f in enumerate(faults)]
    if max_restarts < len(checked):
        raise LaunchConfigError(
            "fault", expected=f"max_restarts >= {len(checked)} so the run can recover",
            given=f"max_restarts={max_restarts}",
            fix=f"pass max_restarts={len(checked)} (or more) together with fault=...",
        )
    return checked


def check_fault(fault, world_size: int, max_restarts: int) -> dict | None:
    """One fault-injection request for the first attempt, checked (see check_faults).

    Args:
        fault: one fault dict, or None.
        world_size: the run's ranks.
        max_restarts: torchrun's restarts (at least 1 with a fault).
    """
    if fault is None:
        return None
    if isinstance(fault, (list, tuple)):
        raise LaunchConfigError("fault", expected="one fault dict", given=fault, fix=_FAULT_FIX)
    return public_fault(check_faults(fault, world_size=world_size, max_restarts=max_restarts)[0])


def check_nnodes(nnodes, local_agents, *, multinode: bool = False) -> tuple[int, int, int]:
    """(min_nodes, max_nodes, local_agents) from nnodes ("N", N or "MIN:MAX") and local_agents.

    Without a rendezvous endpoint every node of a launch() runs on this machine:
    local_agents agents (default: MAX) join one rendezvous on loopback, so
    MIN <= local_agents <= MAX. With one (multinode), this machine is one node.

    Args:
        nnodes: launch()'s nnodes.
        local_agents: launch()'s local_agents (None: MAX).
        multinode: this launch() is one node of a job across machines.
    """
    fix = 'pass nnodes=1, nnodes=2 or nnodes="1:2" (MIN:MAX agents, each with nproc ranks)'
    lo = hi = None
    if whole_number(nnodes):
        lo = hi = nnodes
    elif isinstance(nnodes, str):
        parts = nnodes.split(":")
        if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
            lo, hi = int(parts[0]), int(parts[-1])
    if lo is None or hi is None or lo < 1 or hi < lo:  # hi is None exactly when lo is
        raise LaunchConfigError("nnodes", expected="N >= 1 or 'MIN:MAX' with 1 <= MIN <= MAX",
                                given=nnodes, fix=fix)
    if multinode:
        if hi > MAX_NODES:
            raise LaunchConfigError("nnodes", expected=f"at most {MAX_NODES} nodes", given=nnodes,
                                    fix=fix)
        if local_agents not in (None, 1):
            raise LaunchConfigError(
                "local_agents", expected="one agent per machine in a multi-node job",
                given=local_agents, fix="leave local_agents out and start one launch per node")
        return lo, hi, 1
    if hi > MAX_LOCAL_AGENTS:
        raise LaunchConfigError("nnodes", expected=f"at most {MAX_LOCAL_AGENTS} nodes on one machine",
                                given=nnodes, fix=fix)
    agents = hi if local_agents is None else local_agents
    if not whole_number(agents) or not lo <= agents <= hi:
        raise LaunchConfigError(
            "local_agents", expected=f"a whole number of agents in {lo}..{hi} (nnodes {nnodes})",
            given=local_agents,
            fix="leave it out to start MAX agents, or pass a count between MIN and MAX")
    return lo, hi, agents


_RDZV_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_MULTINODE_FIX = ('pass e.g. nnodes=2, node_rank=0, rdzv_endpoint="10.0.0.1:29500", '
                  'rdzv_id="job1" on node 0 and node_rank=1 on node 1')


def check_multinode(rdzv_endpoint, rdzv_id, node_rank, min_nodes: int, max_nodes: int):
    """(endpoint, id, node_rank) of a job across machines, or (None, None, None).

    rdzv_endpoint "HOST:PORT" is where the nodes meet: node 0's address when node
    ranks are given (torchrun's static rendezvous: global rank = node_rank * nproc +
    local rank), else the host of a c10d rendezvous (ranks assigned as nodes join,
    MIN:MAX nodes allowed). rdzv_id names the job on every node, and names the run
    folder, so nodes that share the log folder (NFS, a SLURM cluster's home) write
    one run folder that every node's launcher follows.

    Args:
        rdzv_endpoint: launch()'s rdzv_endpoint, None for a run on this machine.
        rdzv_id: launch()'s rdzv_id.
        node_rank: launch()'s node_rank, None for a c10d rendezvous.
        min_nodes: nnodes' MIN, as check_nnodes returned it.
        max_nodes: nnodes' MAX.
    """
    if rdzv_endpoint is None:
        for name, value in (("node_rank", node_rank), ("rdzv_id", rdzv_id)):
            if value is not None:
                raise LaunchConfigError(name, expected="rdzv_endpoint with it (a multi-node job)",
                                        given=value, fix=_MULTINODE_FIX)
        return None, None, None
    host, sep, port = str(rdzv_endpoint).rpartition(":")
    if not isinstance(rdzv_endpoint, str) or not sep or not host or not port.isdigit() \
            or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
        raise LaunchConfigError("rdzv_endpoint", expected="'HOST:PORT' with a port in 1..65535",
                                given=rdzv_endpoint, fix=_MULTINODE_FIX)
    if not isinstance(rdzv_id, str) or not _RDZV_ID.fullmatch(rdzv_id):
        raise LaunchConfigError(
            "rdzv_id", expected="the job's name on every node: letters, digits, '.', '_', '-'",
            given=rdzv_id, fix=_MULTINODE_FIX)
    if node_rank is not None:
        if not whole_number(node_rank) or not 0 <= node_rank < max_nodes:
            raise LaunchConfigError("node_rank", expected=f"a node rank in 0..{max_nodes - 1}",
                                    given=node_rank, fix=_MULTINODE_FIX)
        if min_nodes != max_nodes:
            raise LaunchConfigError(
                "nnodes", expected="a fixed node count N with node_rank (static rendezvous)",
                given=f"{min_nodes}:{max_nodes}",
                fix="pass nnodes=N with node ranks, or leave node_rank out for MIN:MAX (c10d)")
    return rdzv_endpoint, rdzv_id, node_rank


def check_node_rank_restarts(node_rank: int | None, max_restarts: int) -> None:
    """A job given node ranks cannot restart: torch's static rendezvous keeps its store
    for every attempt, and a restarted process group reads the keys the last attempt
    left there (3 of 3 restarts of plain torchrun across two nodes failed in
    init_process_group, torch 2.13; tests/run/test_multinode.py runs the c10d way).

    Args:
        node_rank: check_multinode's node rank (None: c10d).
        max_restarts: launch()'s max_restarts.
    """
    if node_rank is not None and max_restarts:
        raise LaunchConfigError(
            "node_rank", expected="max_restarts=0 with a node rank: torchrun's static rendezvous "
            "keeps one store for every attempt, and restarted ranks read the last attempt's "
            "addresses", given=f"node_rank={node_rank} with max_restarts={max_restarts}",
            fix="leave node_rank out (torchrun's c10d rendezvous gives each attempt a store of "
            "its own and numbers the nodes), or pass max_restarts=0")


def check_rdzv_conf(rdzv_conf) -> dict[str, str]:
    """Rendezvous settings (torchrun --rdzv-conf), as strings; None: none.

    Args:
        rdzv_conf: launch()'s rdzv_conf.
    """
    if rdzv_conf is None:
        return {}
    if not isinstance(rdzv_conf, dict) or not all(
            isinstance(k, str) and k.isidentifier() and isinstance(v, (str, int, float))
            and not isinstance(v, bool) for k, v in rdzv_conf.items()):
        raise LaunchConfigError(
            "rdzv_conf", expected="a dict of setting name to number or string",
            given=rdzv_conf, fix='pass e.g. rdzv_conf={"last_call_timeout": 5}')
    return {k: str(v) for k, v in rdzv_conf.items()}
