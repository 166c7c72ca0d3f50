"""Kubernetes: a PyTorchJob manifest (Kubeflow training operator) for a course script.

``labutils k8s SCRIPT --nnodes N --nproc P --image IMG`` writes the YAML; ``kubectl apply
-f`` submits it to a cluster where the training operator runs. Nothing here talks to a
cluster. This module is the public face (labutils.kubernetes names it too) and the
command line (add_subcommand); the manifest is built by labutils.cluster.pytorchjob,
whose docstring says what the operator does with it.
"""

from __future__ import annotations

import argparse
import sys

from labutils.cluster.pytorchjob import CONTAINER_COURSE_DIR, RENDEZVOUS_PORT, pytorchjob, to_yaml
from labutils.cluster.pytorchjob_checks import LAUNCHERS, RESTART_POLICIES
from labutils.errors import InputError, in_flag_words, write_out

__all__ = ["CONTAINER_COURSE_DIR", "RENDEZVOUS_PORT", "pytorchjob", "to_yaml", "add_subcommand"]


def add_subcommand(sub) -> None:
    """Register ``labutils k8s`` on the CLI's subparsers; its handler is ns.handler(ns) -> exit status.

    Args:
        sub: the object argparse's add_subparsers() returned.
    """
    p = sub.add_parser(
        "k8s", help="write a Kubernetes PyTorchJob manifest (Kubeflow training operator) for a script",
        description="Write a PyTorchJob (kubeflow.org/v1) that runs SCRIPT on NNODES pods x NPROC ranks "
        "with torchrun. Submit it with kubectl apply -f FILE. Exit status: 0 written, 2 bad input.",
        epilog="Arguments for the script go after --: labutils k8s train.py --nnodes 2 --nproc 4 "
        "--image ghcr.io/you/dist-course:cuda --gpus-per-node 4 -- --epochs 2",
    )
    p.add_argument("script", help="the training script (.py), inside the current folder")
    p.add_argument("--nnodes", type=int, required=True, help="pods: 1 Master + NNODES-1 Workers")
    p.add_argument("-n", "--nproc", type=int, required=True, help="ranks per pod")
    p.add_argument("--image", required=True, help="container image with the course, e.g. from docker/")
    p.add_argument("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu per pod; > 0 uses nccl")
    p.add_argument("--name", default=None, help="job name (default: from the script's name)")
    p.add_argument("--out", default=None, help="write the YAML here (default: print it)")
    p.add_argument("--cpu", default=None, help="CPU request per pod (default: NPROC)")
    p.add_argument("--memory", default=None, help="memory request and limit per pod, e.g. 8Gi")
    p.add_argument("--elastic", default=None, metavar="MIN:MAX",
                   help="elastic job: MIN..MAX Worker pods, c10d rendezvous (elasticPolicy)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a failure")
    p.add_argument("--restart-policy", default=None, choices=RESTART_POLICIES,
                   help="pod restart policy (default: Never, OnFailure when elastic)")
    p.add_argument("--volume", default=None, metavar="CLAIM",
                   help="PersistentVolumeClaim for logs and checkpoints, mounted at --mount-path")
    p.add_argument("--mount-path", default="/mnt/shared",
                   help="where --volume is mounted (default /mnt/shared)")
    p.add_argument("--launcher", default="torchrun", choices=LAUNCHERS,
                   help="torchrun, or labutils launch (hang detection, summary; fixed jobs only)")
    p.set_defaults(handler=run_k8s)


# pytorchjob()'s keywords and the flags of `labutils k8s` that set them
K8S_FLAGS = {"nnodes": "--nnodes", "nproc": "-n/--nproc", "image": "--image", "name": "--name",
             "gpus_per_node": "--gpus-per-node", "cpu": "--cpu", "memory": "--memory",
             "restart_policy": "--restart-policy", "elastic": "--elastic", "max_restarts": "--max-restarts",
             "volume_claim": "--volume", "mount_path": "--mount-path", "launcher": "--launcher",
             "script": "script"}


def run_k8s(ns: argparse.Namespace) -> int:
    """Handler of ``labutils k8s``: write or print the manifest; 0, or 2 for bad input.

    Args:
        ns: the parsed command line; ns.script_args holds what came after --.
    """
    try:
        manifest = pytorchjob(
            ns.script, nnodes=ns.nnodes, nproc=ns.nproc, image=ns.image,
            args=list(getattr(ns, "script_args", None) or []), name=ns.name,
            gpus_per_node=ns.gpus_per_node, cpu=ns.cpu, memory=ns.memory,
            restart_policy=ns.restart_policy, elastic=_parse_elastic(ns.elastic),
            max_restarts=ns.max_restarts, volume_claim=ns.volume, mount_path=ns.mount_path,
            launcher=ns.launcher)
    except InputError as exc:
        print(f"labutils k8s: {in_flag_words(exc, K8S_FLAGS, bare=('nproc', 'nnodes'))}", file=sys.stderr)
        return 2
    text = to_yaml(manifest)
    if ns.out is None:
        sys.stdout.write(text)
        return 0
    try:
        write_out(ns.out, text)
    except InputError as exc:
        print(f"labutils k8s: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {ns.out}: submit with kubectl apply -f {ns.out}")
    return 0


def _parse_elastic(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit():
        raise InputError("--elastic", expected="MIN:MAX pods, e.g. 1:4", given=text,
                         fix="pass e.g. --elastic 1:4")
    return int(lo), int(hi)
