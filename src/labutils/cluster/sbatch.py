"""The sbatch script of a multi-node torchrun job (labutils.cluster.slurm is the
public face; SlurmJob in labutils.cluster.slurm_job submits it).

The script takes the rendezvous from SLURM's environment: the first node of the
allocation hosts torchrun's c10d store, one srun task per node runs one torchrun agent,
the job id is the rendezvous id, and each node's index ($SLURM_NODEID) is there as its
node rank for commands that want one.

What each node runs is a function of the per-node values (NodeValues -> words):
torchrun_node_command by default; labutils' own launcher passes its own.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from labutils.errors import InputError, whole_number

_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_SHELL_REF = re.compile(r"^[A-Za-z0-9_${}:.-]+$")


@dataclass(frozen=True)
class ShellRef:
    """A value the shell of each node expands when its task starts, e.g. "$SLURM_NODEID".

    Written in double quotes in the script; literal words are single-quoted as needed.
    """

    text: str

    def __post_init__(self) -> None:
        if not _SHELL_REF.match(self.text):
            raise InputError("ShellRef", expected="variables, letters, digits and :.-_",
                             given=self.text, fix="keep literal text in plain str words")


@dataclass(frozen=True)
class NodeValues:
    """What the command run on each node may use (the ShellRef ones differ per job or node)."""

    script: str
    args: tuple[str, ...]
    nproc_per_node: int
    python: str
    run_dir: str | None
    rdzv_endpoint: ShellRef
    nnodes: ShellRef = ShellRef("$SLURM_NNODES")
    node_rank: ShellRef = ShellRef("$SLURM_NODEID")
    rdzv_id: ShellRef = ShellRef("$SLURM_JOB_ID")


NodeCommand = Callable[[NodeValues], Sequence["str | ShellRef"]]


def torchrun_node_command(node: NodeValues) -> list[str | ShellRef]:
    """Plain torchrun on one node: its agent joins the c10d rendezvous at the head node.

    No --node-rank: with the c10d backend torchrun numbers the nodes itself as they join
    (it would warn that it ignores one); node.node_rank is there for commands that use it.

    Args:
        node: the per-node values; nnodes, endpoint and id come from SLURM.
    """
    return [node.python, "-m", "torch.distributed.run",
            "--nnodes", node.nnodes, "--nproc-per-node", str(node.nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", node.rdzv_endpoint,
            "--rdzv-id", node.rdzv_id,
            node.script, *node.args]


def _shell_words(words: Sequence[str | ShellRef]) -> str:
    """One command line: literals quoted for the shell, ShellRefs left to expand;
    a new line before each --option, so the script reads one option per line."""
    lines: list[list[str]] = [[]]
    for word in words:
        if isinstance(word, ShellRef):
            lines[-1].append(f'"{word.text}"')
            continue
        if word.startswith("--") and lines[-1]:
            lines.append([])
        lines[-1].append(shlex.quote(word))
    return " \\\n        ".join(" ".join(line) for line in lines)


def srun_command(node_command: Sequence[str | ShellRef], *, gpus_per_node: int | None = None,
                 labutils_nodes: bool = False) -> str:
    """The srun line of the batch script: one task per node runs node_command.

    Args:
        node_command: the words each node runs; ShellRef words are expanded on the node.
        gpus_per_node: passed on to srun too, so the step gets the job's GPUs.
        labutils_nodes: the nodes are labutils launchers (see sbatch_script).
    """
    if not node_command:
        raise InputError("node_command", expected="a non-empty list of words", given=node_command,
                         fix="return e.g. torchrun_node_command(node) from the node command")
    gpus = f" --gpus-per-node={gpus_per_node}" if gpus_per_node else ""
    inner = "exec " + _shell_words(node_command) + (" </dev/null" if labutils_nodes else "")
    return ("exec srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 "
            f"--cpus-per-task=\"$SLURM_CPUS_PER_TASK\"{gpus} \\\n"
            f"    {'' if labutils_nodes else '--kill-on-bad-exit=1 '}--label \\\n"
            f"    bash -c {shlex.quote(inner)}\n")


def _positive(name: str, value: object, flag: str) -> int:
    if not whole_number(value) or value < 1:
        raise InputError(name, expected="an integer >= 1", given=value, fix=f"pass e.g. {flag}=2")
    return value


def _one_line(name: str, value: str, fix: str) -> str:
    if not isinstance(value, str) or not value or any(c in value for c in "\n\r"):
        raise InputError(name, expected="one non-empty line", given=value, fix=fix)
    return value


def sbatch_script(
    script: str,
    *,
    nnodes: int,
    nproc_per_node: int,
    args: Sequence[str] = (),
    job_name: str = "torchrun",
    partition: str | None = None,
    time_limit: str = "00:30:00",
    cpus_per_task: int | None = None,
    gpus_per_node: int | None = None,
    output: str = "slurm-%j.out",
    run_dir: str | Path | None = None,
    rdzv_port: int = 29500,
    python: str = "python",
    node_command: NodeCommand = torchrun_node_command,
    labutils_nodes: bool = False,
) -> str:
    """The text of an sbatch script that runs SCRIPT on nnodes x nproc_per_node ranks.

    Args:
        script: the training script, as the nodes see it (relative to run_dir, or absolute).
        nnodes: machines (#SBATCH --nodes); one torchrun agent runs on each.
        nproc_per_node: ranks per machine (torchrun --nproc-per-node).
        args: the script's own arguments.
        job_name: what squeue shows (letters, digits, _.+-).
        partition: the SLURM partition; None: the cluster's default.
        time_limit: SLURM's wall-clock limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
        cpus_per_task: CPUs per node for the agent and its ranks; None: nproc_per_node.
        gpus_per_node: GPUs per node (#SBATCH --gpus-per-node), for nccl; at least
            nproc_per_node, one GPU per rank. None: no GPU requested.
        output: where stdout and stderr of every node go; %j is the job id, %x its name;
            relative to run_dir.
        run_dir: the job's working folder (#SBATCH --chdir); None: where sbatch runs.
        rdzv_port: the port of the c10d store on the head node.
        python: the interpreter on the nodes.
        node_command: builds the words each node runs from NodeValues.
        labutils_nodes: the nodes are `labutils launch` nodes that follow the run folder
            they share (run/nodes.py): each stops its own ranks when another node
            failed, so srun does not end them (no --kill-on-bad-exit: that would end
            their keepers before they wrote how their ranks ended), and none reads input
            (</dev/null: a rank's debugger would read the end of srun's and quit).
    """
    if not isinstance(script, str) or not script.endswith(".py"):
        raise InputError("script", expected="a Python file name ending in .py", given=script,
                         fix="pass the training script, e.g. 'train.py'")
    _positive("nnodes", nnodes, "nnodes")
    _positive("nproc_per_node", nproc_per_node, "nproc_per_node")
    if cpus_per_task is None:
        cpus_per_task = nproc_per_node
    _positive("cpus_per_task", cpus_per_task, "cpus_per_task")
    if gpus_per_node is not None:
        _positive("gpus_per_node", gpus_per_node, "gpus_per_node")
        if gpus_per_node < nproc_per_node:
            raise InputError("gpus_per_node", expected=f"at least nproc_per_node={nproc_per_node} "
                             "(nccl: one GPU per rank)", given=gpus_per_node,
                             fix=f"pass gpus_per_node={nproc_per_node} or fewer ranks per node")
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise InputError("args", expected="a list of strings", given=args,
                         fix="pass e.g. args=['--epochs', '2']")
    if not isinstance(job_name, str) or not _NAME.match(job_name):
        raise InputError("job_name", expected="letters, digits and _.+-", given=job_name,
                         fix="pass e.g. job_name='ddp-train'")
    if partition is not None and (not isinstance(partition, str) or not _NAME.match(partition)):
        raise InputError("partition", expected="a partition name (sinfo lists them)",
                         given=partition, fix="pass e.g. partition='gpu', or leave it out for the cluster's default")
    if not isinstance(time_limit, str) or not _TIME.match(time_limit):
        raise InputError("time_limit", expected="MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS",
                         given=time_limit, fix="pass e.g. time_limit='00:30:00'")
    _one_line("output", output, "pass e.g. output='slurm-%j.out'")
    if not whole_number(rdzv_port) or not 1 <= rdzv_port <= 65535:
        raise InputError("rdzv_port", expected="a TCP port 1..65535", given=rdzv_port,
                         fix="pass e.g. rdzv_port=29500")
    _one_line("python", python, "pass e.g. python='python'")
    if run_dir is not None:
        run_dir = _one_line("run_dir", str(run_dir), "pass a folder the nodes can reach")

    node = NodeValues(script=script, args=tuple(args), nproc_per_node=nproc_per_node,
                      python=python, run_dir=run_dir,
                      rdzv_endpoint=ShellRef(f"$head_addr:{rdzv_port}"))
    directives = [
        f"--job-name={job_name}",
        f"--nodes={nnodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus_per_task}",
        *([f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []),
        *([f"--partition={partition}"] if partition else []),
        f"--time={time_limit}",
        f"--output={output}",
        *([f"--chdir={run_dir}"] if run_dir else []),
    ]
    sbatch_lines = "".join(f"#SBATCH {d}\n" for d in directives)
    ends = ("--kill-on-bad-exit=1: a node that fails ends the others, no rank waits\n# forever."
            if not labutils_nodes else "No --kill-on-bad-exit: each node stops its own ranks when\n"
            "# another node's failed, and records how each ended (they share the run folder).\n"
            "# </dev/null: no node reads input (a rank's debugger would read its end and quit).\n#")
    return f"""\
#!/bin/bash
# {nnodes} node(s) x {nproc_per_node} rank(s) of {script}, written by labutils.cluster.slurm.
#   submit: sbatch THIS_FILE    follow: squeue --me; tail -f {output.replace('%j', 'JOBID')}
#   stop:   scancel JOBID (every node's agent and ranks get SIGTERM, then SIGKILL)
# One task per node: a torchrun agent that starts the node's ranks, with the CPUs for them.
{sbatch_lines}set -euo pipefail

# Rendezvous: the first node of the allocation hosts torchrun's c10d store,
# at its address as SLURM knows it (NodeAddr), in case node names do not resolve.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
head_addr=$(scontrol -o show node "$head_node" | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')
export head_addr=${{head_addr:-$head_node}}
echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s) $SLURM_JOB_NODELIST, rendezvous $head_addr:{rdzv_port}"

# exec srun: srun replaces this shell, so scancel's signals reach it directly.
# One task per node; --cpus-per-task is repeated because srun (SLURM 22.05) does not
# inherit it. {ends} --label: every output line starts with its node's index.
# bash -c '...': $SLURM_NODEID and friends are expanded on each node, then exec lets
# the command replace bash, so SLURM's signals reach it.
{srun_command(node_command(node), gpus_per_node=gpus_per_node, labutils_nodes=labutils_nodes)}"""

