"""The input checks of a PyTorchJob (labutils.cluster.pytorchjob): each raises
InputError (one line: expected, given, how to fix) before anything is built.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from labutils.errors import InputError, whole_number

RESTART_POLICIES = ("Never", "OnFailure", "Always", "ExitCode")
LAUNCHERS = ("torchrun", "labutils")

# Docker's image reference grammar, slightly simplified: [registry[:port]/]path[:tag][@digest]
_IMAGE = re.compile(
    r"^(?:(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
    r"(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1035, as the operator checks
_CPU = re.compile(r"^[0-9]+(\.[0-9]+)?m?$")
_MEMORY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")


def check_script(script: str | os.PathLike, root: str | os.PathLike) -> str:
    """The script's path inside root, as the image holds it (POSIX, relative).

    Args:
        script: the training script, a .py file.
        root: the local folder the image holds as its working directory.
    """
    path = Path(script)
    if path.suffix != ".py":
        raise InputError("script", expected="a Python file (.py)", given=str(script),
                         fix="pass the training script, e.g. lessons/00_first_distributed_run/"
                         "first_allreduce.py")
    if not path.is_file():
        raise InputError("script", expected="an existing .py file", given=str(script),
                         fix="check the path (relative to the current folder)")
    try:
        return path.resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        raise InputError("script", expected=f"a file inside the course folder {root}", given=str(script),
                         fix="put the script in the course folder, which the image holds") from None


def check_image(image: str) -> None:
    """An image reference Docker accepts: [registry[:port]/]path[:tag][@digest].

    Args:
        image: the container image's name.
    """
    if not isinstance(image, str) or not _IMAGE.match(image):
        raise InputError("image", expected="an image reference like registry.example.com/course:cpu "
                         "(lowercase path, optional :tag)", given=image,
                         fix="pass the name you pushed the image under, e.g. ghcr.io/you/course:cpu")


def check_counts(*, nnodes: int, nproc: int, gpus_per_node: int, max_restarts: int) -> None:
    """Whole numbers in range, and one GPU per rank where the pods have GPUs.

    Args:
        nnodes: pods, at least 1.
        nproc: ranks per pod, at least 1.
        gpus_per_node: GPUs per pod, 0 or more.
        max_restarts: torchrun's restarts, 0 or more.
    """
    for what, value, low in (("nnodes", nnodes, 1), ("nproc", nproc, 1),
                             ("gpus_per_node", gpus_per_node, 0), ("max_restarts", max_restarts, 0)):
        if not whole_number(value) or value < low:
            raise InputError(what, expected=f"an integer >= {low}", given=value,
                             fix=f"pass {what} >= {low}")
    if 0 < gpus_per_node < nproc:
        raise InputError("nproc", expected=f"at most {gpus_per_node} ranks per pod "
                         "(nccl: one GPU per rank)", given=nproc,
                         fix=f"pass nproc={gpus_per_node} or gpus_per_node={nproc}")


def check_elastic(elastic: tuple[int, int], *, nnodes: int, launcher: str) -> None:
    """(MIN, MAX) pods around nnodes, and plain torchrun (its c10d rendezvous).

    Args:
        elastic: (MIN, MAX) pods.
        nnodes: the pods to start with.
        launcher: "torchrun" or "labutils".
    """
    ok = (isinstance(elastic, tuple) and len(elastic) == 2
          and all(whole_number(n) for n in elastic)
          and 1 <= elastic[0] <= nnodes <= elastic[1])
    if not ok:
        raise InputError("elastic", expected=f"(MIN, MAX) pods, 1 <= MIN <= nnodes ({nnodes}) <= MAX",
                         given=elastic, fix=f"pass e.g. elastic=(1, {max(nnodes, 2)})")
    if launcher != "torchrun":
        raise InputError("launcher", expected="'torchrun' for an elastic job", given=launcher,
                         fix="elastic jobs run plain torchrun (c10d rendezvous); drop the launcher")


def check_pod_resources(*, cpu: str, memory: str | None, volume_claim: str | None,
                        mount_path: str) -> None:
    """Kubernetes quantities for CPU and memory, a claim's name, an absolute mount path.

    Args:
        cpu: CPU request per pod, e.g. "4" or "500m".
        memory: memory per pod, e.g. "8Gi", or None.
        volume_claim: a PersistentVolumeClaim's name, or None.
        mount_path: where the claim is mounted.
    """
    if not _CPU.match(cpu):
        raise InputError("cpu", expected="a CPU quantity like 4 or 500m", given=cpu,
                         fix="pass e.g. cpu='4'")
    if memory is not None and not _MEMORY.match(str(memory)):
        raise InputError("memory", expected="a memory quantity like 8Gi or 512Mi", given=memory,
                         fix="pass e.g. memory='8Gi'")
    if volume_claim is not None and not (isinstance(volume_claim, str)
                                         and _DNS_LABEL.match(volume_claim.replace(".", "-"))):
        raise InputError("volume_claim", expected="the name of a PersistentVolumeClaim (lowercase "
                         "letters, digits, '-', '.')", given=volume_claim,
                         fix="pass e.g. volume_claim='course-runs'")
    if not isinstance(mount_path, str) or not mount_path.startswith("/"):
        raise InputError("mount_path", expected="an absolute path", given=mount_path,
                         fix="pass e.g. /mnt/shared")


def default_name(script_path: str) -> str:
    """A job name (a DNS label) from the script's file name.

    Args:
        script_path: the script's path.
    """
    stem = re.sub(r"[^a-z0-9]+", "-", Path(script_path).stem.lower()).strip("-")
    stem = re.sub(r"^[0-9-]+", "", stem)  # a DNS label starts with a letter
    return stem or "course-job"


def check_name(name: str, *, nnodes: int, elastic: tuple[int, int] | None) -> str:
    """name, when it and every pod's name made of it are DNS labels.

    Args:
        name: the job's name.
        nnodes: pods of a fixed job.
        elastic: (MIN, MAX) pods of an elastic job, or None.
    """
    # Pod and Service names are <name>-master-0 / <name>-worker-<i>: they must be DNS labels too.
    last_worker = (elastic[1] if elastic else nnodes - 1) - 1
    longest = f"{name}-worker-{max(last_worker, 0)}"
    if not isinstance(name, str) or not _DNS_LABEL.match(name) or len(longest) > 63:
        longest_name = 63 - len(longest) + len(str(name))
        raise InputError("name", expected="a DNS label: lowercase letters, digits and '-', starting "
                         f"with a letter, at most {longest_name} characters", given=name,
                         fix="pass e.g. name='first-allreduce'")
    return name
