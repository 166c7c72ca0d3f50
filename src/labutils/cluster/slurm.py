"""SLURM: write the sbatch script of a multi-node torchrun job, submit it, follow it, cancel it.

The script takes the rendezvous from SLURM's environment: the first node of the
allocation hosts torchrun's c10d store, one srun task per node runs one torchrun agent,
the job id is the rendezvous id, and each node's index ($SLURM_NODEID) is there as its
node rank for commands that want one::

    from labutils.cluster.slurm import SlurmJob, sbatch_script
    text = sbatch_script("train.py", nnodes=2, nproc_per_node=4, args=["--epochs", "2"])
    job = SlurmJob.submit(text, workdir=".")
    job.wait(timeout=600)            # "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", ...
    job.exit_code(), job.output_path

This module is the public face (labutils.slurm names it too) and the command line,
`labutils slurm` (add_subcommand); the script is written by labutils.cluster.sbatch,
the job followed by labutils.cluster.slurm_job.
"""

from __future__ import annotations

import argparse
import sys

from labutils.cluster.sbatch import (
    NodeCommand,
    NodeValues,
    ShellRef,
    sbatch_script,
    srun_command,
    torchrun_node_command,
)
from labutils.cluster.slurm_job import ACTIVE_STATES, SlurmError, SlurmJob, check_cluster
from labutils.errors import InputError, in_flag_words, write_out

__all__ = [
    "ACTIVE_STATES", "NodeCommand", "NodeValues", "ShellRef", "SlurmError", "SlurmJob",
    "add_subcommand", "check_cluster", "run_subcommand", "sbatch_script", "srun_command",
    "torchrun_node_command",
]


def add_subcommand(sub) -> argparse.ArgumentParser:
    """Register `labutils slurm` on the CLI's subparsers; the handler is in its defaults.

    Args:
        sub: the object argparse's add_subparsers() returned.
    """
    p = sub.add_parser(
        "slurm", help="write (and submit) an sbatch script for a multi-node torchrun job",
        description="Write the sbatch script that runs SCRIPT on NODES x NPROC ranks with "
        "torchrun (rendezvous taken from SLURM's environment) to --out or stdout; with "
        "--submit, submit it and print the job id. Exit status: 0 ok, 1 the submission "
        "failed, 2 usage error.",
        epilog="Arguments for the script go after --: labutils slurm train.py --nodes 2 "
        "--nproc 4 -- --epochs 2",
    )
    p.add_argument("script", help="the training script (.py), as the nodes see it")
    p.add_argument("--nodes", type=int, required=True, help="machines (one torchrun agent each)")
    p.add_argument("--nproc", type=int, required=True, help="ranks per machine")
    p.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's)")
    p.add_argument("--time", default="00:30:00", help="wall-clock limit, e.g. 00:30:00")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (nccl)")
    p.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per node (default NPROC)")
    p.add_argument("--job-name", default="torchrun", help="the name squeue shows")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port on the head node")
    p.add_argument("--python", default="python", help="the interpreter on the nodes")
    p.add_argument("--run-dir", default=None, help="the job's working folder (default: here)")
    p.add_argument("--job-output", default="slurm-%j.out",
                   help="the job's output file, %%j: job id (default slurm-%%j.out)")
    p.add_argument("--out", default=None, help="write the script here (default: stdout)")
    p.add_argument("--submit", action="store_true", help="submit it with sbatch, print the job id")
    p.set_defaults(handler=run_subcommand)
    return p


# sbatch_script()'s keywords and the flags of `labutils slurm` that set them
SLURM_FLAGS = {"nnodes": "--nodes", "nproc_per_node": "--nproc", "nproc": "--nproc",
               "time_limit": "--time", "partition": "--partition", "gpus_per_node": "--gpus-per-node",
               "cpus_per_task": "--cpus-per-task", "job_name": "--job-name", "rdzv_port": "--port",
               "python": "--python", "run_dir": "--run-dir", "output": "--job-output",
               "script": "script"}


def run_subcommand(ns: argparse.Namespace) -> int:
    """`labutils slurm`: write the script, submit it if asked; return the exit status.

    Args:
        ns: the parsed command line; ns.script_args holds what came after --.
    """
    try:
        text = sbatch_script(
            ns.script, nnodes=ns.nodes, nproc_per_node=ns.nproc,
            args=getattr(ns, "script_args", []), job_name=ns.job_name, partition=ns.partition,
            time_limit=ns.time, cpus_per_task=ns.cpus_per_task, gpus_per_node=ns.gpus_per_node,
            output=ns.job_output, run_dir=ns.run_dir, rdzv_port=ns.port, python=ns.python)
        if ns.out:
            write_out(ns.out, text)
        elif not ns.submit:
            sys.stdout.write(text)
        if ns.submit:
            job = SlurmJob.submit(text, ns.run_dir or ".")
            print(job.job_id)
            print(f"labutils slurm: submitted job {job.job_id}; output: {job.output_path}; "
                  f"stop it with: scancel {job.job_id}", file=sys.stderr)
    except InputError as exc:
        print(f"labutils slurm: {in_flag_words(exc, SLURM_FLAGS, bare=('nproc', 'nnodes'))}",
              file=sys.stderr)
        return 2
    except (SlurmError, OSError) as exc:
        print(f"labutils slurm: {exc}", file=sys.stderr)
        return 1
    return 0
