"""Helpers for the lesson 01 notebook: the single-process reference, tables, plot, checks.

The rank scripts (ddp_train.py, exercise_manual_ddp.py) do not import this
module; only the notebook does.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from labutils import selfcheck
from labutils.tables import text_table
from labutils.timing import format_bytes
from model import PROOF, flat_grads, flat_params, make_batch, make_model, make_optimizer, shard

HERE = Path(__file__).parent


def part(records: Iterable[dict], name: str) -> list[dict]:
    """The records of one part of ddp_train.py, sorted by rank."""
    return sorted((r for r in records if r.get("part") == name), key=lambda r: r["rank"])


def one(records: Iterable[dict], name: str) -> dict:
    """The single record of one part (reported by rank 0)."""
    found = part(records, name)
    if len(found) != 1:
        raise LookupError(f"expected one {name!r} record, found {len(found)}")
    return found[0]


# ------------------------------------------------------------------ the reference

def reference_run(*, global_batch: int, steps: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One process, the whole batch: (gradients of the first step, parameters after ``steps``)."""
    model = make_model(**PROOF, seed=seed)
    optimizer = make_optimizer(model)
    first = None
    for step in range(steps):
        x, y = make_batch(step, global_batch, **PROOF)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if first is None:
            first = flat_grads(model)
        optimizer.step()
    return first, flat_params(model)


def one_rank_gradients(*, rank: int, world_size: int, per_rank_batch: int) -> torch.Tensor:
    """The first-step gradient of one rank's shard alone (what a rank computes before the all-reduce)."""
    model = make_model(**PROOF)
    x, y = make_batch(0, per_rank_batch * world_size, **PROOF)
    nn.functional.cross_entropy(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return flat_grads(model)


def check_equivalence(records: list[dict], *, world_size: int, per_rank_batch: int) -> None:
    """assert_close: DDP on world_size ranks x per_rank_batch == one process with the whole batch."""
    steps = part(records, "after steps")[0]["steps"]
    ddp_grads = torch.tensor(one(records, "first gradients")["grads"])
    ddp_params = torch.tensor(one(records, "final parameters")["params"])
    ref_grads, ref_params = reference_run(global_batch=world_size * per_rank_batch, steps=steps)
    torch.testing.assert_close(ddp_grads, ref_grads)
    print(f"first-step gradients: DDP ({world_size} ranks x {per_rank_batch}) == one process "
          f"(batch {world_size * per_rank_batch}): assert_close passed ({ddp_grads.numel()} values)")
    torch.testing.assert_close(ddp_params, ref_params)
    print(f"parameters after {steps} steps: assert_close passed")
    alone = one_rank_gradients(rank=0, world_size=world_size, per_rank_batch=per_rank_batch)
    print("rank 0's own batch alone gives the same gradient:",
          torch.allclose(alone, ref_grads, rtol=1.3e-6, atol=1e-5))


def check_thread_dp(*, n_devices: int = 2, global_batch: int = 16, steps: int = 3) -> None:
    """assert_close: ThreadDataParallel on n_devices == one process, same batch, ``steps`` steps."""
    from data_parallel import ThreadDataParallel

    reference, replicated = make_model(**PROOF), make_model(**PROOF)
    ref_opt, dp_opt = make_optimizer(reference), make_optimizer(replicated)
    dp = ThreadDataParallel(replicated, n_devices)
    for step in range(steps):
        x, y = make_batch(step, global_batch, **PROOF)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        dp.train_step(x, y, nn.functional.cross_entropy, dp_opt)
    torch.testing.assert_close(flat_params(replicated), flat_params(reference))
    print(f"ThreadDataParallel on {n_devices} devices == one process (batch {global_batch}) "
          f"after {steps} steps: assert_close passed")


# ------------------------------------------------------------------ tables

def construction_table(records: list[dict]) -> str:
    rows = [[r["rank"], f"{r['checksum_before']:.4f}", f"{r['checksum_after']:.4f}"]
            for r in part(records, "construction")]
    return text_table(["rank", "sum of parameters before DDP(model)", "after"], rows, right=[1, 2])


def backward_table(records: list[dict]) -> str:
    rows = [[r["rank"], f"{r['loss']:.4f}", f"{r['local_grad_norm']:.4f}", f"{r['ddp_grad_norm']:.4f}",
             "yes" if r["ddp_minus_mean_of_local"] <= 1e-6 else f"no ({r['ddp_minus_mean_of_local']:.1e})"]
            for r in part(records, "backward")]
    return text_table(["rank", "loss (own batch)", "|grad| own batch", "|grad| after backward",
                       "== mean of the ranks' own"], rows, right=[1, 2, 3])


def steps_table(records: list[dict]) -> str:
    rows = [[r["rank"], r["steps"], f"{r['checksum']:.4f}", f"{r['max_diff_to_rank0']:g}"]
            for r in part(records, "after steps")]
    return text_table(["rank", "steps", "sum of parameters", "max |difference| to rank 0"], rows,
                      right=[1, 2, 3])


def throughput_table(single: dict, dp: dict, ddp: dict) -> str:
    """Samples per second of the three ways to train on the same global batch."""
    base = single["samples_per_s"]
    rows = [[run["kind"], f"{run['step_s'] * 1e3:.1f}", f"{run['samples_per_s']:.0f}",
             f"{run['samples_per_s'] / base:.2f}x"] for run in (single, dp, ddp)]
    return text_table(["how", "ms per step", "samples/s", "vs one process"], rows, right=[1, 2, 3])


STAGE_ORDER = ("scatter", "replicate", "forward", "gather + loss", "backward", "reduce grads",
               "optimizer step", "busy")


def work_table(dp: dict) -> str:
    """Milliseconds per step each device spent in each DataParallel stage."""
    if not dp.get("work"):
        return "(per-stage times are measured in the CPU re-creation only)"
    rows = [[stage, *(f"{w[stage] * 1e3:.1f}" for w in dp["work"])] for stage in STAGE_ORDER]
    return text_table(["stage (ms per step)", *(f"device {w['device']}" for w in dp["work"])],
                      rows, right=list(range(1, len(dp["work"]) + 1)))


def memory_text(dp: dict) -> str:
    """Bytes per device: what device 0 holds that the others do not."""
    rows = dp["memory"]
    names = [k for k in rows[0] if k != "device"]
    table = [[name, *(format_bytes(r[name]) for r in rows)] for name in names]
    return text_table(["held during a step", *(f"device {r['device']}" for r in rows)], table,
                      right=list(range(1, len(rows) + 1)))


STAGE_COLORS = dict(zip(STAGE_ORDER[:-1], ("#c7c7c7", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                          "#8c564b", "#e377c2")))


def plot_dp_vs_ddp(single: dict, dp: dict, ddp: dict):
    """Left: samples/s of the three runs. Right: what each DataParallel device does per step
    (stage by stage) next to a DDP rank's step (compute, then waiting for the all-reduce)."""
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_work) = plt.subplots(1, 2, figsize=(14, 4.6), gridspec_kw={"width_ratios": [1, 1.5]})
    runs = [single, dp, ddp]
    n = len(dp["memory"])
    labels = ["one process\n1 core", f"DataParallel\n{n} {'GPUs' if 'GPU' in dp['kind'] else 'threads'}",
              f"DDP\n{ddp['kind'].split(', ')[1].split(' (')[0]}"]
    bars = ax_rate.bar(labels, [r["samples_per_s"] for r in runs], color=["#7f7f7f", "#d62728", "#1f77b4"])
    ax_rate.bar_label(bars, fmt="%.0f")
    ax_rate.set_ylabel("training throughput (samples per second)")
    ax_rate.set_title("same model, same global batch: higher is better")
    if dp.get("work"):
        rows = [f"DataParallel device {w['device']}" for w in dp["work"]]
        left = [0.0] * len(rows)
        for stage in STAGE_ORDER[:-1]:
            values = [w[stage] * 1e3 for w in dp["work"]]
            ax_work.barh(rows, values, left=left, color=STAGE_COLORS[stage], label=f"DP: {stage}")
            left = [a + v for a, v in zip(left, values)]
        ax_work.barh(["DataParallel step (wall clock)"], [dp["step_s"] * 1e3], color="#bbbbbb",
                     hatch="//", label="DP: whole step, threads included")
        compute = ddp["compute_only_step_s"] * 1e3
        sync = max(ddp["step_s"] * 1e3 - compute, 0.0)
        ax_work.barh(["DDP step (each rank)"], [compute], color="#1f77b4", label="DDP: compute")
        ax_work.barh(["DDP step (each rank)"], [sync], left=[compute], color="#9ecae1",
                     label="DDP: waiting for the all-reduce")
        ax_work.set_xlabel("milliseconds per step")
        ax_work.set_title("who does what in one step")
        ax_work.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax_work.invert_yaxis()
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ exercises

EXERCISE_FILE = HERE / "exercise_manual_ddp.py"


def check_manual_ddp(nproc: int = 2) -> None:
    """Exercise 1: run exercise_manual_ddp.py (once it is written) and compare with the reference."""
    from labutils import launch

    if "raise NotImplementedError" in EXERCISE_FILE.read_text():
        print(f"not attempted yet: write the two functions in {EXERCISE_FILE.name}, "
              "then run this cell again")
        return
    run = launch(EXERCISE_FILE, nproc=nproc, hang_timeout=10, timeout=180)
    if not run.ok:
        print(f"the run did not finish: {run.headline()}")
        return
    rec = next(r for r in run.records if r["rank"] == 0)
    _, ref_params = reference_run(global_batch=nproc * rec["per_rank_batch"], steps=rec["steps"])
    try:
        torch.testing.assert_close(torch.tensor(rec["params"]), ref_params)
    except AssertionError as exc:
        print("not yet: your parameters differ from one process on the whole batch.")
        print(str(exc).splitlines()[0], "- did you divide by the world size, and start from rank 0's parameters?")
        return
    print(f"correct: {nproc} ranks with your functions == one process on the whole batch")


def check_sum_loss_factor(factor: float, *, world_size: int = 2, per_rank_batch: int = 8) -> None:
    """Exercise 2: with reduction='sum' on every rank, which lr factor makes one
    process with the mean loss take the same step? Simulated exactly, in this process."""
    if factor is None:
        print("not answered yet")
        return
    lr = 0.05
    x, y = make_batch(0, world_size * per_rank_batch, **PROOF)
    ddp_model = make_model(**PROOF)
    grads = []  # what each rank's backward gives with the summed loss
    for r in range(world_size):
        ddp_model.zero_grad()
        nn.functional.cross_entropy(ddp_model(shard(x, r, world_size)), shard(y, r, world_size),
                                    reduction="sum").backward()
        grads.append(flat_grads(ddp_model))
    ddp_step = -lr * torch.stack(grads).mean(0)  # DDP averages them
    single = make_model(**PROOF)
    nn.functional.cross_entropy(single(x), y).backward()
    single_step = -lr * factor * flat_grads(single)
    if torch.allclose(ddp_step, single_step, rtol=1e-4, atol=1e-7):
        print(f"correct: with reduction='sum', DDP's step equals one process's mean-loss step "
              f"with lr x {factor:g}")
    else:
        ratio = (ddp_step.norm() / (-lr * flat_grads(single)).norm()).item()
        print(f"not quite: DDP's step is {ratio:.3g} times the mean-loss step, not {factor:g}")


def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (answers left as None are skipped)."""
    expected = {
        "q1_equivalent_single_batch": (64, "world size x per-rank batch"),
        "q2_params_come_from_rank": (0, "look at the construction table"),
        "q3_cpu_dataparallel_key_prefix": ("module.", "print(list(nn.DataParallel(model).state_dict()))"),
        "q4_device_ids_error": ("ValueError", "the error ddp_train.py reported"),
        "q5_dp_loss_device": (0, "the gather stage"),
    }
    selfcheck.check_answers(answers, expected)