"""`labutils doctor`: what this machine offers for distributed training, and advice."""

from __future__ import annotations

import os
import platform
import sys

# What torch takes a rank's thread count from, in the order it reads them.
THREAD_VARIABLES = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")


def recommended_world_size(cores: int, gpus: int) -> int:
    """Ranks to use for the lessons: one per GPU, else one per core between 2 and 4."""
    if gpus > 0:
        return gpus
    return max(2, min(4, cores))


def gpu_advice(gpus: int, starts_cold: bool) -> list[str]:
    """What a machine with GPUs should know: nccl, and why its runs start cold
    (starts_cold: the ranks can see an NVIDIA GPU, run/warm.py)."""
    if not gpus:
        return []
    return [f"use backend='nccl' (auto picks it) with up to {gpus} ranks, one GPU each",
            *(["runs start cold here, gloo ones too: a rank forked from a warm server could "
               "not use CUDA; CUDA_VISIBLE_DEVICES= (empty) hides the GPUs, and a CPU-only run "
               "then starts warm"] if starts_cold else [])]


def environment_report() -> dict:
    """Facts about this machine and the torch install, as plain data."""
    import torch
    import torch.distributed as dist

    from labutils.run.warm import ranks_see_a_gpu

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backends = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }
    world = recommended_world_size(cores or 1, gpus)
    advice = gpu_advice(gpus, starts_cold=ranks_see_a_gpu({}))
    if not gpus:
        advice.append("no GPU: every lesson runs on CPU with gloo")
        advice.append(f"the lessons start up to 4 ranks; with {cores} core(s) the ranks share "
                      "cores: results stay exact, timings show contention rather than scaling")
    threads = torch.get_num_threads()
    # The launcher gives each rank OMP_NUM_THREADS=1 unless the environment sets it, as
    # torchrun does; torch reads MKL_NUM_THREADS first, then OMP_NUM_THREADS (here too),
    # and caps the count at the cores. Named: those set to more than 1.
    named = [name for name in THREAD_VARIABLES if os.environ.get(name, "1").strip() != "1"]
    if named and threads > 1 and threads * world > (cores or 1):
        them = "them" if len(named) > 1 else "it"
        advice.append(" and ".join(f"{name}={os.environ[name]}" for name in named) +
                      f" in the environment: each rank computes with {threads} threads, "
                      f"{threads * world} for {world} ranks on {cores} core(s), and the lessons' "
                      f"timings slow down from it; unset {them} (each rank then gets 1) or set "
                      f"{them} to 1")
    return {
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.machine()}",  # not the kernel build: machine-specific
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "backends": backends,
        "gpus": gpus,
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "cpu_cores": cores,
        "recommended_world_size": world,
        "recommended_backend": "nccl" if gpus and backends["nccl"] else "gloo",
        "advice": advice,
    }


def format_report(report: dict) -> str:
    backends = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in report["backends"].items())
    gpus = report["gpus"]
    names = f" ({', '.join(report['gpu_names'])})" if report["gpu_names"] else ""
    lines = [
        f"python     {report['python']} on {report['platform']}",
        f"torch      {report['torch']} (CUDA {report['cuda'] or 'none'})",
        f"backends   {backends}",
        f"GPUs       {gpus}{names}",
        f"CPU cores  {report['cpu_cores']}",
        f"recommended: {report['recommended_world_size']} ranks with "
        f"{report['recommended_backend']}",
    ]
    lines += [f"  - {a}" for a in report["advice"]]
    return "\n".join(lines)
