"""Helpers for the lesson 01 notebook: the single-process reference, tables, plot, checks.

The rank scripts (ddp_train.py, exercise_manual_ddp.py) do not import this
module; only the notebook does.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from labutils.course import selfcheck
from labutils.course.tables import bytes_in, text_table
from model import PROOF, flat_grads, flat_params, make_batch, make_model, make_optimizer, param_bytes, shard

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


MiB = 2 ** 20


def replicas_at_once_runs(threads: dict[str, dict], records: list[dict]) -> dict[tuple[str, str], dict]:
    """{(model, "threads" | "processes"): {"alone_s", "together_s", "on_core",
    "sleeps_per_pass"}}: threads measured in this process, processes by ddp_train.py
    (part 4a)."""
    processes = {r["model"]: r for r in part(records, "processes at once")}
    return {(name, how): run for name in threads
            for how, run in (("threads", threads[name]), ("processes", processes[name]))}


def slowdowns(threads: dict[str, dict], records: list[dict]) -> dict[tuple[str, str], float]:
    """{(model, how): time of all replicas at once / time of one alone}."""
    return {key: run["together_s"] / run["alone_s"] for key, run in replicas_at_once_runs(threads, records).items()}


def slowdown_table(threads: dict[str, dict], records: list[dict]) -> str:
    """Replicas run alone, then N at once: on threads (this process), on processes (the
    DDP run); and how the replicas running at once spent their passes: their share on a
    core, and how often each went to sleep in a pass."""
    rows = [[name, how, f"{run['alone_s'] * 1e3:.2f}", f"{run['together_s'] * 1e3:.2f}",
             f"{run['together_s'] / run['alone_s']:.2f}x", f"{run['on_core']:.0%}", f"{run['sleeps_per_pass']:.2f}"]
            for (name, how), run in replicas_at_once_runs(threads, records).items()]
    return text_table(["model", "replicas on", "one alone (ms)", "all at once (ms)", "slowdown",
                       "on a core", "sleeps per pass"], rows, right=[2, 3, 4, 5, 6])


def gil_check(threads: dict[str, dict], records: list[dict], *, model: str = "MANY_SMALL_OPS") -> str:
    """The GIL's mark, apart from the machine's: running at once, threads go to sleep
    (to wait for the GIL) in pass after pass, processes hardly ever. Other work on the
    machine takes cores away from both, which costs time on a core but puts no one to
    sleep. Measured: quiet, about 100 sleeps per pass for the threads of MANY_SMALL_OPS;
    beside one busy process on two cores, when a thread that holds the GIL loses its
    core and the other waits the longer, down to 0.5."""
    runs = replicas_at_once_runs(threads, records)
    sleeps = {how: runs[model, how]["sleeps_per_pass"] for how in ("threads", "processes")}
    ok = sleeps["threads"] >= 0.25 and sleeps["threads"] >= 10 * sleeps["processes"]
    return (f"{model}: threads go to sleep at least once every 4 passes, and at least 10x as often "
            f"as processes: {ok}")


def step_table(single: dict, dp: dict, ddp_step: dict) -> str:
    """One training step on the same global batch, three ways. Each way's speed is
    against one process timed in turn with it, step for step: the machine's speed
    drifts, so DDP (timed in its own run) has a baseline of its own."""
    rows = []
    for run, base in ((single, single["step_s"]), (dp, single["step_s"]),
                      (ddp_step, ddp_step["one_process_step_s"])):
        rows.append([run["kind"], f"{run['step_s'] * 1e3:.2f}", f"{run['samples_per_s']:.0f}",
                     f"{base * 1e3:.2f}", f"{base / run['step_s']:.2f}x"])
    return text_table(["how", "ms per step", "samples/s", "one process, in turn (ms)",
                       "speed vs one process"], rows, right=[1, 2, 3, 4])


def ddp_beats_dp(single: dict, dp: dict, ddp_step: dict) -> str:
    """The section's claim, each way against its own baseline."""
    ddp_speed = ddp_step["one_process_step_s"] / ddp_step["step_s"]
    dp_speed = single["step_s"] / dp["step_s"]
    ok = ddp_speed > dp_speed
    near_one = max(ddp_speed, dp_speed) < 1.5  # 2 replicas, not 2x: per-op work is not split
    return (f"DDP faster than DataParallel's threads on MANY_SMALL_OPS, each against one process: {ok}"
            + ("" if ok else f" (DDP {ddp_speed:.2f}x, DataParallel {dp_speed:.2f}x)")
            + f"\nneither comes near twice one process's speed (both below 1.5x): {near_one}")


STAGE_ORDER = ("scatter", "replicate", "forward", "gather + loss", "backward", "reduce grads",
               "optimizer step", "busy")


def work_table(dp: dict) -> str:
    """Milliseconds each device spent in each DataParallel stage of the timed step."""
    if not dp.get("work"):
        return "(per-stage times are measured in the CPU re-creation only)"
    rows = [[stage, *(f"{w[stage] * 1e3:.2f}" for w in dp["work"])] for stage in STAGE_ORDER]
    rows.append(["whole step (wall clock)", *([f"{dp['step_s'] * 1e3:.2f}"] + [""] * (len(dp["work"]) - 1))])
    return text_table(["stage (ms per step)", *(f"device {w['device']}" for w in dp["work"])],
                      rows, right=list(range(1, len(dp["work"]) + 1)))


# ------------------------------------------------------------------ bytes

def traffic_by_devices(config: dict, *, per_device_batch: int, devices=(2, 4, 8)) -> dict[int, dict]:
    """One ThreadDataParallel step per number of devices; what it moved (bytes, from the
    real tensors) and the gradient bytes. {n: {"traffic": ..., "gradient_bytes": ...}}"""
    from data_parallel import ThreadDataParallel

    out = {}
    for n in devices:
        model = make_model(**config)
        dp = ThreadDataParallel(model, n)
        x, y = make_batch(0, n * per_device_batch, **config)
        dp.train_step(x, y, nn.functional.cross_entropy, make_optimizer(model))
        out[n] = {"traffic": dp.traffic(), "gradient_bytes": param_bytes(model)}
    return out


def device0_bytes(traffic: dict, *, n: int, nccl: bool) -> float:
    """Bytes device 0 sends + receives per step. Copies: replicate sends the parameters
    to each of the n-1 others, the reduce receives n-1 gradient sets. NCCL (what
    torch.cuda.comm uses when it can): broadcast and reduce forward the data GPU to GPU
    along a chain, so device 0 sends the parameters once and receives the sum once."""
    total = sum(t["device 0 sends"] + t["device 0 receives"] for t in traffic.values())
    if nccl:
        fan = traffic["parameters (replicate)"]["device 0 sends"] \
            + traffic["parameter gradients (reduce onto device 0)"]["device 0 receives"]
        total -= fan * (n - 2) / (n - 1)  # keep one copy of each, out of n - 1
    return total


def ddp_rank_bytes(gradient_bytes: int, n: int) -> float:
    """Bytes one rank sends + receives per step in a ring all-reduce of the gradients
    (lesson 02): 2(n-1)/n of them each way."""
    return 2 * 2 * (n - 1) / n * gradient_bytes


def traffic_table(by_n: dict[int, dict]) -> str:
    rows = []
    for n, run in by_n.items():
        copies = device0_bytes(run["traffic"], n=n, nccl=False)
        nccl = device0_bytes(run["traffic"], n=n, nccl=True)
        ddp = ddp_rank_bytes(run["gradient_bytes"], n)
        rows.append([n, bytes_in(copies, "MiB", 3), bytes_in(nccl, "MiB", 3), bytes_in(ddp, "MiB", 3), f"{copies / ddp:.2f}x"])
    return text_table(["devices", "DP device 0, copies (MiB)", "DP device 0, NCCL (MiB)",
                       "DDP rank (MiB)", "copies / DDP"], rows, right=[0, 1, 2, 3, 4])


def breakdown_table(traffic: dict) -> str:
    """What device 0 sends and receives in one step, by kind of tensor (copies)."""
    rows = [[what, bytes_in(t["device 0 sends"], "MiB", 3), bytes_in(t["device 0 receives"], "MiB", 3)] for what, t in traffic.items()]
    return text_table(["tensor", "device 0 sends (MiB)", "device 0 receives (MiB)"], rows, right=[1, 2])


def link_table(records: list[dict]) -> str:
    """Bytes through each host's link, measured by the kernel's interface counters."""
    rows = [[r["rank"], bytes_in(r["construction_received"], "MiB", 3), bytes_in(r["construction_sent"], "MiB", 3),
             bytes_in(r["step_received"], "MiB", 3), bytes_in(r["step_sent"], "MiB", 3)] for r in part(records, "link bytes")
            if r["step_received"] is not None]
    if not rows:
        return "(no link to count: the ranks ran on this machine's loopback)"
    return text_table(["rank", "received during DDP(model) (MiB)", "sent during DDP(model) (MiB)",
                       "received per step (MiB)", "sent per step (MiB)"], rows, right=[1, 2, 3, 4])


def check_link(records: list[dict], *, world_size: int, tolerance: float = 0.05) -> None:
    """The measured link bytes against the all-reduce share and the parameter bytes."""
    rows = [r for r in part(records, "link bytes") if r["step_received"] is not None]
    if not rows:
        print("link bytes not measured: the ranks ran on this machine's loopback")
        return
    gradients = rows[0]["gradient_bytes"]
    share = 2 * (world_size - 1) / world_size * gradients

    def near(value: float, target: float) -> bool:
        return abs(value - target) <= tolerance * target

    print(f"per step, every link carried 2(N-1)/N x the gradients each way (within {tolerance:.0%}):",
          all(near(r["step_received"], share) and near(r["step_sent"], share) for r in rows))
    receivers = [r for r in rows if r["rank"] != 0]
    print(f"while DDP(model) was built, every rank but 0 received the parameters once "
          f"(within {tolerance:.0%}):", all(near(r["construction_received"], gradients) for r in receivers))


def memory_text(dp: dict) -> str:
    """Bytes per device: what device 0 holds that the others do not."""
    rows = dp["memory"]
    names = [k for k in rows[0] if k != "device"]
    table = [[name, *(bytes_in(r[name], "MiB", 3) for r in rows)] for name in names]
    return text_table(["held during a step (MiB)", *(f"device {r['device']}" for r in rows)], table,
                      right=list(range(1, len(rows) + 1)))


def plot_lesson(threads: dict[str, dict], records: list[dict], steps: list[dict], by_n: dict[int, dict],
                wire_records: list[dict]):
    """Left: how often replicas run at once go to sleep, threads vs processes.
    Middle: the MANY_SMALL_OPS step three ways. Right: bytes per step through device 0
    vs a DDP rank."""
    import matplotlib.pyplot as plt

    fig, (ax_gil, ax_step, ax_bytes) = plt.subplots(1, 3, figsize=(15, 4.3))
    runs = replicas_at_once_runs(threads, records)
    names = list(threads)
    width = 0.38
    floor = 0.01  # a log scale has no 0: fewer sleeps than this show at it
    for k, (how, color) in enumerate((("threads", "#d62728"), ("processes", "#1f77b4"))):
        sleeps = [runs[m, how]["sleeps_per_pass"] for m in names]
        bars = ax_gil.bar([i + (k - 0.5) * width for i in range(len(names))],
                          [max(v, floor) for v in sleeps], width, label=f"replicas on {how}", color=color)
        ax_gil.bar_label(bars, labels=[f"{v:.2g}" for v in sleeps], fontsize=8)
    ax_gil.set_yscale("log")
    ax_gil.set_ylim(floor, 5e3)
    ax_gil.set_xticks(range(len(names)), names)
    ax_gil.set_ylabel("sleeps per pass (log scale)")
    ax_gil.set_title("replicas running at the same time: going to sleep")
    ax_gil.legend(fontsize=8, loc="upper right", ncols=2)

    labels = ["one process", "DataParallel\n(threads)", "DDP\n(processes)"]
    bars = ax_step.bar(labels, [r["step_s"] * 1e3 for r in steps], color=["#7f7f7f", "#d62728", "#1f77b4"])
    ax_step.bar_label(bars, fmt="%.1f")
    ax_step.set_ylabel("milliseconds per step (lower is better)")
    ax_step.set_title("MANY_SMALL_OPS, same global batch")

    ns = list(by_n)
    for label, values, style in (
            ("DataParallel device 0, copies", [device0_bytes(by_n[n]["traffic"], n=n, nccl=False) for n in ns], "o-"),
            ("DataParallel device 0, NCCL", [device0_bytes(by_n[n]["traffic"], n=n, nccl=True) for n in ns], "s--"),
            ("DDP rank, ring all-reduce", [ddp_rank_bytes(by_n[n]["gradient_bytes"], n) for n in ns], "^-")):
        ax_bytes.plot(ns, [v / MiB for v in values], style, label=label)
    measured = [r for r in part(wire_records, "link bytes") if r["step_received"] is not None]
    if measured:
        n_wire = len(part(wire_records, "link bytes"))
        ax_bytes.plot([n_wire] * len(measured), [(r["step_received"] + r["step_sent"]) / MiB for r in measured],
                      "k*", ms=12, label="DDP rank, measured on its link")
    ax_bytes.set_xticks(ns)
    ax_bytes.set_xlabel("devices (ranks)")
    ax_bytes.set_ylabel("MiB sent + received per step")
    ax_bytes.set_title("FEW_BIG_OPS: bytes through one device")
    ax_bytes.legend(fontsize=8)
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
        "q6_model_where_threads_wait": ("MANY_SMALL_OPS", "the slowdown table of section 4.1"),
    }
    selfcheck.check_answers(answers, expected)