"""Helpers for the lesson 06 notebook: the in-process mixed-precision demos, readings of
the profiling and scaling runs, and the self-check; the two-node readings and the
cluster recipes are in nodes.py, imported here. The rank scripts do not import this.
"""

from __future__ import annotations

import math
import shutil
import statistics
from pathlib import Path

import torch
from torch import nn

from labutils.course import selfcheck
from labutils.course.tables import text_table

from nodes import (  # noqa: F401  (the notebook's L.node_commands, ...)
    bytes_claim, bytes_crossed, changed_lines, compose_node_services, first_error, interfaces_used,
    node_commands, rank_node_table, refused_loopback, ring_bytes_per_direction,
)

FILES = Path("runs") / "06_files"


def fresh_dir(name: str) -> str:
    """An empty folder for one run's files (runs/06_files/NAME)."""
    path = FILES / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return str(path)


def show_function(file: str, name: str) -> None:
    """Print the source of the top-level function `name` of one of this lesson's scripts."""
    import ast

    text = (Path(__file__).parent / file).read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            print(ast.get_source_segment(text, node))
            return
    raise LookupError(f"no function {name} in {file}")


def trace_file(name: str) -> str:
    """The Chrome trace profile_ddp.py wrote into fresh_dir(name)."""
    path = FILES / name / "ddp_step_rank0.json"
    return f"{path} ({path.stat().st_size / 1e6:.1f} MB)"


def trace_overlap(name: str) -> str:
    """From rank 0's Chrome trace: gloo:all_reduce events per profiled step, and whether
    in most steps the first of them started before the step's backward had computed its
    last gradient (the end of its last autograd::engine::evaluate_function event).

    The profiler's "backward" span cannot tell: it holds DDP's wait for the last
    buckets too, so under DDP every all-reduce starts inside it, overlapping or not.
    Most steps, not every one: the all-reduce runs on a gloo thread that waits for a
    core, and on a 2-core machine whose cores both compute that wait is sometimes
    longer than the few milliseconds of backward left (in 100 quiet steps: 3 ms at
    least, 10 ms at the median).
    """
    import json

    events = json.loads((FILES / name / "ddp_step_rank0.json").read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    backward = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("name") == "backward")
    ops = [(e["ts"], e["ts"] + e["dur"]) for e in spans
           if e.get("name", "").startswith("autograd::engine::evaluate_function: ")]
    starts = [e["ts"] for e in spans if e.get("name") == "gloo:all_reduce"]
    bounds = [lo for lo, _ in backward[1:]] + [math.inf]
    early, counts = 0, set()
    for (lo, end), nxt in zip(backward, bounds):
        mine = [t for t in starts if lo <= t < nxt]
        computed = max((b for a, b in ops if lo <= a <= end), default=None)
        counts.add(len(mine))
        early += bool(mine and computed is not None and min(mine) < computed)
    return (f"gloo:all_reduce events per profiled step: {', '.join(map(str, sorted(counts)))}\n"
            f"the first all_reduce started before backward computed its last gradient, in most "
            f"profiled steps: {2 * early > len(backward)}")


def batchnorm_table(run) -> str:
    """Per mode and rank: BatchNorm output, running statistics and gradients against
    BatchNorm on the whole batch in one process (ok: within 1e-5), and whether the
    ranks' running statistics are identical; or the error the mode raised."""
    rows = []
    modes = list(dict.fromkeys(r["mode"] for r in run.records))
    for mode in modes:
        recs = sorted((r for r in run.records if r["mode"] == mode), key=lambda r: r["rank"])
        agree = len({r.get("running_stats_sha") for r in recs}) == 1
        for r in recs:
            if "error" in r:
                rows.append([mode, r["rank"], "", "", "", "", r["error"]])
                continue
            close = [float(r[k]) < 1e-5 for k in ("bn_output_vs_reference",
                                                 "running_stats_vs_reference", "grads_vs_reference")]
            rows.append([mode, r["rank"], *close, agree, ""])
    return text_table(["mode", "rank", "output ok", "running stats ok", "grads ok",
                       "ranks' stats identical", "error"], rows)


def _tiny_problem(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    return model, x, y


def dtype_table(x: torch.Tensor, hidden: torch.Tensor, outputs: dict[str, torch.Tensor],
                linear: nn.Linear) -> str:
    """What each operation returned under autocast: the Linear's input and output, then
    each op applied to that output; last the Linear's parameter and its gradient."""
    def name(dtype: torch.dtype) -> str:
        return str(dtype).replace("torch.", "")

    rows = [["Linear (a matmul)", name(x.dtype), name(hidden.dtype)]]
    rows += [[op, name(hidden.dtype), name(out.dtype)] for op, out in outputs.items()]
    rows += [["Linear's weight (a parameter)", "", name(linear.weight.dtype)],
             ["its gradient, after backward", "", name(linear.weight.grad.dtype)]]
    return text_table(["operation under CPU autocast", "input dtype", "output dtype"], rows)


def autocast_dtypes(device: str, linear: nn.Linear, x: torch.Tensor, ops: dict) -> dict[str, str]:
    """The dtype each operation returns under bfloat16 autocast on `device` ("cpu" or
    "cuda"), given the output of a copy of `linear` on x; an operation that raises gives
    "fails (<its error's first line>)"."""
    import copy

    layer = copy.deepcopy(linear).to(device)
    out = {}
    with torch.autocast(device, dtype=torch.bfloat16):
        hidden = layer(x.to(device))
        out["Linear (a matmul)"] = str(hidden.dtype)
        for op, fn in ops.items():
            try:
                out[op] = str(fn(hidden).dtype)
            except (RuntimeError, NotImplementedError) as exc:
                out[op] = f"fails ({str(exc).strip().splitlines()[0][:60]})"
    return {op: dtype.replace("torch.", "") for op, dtype in out.items()}


def autocast_comparison(linear: nn.Linear, x: torch.Tensor, ops: dict) -> str:
    """One row per operation: its output dtype under CPU autocast and under CUDA autocast."""
    cpu, cuda = autocast_dtypes("cpu", linear, x, ops), autocast_dtypes("cuda", linear, x, ops)
    rows = [[op, cpu[op], cuda[op], "" if cpu[op] == cuda[op] else "differs"] for op in cpu]
    return text_table(["operation under bfloat16 autocast", "CPU", "CUDA", ""], rows)


def clip_order(max_norm: float = 1.0, init_scale: float = 2.0 ** 16) -> str:
    """clip_grad_norm_ before and after scaler.unscale_(), on the same gradients.

    Returns a table: the norm clip_grad_norm_ measured and the norm of the gradient
    the optimizer finally used, for the true gradient, clip-then-unscale (wrong) and
    unscale-then-clip (right).
    """
    rows = []
    for order in ("no scaler", "clip, then step (unscales inside)", "unscale_, clip, step"):
        model, x, y = _tiny_problem()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale,
                                      enabled=order != "no scaler")
        loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if order.startswith("unscale_"):
            scaler.unscale_(opt)
        seen = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        scaler.step(opt)  # unscales first if unscale_ was not called
        scaler.update()
        used = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
        rows.append([order, f"{seen:.4g}", f"{used:.4g}"])
    return text_table(["order", "norm clip saw", "norm of the gradient used"], rows)


def profile_reading(records: list[dict]) -> str:
    """The profiler's split of a step and the measured communication cost, in ms, one
    column per rank. Each line says where its number comes from: the profiled steps
    (slowed down by the profiler) or the steps timed without it. (How many all-reduces a
    step makes is trace_overlap's first line: a count has no place in a column of ms.)"""
    recs = sorted(records, key=lambda r: r["rank"])
    profiled = f"profiled, mean of {recs[0].get('profiled_steps', '?')} steps"
    timed = f"no profiler, median of {recs[0].get('timed_steps', '?')} steps"
    lines = [
        (f"forward ({profiled})", "forward_ms"),
        (f"backward ({profiled})", "backward_ms"),
        (f"optimizer ({profiled})", "optimizer_ms"),
        (f"all_reduce busy ({profiled})", "gloo:all_reduce_ms"),
        (f"step ({timed})", "step_ms"),
        (f"step, no comm ({timed})", "no_comm_step_ms"),
        ("waiting for comm (step - step, no comm)", None),
    ]
    rows = [[label] + [round(r["step_ms"] - r["no_comm_step_ms"], 2) if key is None else r.get(key)
                       for r in recs]
            for label, key in lines]
    return text_table(["per step, ms"] + [f"rank {r['rank']}" for r in recs], rows,
                      right=list(range(1, len(recs) + 1)))


# ------------------------------------------------------------------------- scaling
MODES = ("strong", "weak")


def link_bps(cluster) -> float:
    """The cluster's link rate as measured (bits/s); NaN when there is no shaped link
    (one host, or loopback mode): then the model has no wire to predict from."""
    return cluster.link["measured_bps"] if cluster.link else math.nan


def scaling_points(runs: dict) -> dict[int, dict]:
    """Per host count, from scaling.py's records: each mode's step (median over ranks)
    and compute (the slowest rank's: in a synchronous step every rank waits for it),
    the all-reduces alone (median over ranks), the gradients' bytes and the batch."""
    points = {}
    for hosts, run in sorted(runs.items()):
        if not run.ok:
            raise RuntimeError(f"the {hosts}-host scaling run failed: {run.headline()}")
        recs = run.records
        point = {f"{m}_step_s": statistics.median(r[f"{m}_step_s"] for r in recs) for m in MODES}
        point.update({f"{m}_compute_s": max(r[f"{m}_compute_s"] for r in recs) for m in MODES})
        point.update(alpha_s=statistics.median(r["tiny_allreduce_s"] for r in recs),
                     allreduce_s=statistics.median(r["grad_allreduce_s"] for r in recs),
                     grad_bytes=recs[0]["grad_bytes"], batch=recs[0]["batch"])
        points[hosts] = point
    return points


def _eff(mode: str, t1: float, hosts: int, tn: float) -> float:
    return t1 / (hosts * tn) if mode == "strong" else t1 / tn


def allreduce_table(points: dict, predicted: dict[int, float]) -> str:
    """The gradients' all-reduce alone: bytes each host sends, the model, the measurement."""
    rows = []
    for hosts, p in points.items():
        if hosts == 1:
            continue
        sent = 2 * (hosts - 1) / hosts * p["grad_bytes"]
        rows.append([hosts, f"{sent / 2**20:.2f}", f"{p['alpha_s'] * 1e3:.2f}",
                     f"{predicted[hosts] * 1e3:.1f}", f"{p['allreduce_s'] * 1e3:.1f}"])
    return text_table(["hosts", "each host sends (MiB)", "one-float call (ms)", "model (ms)",
                       "measured (ms)"], rows, right=[0, 1, 2, 3, 4])


def scaling_table(points: dict, predicted: dict[str, dict[int, float]]) -> str:
    """Per mode and host count: compute, the model's step and the measured one, and both
    efficiencies (each divides the same measured one-host step)."""
    rows = []
    for mode in MODES:
        t1 = points[1][f"{mode}_step_s"]
        for hosts, p in points.items():
            step, model = p[f"{mode}_step_s"], predicted[mode][hosts]
            batch = p["batch"] // hosts if mode == "strong" else p["batch"]
            effs = (["baseline", "100%"] if hosts == 1 else
                    [f"{_eff(mode, t1, hosts, model):.0%}", f"{_eff(mode, t1, hosts, step):.0%}"])
            rows.append([mode, hosts, batch, f"{p[f'{mode}_compute_s'] * 1e3:.1f}",
                         f"{model * 1e3:.1f}", f"{step * 1e3:.1f}", *effs])
    return text_table(["mode", "hosts", "batch per rank", "compute (ms)", "step, model (ms)",
                       "step, measured (ms)", "efficiency, model", "efficiency, measured"],
                      rows, right=[1, 2, 3, 4, 5, 6, 7])


def scaling_claims(points: dict, allreduce_predicted: dict[int, float],
                   predicted: dict[str, dict[int, float]], *, tolerance: float = 0.2) -> str:
    """The section's claims, each a True/False line with the margin it allows."""
    many = [n for n in points if n > 1]
    ring_ok = all(abs(points[n]["allreduce_s"] / allreduce_predicted[n] - 1) <= 0.15 for n in many)
    growth = points[4]["allreduce_s"] / points[2]["allreduce_s"]
    model_ok = all(abs(_eff(m, points[1][f"{m}_step_s"], n, points[n][f"{m}_step_s"]) /
                       _eff(m, points[1][f"{m}_step_s"], n, predicted[m][n]) - 1) <= tolerance
                   for m in MODES for n in many)
    effs = {m: {n: _eff(m, points[1][f"{m}_step_s"], n, points[n][f"{m}_step_s"]) for n in many}
            for m in MODES}
    return "\n".join([
        f"the gradients' all-reduce alone is within 15% of the ring model at 2 and 4 hosts: {ring_ok}",
        "it grows from 2 to 4 hosts as 2(n-1)/n does, 1 to 1.5 (measured ratio between 1.3 and "
        f"1.7): {1.3 <= growth <= 1.7}",
        f"measured efficiencies within {tolerance:.0%} of the model's, strong and weak, 2 and 4 "
        f"hosts: {model_ok}",
        "strong scaling efficiency below weak at 2 and 4 hosts (same all-reduce, less compute "
        f"per rank): {all(effs['strong'][n] < effs['weak'][n] for n in many)}",
        "efficiency falls from 2 to 4 hosts, strong and weak: "
        f"{all(effs[m][4] < effs[m][2] for m in MODES)}",
    ])


def finite(model: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """The model's predictions that are numbers (none without a link, in loopback mode)."""
    return {m: {n: t for n, t in d.items() if math.isfinite(t)} for m, d in model.items()}


def scaling_seconds(points: dict) -> dict[str, dict[int, float]]:
    """{"strong": {hosts: step seconds}, "weak": {...}} for viz.plot_scaling."""
    return {m: {n: p[f"{m}_step_s"] for n, p in points.items()} for m in MODES}


# The self-check: question -> (expected answer, hint shown for a wrong answer).
EXPECTED = {
    "q1_prefix": ("module.", "print(list(ddp.state_dict())[:1])"),
    "q2_strong_efficiency": (0.625, "T1 / (n * Tn) with T1 = 100 ms, n = 4, T4 = 40 ms"),
    "q3_weak_efficiency": (0.8, "T1 / Tn with T1 = 48 ms, T2 = 60 ms"),
    "q4_who_calls_forward": ("b", "the buffer broadcast in DDP's forward is a collective"),
    "q5_before_clip": ("c", "clip must measure the gradients the optimizer will use"),
    "q6_global_rank": ("9", "RANK = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK"),
    "q7_interface_variable": ("gloo_socket_ifname", "gloo offered its peers a loopback address; "
                              "which variable names the interface it should use?"),
}


def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (None: not answered yet)."""
    selfcheck.check_answers(answers, EXPECTED, rel_tol=0.015)  # 0.625 +- 0.01

def plot_step_split(records: list[dict]):
    """Per rank: the step without communication, the time waited for all-reduces on top,
    and (thin bar) how long gloo's all-reduces were busy, mostly hidden behind backward."""
    import matplotlib.pyplot as plt

    recs = sorted(records, key=lambda r: r["rank"])
    fig, ax = plt.subplots(figsize=(9.0, 1.2 + 0.9 * len(recs)))
    for i, r in enumerate(recs):
        compute, total = r["no_comm_step_ms"], r["step_ms"]
        ax.barh(i + 0.15, compute, height=0.35, color="tab:blue",
                label="step without communication (no_sync)" if i == 0 else None)
        ax.barh(i + 0.15, max(total - compute, 0), left=compute, height=0.35, color="tab:red",
                label="waiting for all-reduce (exposed)" if i == 0 else None)
        ax.barh(i - 0.2, r.get("gloo:all_reduce_ms", 0), height=0.2, color="tab:orange",
                label="all-reduce busy (profiler, overlaps backward)" if i == 0 else None)
    ax.set_yticks(range(len(recs)), [f"rank {r['rank']}" for r in recs])
    ax.set_xlabel("milliseconds per training step")
    ax.set_title("where a DDP step's time goes")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return fig
