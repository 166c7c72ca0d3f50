"""A PyTorchJob manifest (Kubeflow training operator, kubeflow.org/v1) for a course script.

labutils.cluster.kubernetes is the public face and the `labutils k8s` command; the input
checks are in labutils.cluster.pytorchjob_checks. Nothing here talks to a cluster: the
module only builds the manifest, checked in tests for structure and values.

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

import os
from collections.abc import Sequence

from labutils.cluster.pytorchjob_checks import (
    LAUNCHERS,
    RESTART_POLICIES,
    check_counts,
    check_elastic,
    check_image,
    check_name,
    check_pod_resources,
    check_script,
    default_name,
)
from labutils.errors import InputError
from labutils.runtime import runfiles

CONTAINER_COURSE_DIR = "/home/learner/course"  # the course's folder in docker/Dockerfile.*
RENDEZVOUS_PORT = 23456  # the operator's default for the port named pytorchjob-port


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
            (elasticPolicy); None: a fixed job, with torchrun's static rendezvous (pod k
            is node k) when max_restarts is 0, else c10d at the Master's address.
        max_restarts: torchrun --max-restarts (and elasticPolicy.maxRestarts). A fixed
            job that may restart meets through c10d: torch's static rendezvous keeps one
            store for every attempt, and restarted ranks read the last attempt's addresses.
        volume_claim: a PersistentVolumeClaim mounted in every pod at ``mount_path``
            for run logs and checkpoints; None: no shared volume.
        mount_path: where the claim is mounted.
        launcher: "torchrun", or "labutils" for ``labutils launch`` (hang detection,
            failure summary, per-rank logs in the shared volume; fixed jobs only).
        root: the local folder that the image holds as its working directory.

    Returns:
        The manifest as a dict (to_yaml() writes it).
    """
    script_path = check_script(script, root)
    check_counts(nnodes=nnodes, nproc=nproc, gpus_per_node=gpus_per_node, max_restarts=max_restarts)
    check_image(image)
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise InputError("args", expected="a list of strings", given=args,
                         fix='split the arguments, e.g. ["--epochs", "2"]')
    if launcher not in LAUNCHERS:
        raise InputError("launcher", expected="'torchrun' or 'labutils'", given=launcher,
                         fix="pass launcher='torchrun'")
    if elastic is not None:
        check_elastic(elastic, nnodes=nnodes, launcher=launcher)
    if restart_policy is None:
        restart_policy = "OnFailure" if elastic else "Never"
    if restart_policy not in RESTART_POLICIES:
        raise InputError("restart_policy", expected=" / ".join(RESTART_POLICIES), given=restart_policy,
                         fix="pass e.g. restart_policy='Never'")
    cpu = str(nproc) if cpu is None else str(cpu)
    check_pod_resources(cpu=cpu, memory=memory, volume_claim=volume_claim, mount_path=mount_path)
    name = check_name(name if name is not None else default_name(script_path),
                      nnodes=nnodes, elastic=elastic)

    command = (_torchrun_command if launcher == "torchrun" else _labutils_command)(
        script_path, list(args), name=name, nnodes=nnodes, nproc=nproc, elastic=elastic,
        max_restarts=max_restarts, gpus=gpus_per_node,
        log_dir=mount_path if volume_claim else None)
    pod_args = dict(image=image, command=command, gpus=gpus_per_node, cpu=cpu,
                    memory=memory, volume_claim=volume_claim, mount_path=mount_path,
                    plain_torchrun=launcher == "torchrun", restarts=bool(max_restarts or elastic))

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


def _torchrun_command(script, args, *, name, nnodes, nproc, elastic, max_restarts, gpus,
                      log_dir) -> list[str]:
    command = ["torchrun", f"--nproc-per-node={nproc}"]
    if elastic is None and not max_restarts:  # static: the Master pod hosts the store, each pod knows its rank
        command += [f"--nnodes={nnodes}", "--node-rank=$(RANK)",
                    "--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)"]
    elif elastic is None:  # c10d on the Master pod: a store of its own for every attempt
        command += [f"--nnodes={nnodes}", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)", f"--rdzv-id={name}"]
    else:  # c10d rendezvous on worker-0: pods may come and go between MIN and MAX
        command += [f"--nnodes={elastic[0]}:{elastic[1]}", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=$(PET_RDZV_ENDPOINT)", f"--rdzv-id={name}"]
    command.append(f"--max-restarts={max_restarts}")
    if log_dir:  # every rank's stdout/stderr also into the shared volume, one folder per pod
        command += [f"--log-dir={log_dir}/{name}/$(POD_NAME)", "--tee=3"]
    return command + [script, *args]


def _labutils_command(script, args, *, name, nnodes, nproc, elastic, max_restarts, gpus,
                      log_dir) -> list[str]:
    from labutils.run.options import node_words  # the run layer, imported back only here

    # $(VAR) is filled in by the operator from each pod's environment: its node rank and
    # the Master pod's address. With a log folder every pod writes into one run folder
    # there, so rank 0's summary sees all ranks.
    return ["labutils", *node_words(
        script=script, nproc=nproc, args=args, nnodes=nnodes,
        node_rank=None if max_restarts else "$(RANK)",  # static only when nothing restarts
        rdzv_endpoint="$(MASTER_ADDR):$(MASTER_PORT)", rdzv_id=name, max_restarts=max_restarts,
        backend="nccl" if gpus else "auto", log_dir=log_dir)]


def _pod_spec(*, image, command, gpus, cpu, memory, volume_claim, mount_path, plain_torchrun,
              restarts=False) -> dict:
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
    env: list[dict] = []
    if gpus and plain_torchrun:  # labutils.dist.init() reads it: nccl, or a clear error without GPUs
        env.append({"name": runfiles.ENV_BACKEND, "value": "nccl"})
    if restarts and plain_torchrun:
        # a store of its own for every rendezvous round, as launch() asks: with the store
        # torchrun shares by default, the restarted ranks read the last round's addresses
        # (2 of 2 restarts across two agents failed, torch 2.13; `labutils launch` sets it)
        env.append({"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"})
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
