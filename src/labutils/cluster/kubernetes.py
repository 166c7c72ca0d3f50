"""A PyTorchJob manifest (Kubeflow training operator, kubeflow.org/v1) for a course script.

``labutils k8s SCRIPT --nnodes N --nproc P --image IMG`` writes the YAML; ``kubectl apply
-f`` submits it to a cluster where the training operator runs. Nothing here talks to a
cluster: the module only builds the manifest, checked in tests for structure and values.

What the operator does with the manifest (read from kubeflow/training-operator, v1 API:
pkg/apis/kubeflow.org/v1/pytorch_types.go, pytorch_defaults.go, pytorch_validation.go and
pkg/controller.v1/pytorch/envvar.go, master.go, elastic.go):

- ``spec.pytorchReplicaSpecs`` maps the replica types ``Master`` (at most one replica)
  and ``Worker`` to a replica count, a ``restartPolicy`` (Always, OnFailure, Never or
  ExitCode; the operator's default is OnFailure) and a pod template. One pod is one node
  for torchrun: N nodes are 1 Master + N-1 Workers.
- Each pod needs a container named ``pytorch``; its port named ``pytorchjob-port``
  (default 23456) becomes the rendezvous port. The operator makes a Service per pod, so
  the Master is reachable as ``<job>-master-0``.
- ``spec.nprocPerNode`` (a string, v1.7 and later) is torchrun's ranks per pod.
- In every container the operator sets ``MASTER_ADDR`` (``<job>-master-0``),
  ``MASTER_PORT`` (the port above), ``RANK`` (the pod's node rank: 0 for the Master,
  i+1 for Worker i, not a process rank), ``WORLD_SIZE`` (pods x nprocPerNode in recent
  versions, just pods in old ones) and ``PYTHONUNBUFFERED``; recent versions add torchrun's
  own variables ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
  ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` (torchrun reads ``PET_<OPTION>`` as the
  default of ``--<option>``).
- With ``spec.elasticPolicy`` (minReplicas, maxReplicas, maxRestarts, rdzvBackend, ...)
  it also sets ``PET_RDZV_ENDPOINT`` (``<job>-worker-0:<port>`` unless rdzvHost/rdzvPort
  say otherwise), ``PET_RDZV_BACKEND`` (c10d by default), ``PET_NNODES`` as MIN:MAX and
  ``PET_MAX_RESTARTS``. Its elastic examples run Workers only, which the Worker scale
  subresource can grow and shrink.

The command written here spells out every torchrun option, taking the pod-specific
values from the operator's variables through Kubernetes' ``$(VAR)`` expansion, so it
works with operator versions with and without the PET_ variables and a learner can read
where each value comes from.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from labutils.errors import InputError

__all__ = ["CONTAINER_COURSE_DIR", "RENDEZVOUS_PORT", "pytorchjob", "to_yaml", "add_subcommand"]

CONTAINER_COURSE_DIR = "/home/learner/course"  # the course's folder in docker/Dockerfile.*
RENDEZVOUS_PORT = 23456  # the operator's default for the port named pytorchjob-port
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


def pytorchjob(
    script: str | os.PathLike,
    *,
    nnodes: int,
    nproc: int,
    image: str,
    args: Sequence[str] = (),
    name: str | None = None,
    gpus_per_node: int = 0,
    cpu: str | None = None,
    memory: str | None = None,
    restart_policy: str | None = None,
    elastic: tuple[int, int] | None = None,
    max_restarts: int = 0,
    volume_claim: str | None = None,
    mount_path: str = "/mnt/shared",
    launcher: str = "torchrun",
    root: str | os.PathLike = ".",
) -> dict:
    """The PyTorchJob that runs ``script`` on ``nnodes`` pods x ``nproc`` ranks.

    Every input is checked first; a bad one raises InputError (one line) and nothing
    is built.

    Args:
        script: the training script, a .py file inside ``root``; the image must hold it
            at the same place under its working directory (the course images do).
        nnodes: pods (torchrun nodes): 1 Master + nnodes-1 Workers; with ``elastic``,
            the number of Workers to start with.
        nproc: ranks per pod (torchrun --nproc-per-node; spec.nprocPerNode).
        image: the container image, e.g. ``ghcr.io/you/dist-course:cpu``.
        args: arguments for the script, a list of strings.
        name: the job's name (a DNS label); default: from the script's file name.
        gpus_per_node: nvidia.com/gpu per pod; > 0 selects nccl and needs
            nproc <= gpus_per_node (one GPU per rank).
        cpu: CPU request per pod (e.g. "4" or "500m"); default: one core per rank.
        memory: memory request and limit per pod (e.g. "8Gi"); default: none.
        restart_policy: Never, OnFailure, Always or ExitCode; default: Never for a fixed
            job (a crash is reported, torchrun's --max-restarts retries inside the pod),
            OnFailure for an elastic one (a lost pod comes back and rejoins).
        elastic: (min, max) pods for an elastic job with torchrun's c10d rendezvous
            (elasticPolicy); None: a fixed job with torchrun's static rendezvous.
        max_restarts: torchrun --max-restarts (and elasticPolicy.maxRestarts).
        volume_claim: a PersistentVolumeClaim mounted in every pod at ``mount_path``
            for run logs and checkpoints; None: no shared volume.
        mount_path: where the claim is mounted.
        launcher: "torchrun", or "labutils" for ``labutils launch`` (hang detection,
            failure summary, per-rank logs in the shared volume; fixed jobs only).
        root: the local folder that the image holds as its working directory.

    Returns:
        The manifest as a dict (to_yaml() writes it).
    """
    script_path = _check_script(script, root)
    _check_counts(nnodes=nnodes, nproc=nproc, gpus_per_node=gpus_per_node, max_restarts=max_restarts)
    if not isinstance(image, str) or not _IMAGE.match(image):
        raise InputError("image", expected="an image reference like registry.example.com/course:cpu "
                         "(lowercase path, optional :tag)", given=image,
                         fix="pass the name you pushed the image under, e.g. ghcr.io/you/course:cpu")
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise InputError("args", expected="a list of strings", given=args,
                         fix='split the arguments, e.g. ["--epochs", "2"]')
    if launcher not in LAUNCHERS:
        raise InputError("launcher", expected="'torchrun' or 'labutils'", given=launcher,
                         fix="pass launcher='torchrun'")
    if elastic is not None:
        _check_elastic(elastic, nnodes=nnodes, launcher=launcher)
    if restart_policy is None:
        restart_policy = "OnFailure" if elastic else "Never"
    if restart_policy not in RESTART_POLICIES:
        raise InputError("restart policy", expected=" / ".join(RESTART_POLICIES), given=restart_policy,
                         fix="pass e.g. restart_policy='Never'")
    cpu = str(nproc) if cpu is None else str(cpu)
    _check_pod_resources(cpu=cpu, memory=memory, volume_claim=volume_claim, mount_path=mount_path)
    name = _check_name(name if name is not None else _default_name(script_path),
                       nnodes=nnodes, elastic=elastic)

    command = (_torchrun_command if launcher == "torchrun" else _labutils_command)(
        script_path, list(args), name=name, nnodes=nnodes, nproc=nproc, elastic=elastic,
        max_restarts=max_restarts, gpus=gpus_per_node,
        log_dir=mount_path if volume_claim else None)
    pod_args = dict(image=image, command=command, gpus=gpus_per_node, cpu=cpu,
                    memory=memory, volume_claim=volume_claim, mount_path=mount_path,
                    plain_torchrun=launcher == "torchrun")

    def replica(count: int) -> dict:  # a pod spec of its own each: YAML without anchors
        return {"replicas": count, "restartPolicy": restart_policy,
                "template": {"spec": _pod_spec(**pod_args)}}

    spec: dict = {"nprocPerNode": str(nproc)}
    if elastic is None:
        spec["pytorchReplicaSpecs"] = {"Master": replica(1)}
        if nnodes > 1:
            spec["pytorchReplicaSpecs"]["Worker"] = replica(nnodes - 1)
    else:
        spec["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": elastic[0],
                                 "maxReplicas": elastic[1], "maxRestarts": max_restarts}
        spec["pytorchReplicaSpecs"] = {"Worker": replica(nnodes)}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/created-by": "labutils"}},
        "spec": spec,
    }


def to_yaml(manifest: dict) -> str:
    """The manifest as YAML, after a comment saying what it runs and how to submit it.

    Args:
        manifest: a dict from pytorchjob().
    """
    import yaml  # PyYAML (requirements.lock); imported here so `labutils --help` stays fast

    spec = manifest["spec"]
    name = manifest["metadata"]["name"]
    replicas = {role: r["replicas"] for role, r in spec["pytorchReplicaSpecs"].items()}
    nodes = sum(replicas.values())
    if "elasticPolicy" in spec:
        policy = spec["elasticPolicy"]
        shape = (f"elastic: {nodes} Worker pods to start, "
                 f"{policy['minReplicas']}..{policy['maxReplicas']} allowed "
                 f"(c10d rendezvous on {name}-worker-0)")
        first_pod = f"{name}-worker-0"
    else:
        shape = f"{_count(nodes, 'pod')} (1 Master + {_count(nodes - 1, 'Worker')})"
        first_pod = f"{name}-master-0"
    container = spec["pytorchReplicaSpecs"][next(iter(replicas))]["template"]["spec"]["containers"][0]
    header = [
        f"# PyTorchJob {name}: {shape} x {spec['nprocPerNode']} ranks each.",
        f"# Command: {' '.join(container['command'])}",
        "# Needs the Kubeflow training operator. Submit and follow rank 0's pod:",
        f"#   kubectl apply -f FILE && kubectl logs -f {first_pod}",
        "# The operator sets MASTER_ADDR, MASTER_PORT, RANK (the pod's node rank) and WORLD_SIZE",
        "# in every pod (and PET_* for torchrun); $(VAR) in the command is filled from them.",
        "# Written by `labutils k8s`.",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _check_script(script: str | os.PathLike, root: str | os.PathLike) -> str:
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


def _check_counts(*, nnodes: int, nproc: int, gpus_per_node: int, max_restarts: int) -> None:
    for what, value, low in (("nnodes", nnodes, 1), ("nproc", nproc, 1),
                             ("gpus per node", gpus_per_node, 0), ("max restarts", max_restarts, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InputError(what, expected=f"an integer >= {low}", given=value,
                             fix=f"pass {what} >= {low}")
    if 0 < gpus_per_node < nproc:
        raise InputError("nproc", expected=f"at most {gpus_per_node} ranks per pod "
                         "(nccl: one GPU per rank)", given=nproc,
                         fix=f"pass nproc={gpus_per_node} or gpus_per_node={nproc}")


def _check_elastic(elastic, *, nnodes: int, launcher: str) -> None:
    ok = (isinstance(elastic, tuple) and len(elastic) == 2
          and all(isinstance(n, int) and not isinstance(n, bool) for n in elastic)
          and 1 <= elastic[0] <= nnodes <= elastic[1])
    if not ok:
        raise InputError("elastic", expected=f"(MIN, MAX) pods, 1 <= MIN <= nnodes ({nnodes}) <= MAX",
                         given=elastic, fix=f"pass e.g. elastic=(1, {max(nnodes, 2)})")
    if launcher != "torchrun":
        raise InputError("launcher", expected="'torchrun' for an elastic job", given=launcher,
                         fix="elastic jobs run plain torchrun (c10d rendezvous); drop the launcher")


def _check_pod_resources(*, cpu: str, memory, volume_claim, mount_path) -> None:
    if not _CPU.match(cpu):
        raise InputError("cpu", expected="a CPU quantity like 4 or 500m", given=cpu,
                         fix="pass e.g. cpu='4'")
    if memory is not None and not _MEMORY.match(str(memory)):
        raise InputError("memory", expected="a memory quantity like 8Gi or 512Mi", given=memory,
                         fix="pass e.g. memory='8Gi'")
    if volume_claim is not None and not (isinstance(volume_claim, str)
                                         and _DNS_LABEL.match(volume_claim.replace(".", "-"))):
        raise InputError("volume claim", expected="the name of a PersistentVolumeClaim (lowercase "
                         "letters, digits, '-', '.')", given=volume_claim,
                         fix="pass e.g. volume_claim='course-runs'")
    if not isinstance(mount_path, str) or not mount_path.startswith("/"):
        raise InputError("mount path", expected="an absolute path", given=mount_path,
                         fix="pass e.g. /mnt/shared")


def _default_name(script_path: str) -> str:
    stem = re.sub(r"[^a-z0-9]+", "-", Path(script_path).stem.lower()).strip("-")
    stem = re.sub(r"^[0-9-]+", "", stem)  # a DNS label starts with a letter
    return stem or "course-job"


def _check_name(name: str, *, nnodes: int, elastic) -> str:
    # Pod and Service names are <name>-master-0 / <name>-worker-<i>: they must be DNS labels too.
    last_worker = (elastic[1] if elastic else nnodes - 1) - 1
    longest = f"{name}-worker-{max(last_worker, 0)}"
    if not isinstance(name, str) or not _DNS_LABEL.match(name) or len(longest) > 63:
        longest_name = 63 - len(longest) + len(str(name))
        raise InputError("name", expected="a DNS label: lowercase letters, digits and '-', starting "
                         f"with a letter, at most {longest_name} characters", given=name,
                         fix="pass e.g. name='first-allreduce'")
    return name


def _torchrun_command(script, args, *, name, nnodes, nproc, elastic, max_restarts, gpus,
                      log_dir) -> list[str]:
    command = ["torchrun", f"--nproc-per-node={nproc}"]
    if elastic is None:  # static rendezvous: the Master pod hosts the store, each pod knows its rank
        command += [f"--nnodes={nnodes}", "--node-rank=$(RANK)",
                    "--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)"]
    else:  # c10d rendezvous on worker-0: pods may come and go between MIN and MAX
        command += [f"--nnodes={elastic[0]}:{elastic[1]}", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=$(PET_RDZV_ENDPOINT)", f"--rdzv-id={name}"]
    command.append(f"--max-restarts={max_restarts}")
    if log_dir:  # every rank's stdout/stderr also into the shared volume, one folder per pod
        command += [f"--log-dir={log_dir}/{name}/$(POD_NAME)", "--tee=3"]
    return command + [script, *args]


def _labutils_command(script, args, *, name, nnodes, nproc, elastic, max_restarts, gpus,
                      log_dir) -> list[str]:
    command = ["labutils", "launch", "-n", str(nproc), "--nnodes", str(nnodes), "--node-rank", "$(RANK)",
               "--rdzv-endpoint", "$(MASTER_ADDR):$(MASTER_PORT)", "--rdzv-id", name,
               "--max-restarts", str(max_restarts)]
    if gpus:
        command += ["--backend", "nccl"]
    if log_dir:  # every pod writes into one run folder there, so rank 0's summary sees all ranks
        command += ["--log-dir", log_dir]
    command.append(script)
    return command + (["--", *args] if args else [])


def _pod_spec(*, image, command, gpus, cpu, memory, volume_claim, mount_path, plain_torchrun) -> dict:
    requests: dict = {"cpu": cpu}
    limits: dict = {}
    if memory:
        requests["memory"] = limits["memory"] = str(memory)
    if gpus:
        limits["nvidia.com/gpu"] = gpus
    container: dict = {
        "name": "pytorch",  # the operator looks for a container with exactly this name
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": CONTAINER_COURSE_DIR,
        "command": list(command),
        "ports": [{"name": "pytorchjob-port", "containerPort": RENDEZVOUS_PORT}],
        "resources": {"requests": requests, **({"limits": limits} if limits else {})},
    }
    env = []
    if gpus and plain_torchrun:  # labutils.dist.init() reads it: nccl, or a clear error without GPUs
        env.append({"name": "LABUTILS_BACKEND", "value": "nccl"})
    if volume_claim and plain_torchrun:  # the pod's own name, for torchrun's --log-dir (downward API)
        env.append({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    if env:
        container["env"] = env
    mounts, volumes = [], []
    if volume_claim:
        mounts.append({"name": "shared", "mountPath": mount_path})
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": volume_claim}})
    if gpus:  # NCCL and DataLoader workers use /dev/shm; a container's default 64 MiB is too small
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if mounts:
        container["volumeMounts"] = mounts
    pod: dict = {"containers": [container]}
    if volumes:
        pod["volumes"] = volumes
    return pod


# ---- the `labutils k8s` subcommand -------------------------------------------------------

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
        print(f"labutils k8s: {exc}", file=sys.stderr)
        return 2
    text = to_yaml(manifest)
    if ns.out is None:
        sys.stdout.write(text)
        return 0
    Path(ns.out).write_text(text)
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
