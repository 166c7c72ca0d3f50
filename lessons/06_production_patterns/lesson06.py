"""Helpers for the lesson 06 notebook: the in-process mixed-precision demos, readings of
the profiling, scaling and two-node runs, the cluster recipes, and the self-check. The
rank scripts do not import this.
"""

from __future__ import annotations

import math
import shlex
import shutil
import statistics
from pathlib import Path

import torch
from torch import nn

from labutils.course import selfcheck
from labutils.course.tables import text_table


FILES = Path("runs") / "06_files"
REPO = Path(__file__).resolve().parents[2]  # the course folder: lessons/, docker/, src/


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
    """From rank 0's Chrome trace: gloo:all_reduce events per profiled step, and in how
    many steps one of them started before that step's backward ended."""
    import json

    events = json.loads((FILES / name / "ddp_step_rank0.json").read_text())["traceEvents"]
    backward = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "backward")
    starts = [e["ts"] for e in events if e.get("name") == "gloo:all_reduce"]
    per_step = [[t for t in starts if lo <= t < (backward[i + 1][0] if i + 1 < len(backward) else math.inf)]
                for i, (lo, _) in enumerate(backward)]
    early = sum(any(t < end for t in ts) for ts, (_, end) in zip(per_step, backward))
    counts = sorted({len(ts) for ts in per_step})
    return (f"gloo:all_reduce events per profiled step: {', '.join(map(str, counts))}\n"
            f"steps in which an all_reduce started before backward ended: {early} of {len(backward)}")


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
    """Per rank: the profiler's split of a step and the measured communication cost."""
    rows = []
    for r in sorted(records, key=lambda r: r["rank"]):
        rows.append([r["rank"], r.get("forward_ms"), r.get("backward_ms"), r.get("optimizer_ms"),
                     r.get("gloo:all_reduce_ms"), r.get("allreduce_calls"), r["step_ms"],
                     r["no_comm_step_ms"],
                     round(r["step_ms"] - r["no_comm_step_ms"], 2)])
    return text_table(["rank", "forward", "backward", "optimizer", "all_reduce busy", "calls",
                       "step", "step, no comm", "waiting for comm"], rows,
                      right=list(range(1, 9)))


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


# ------------------------------------------------------------------ beyond one machine
def rank_node_table(records: list[dict]) -> str:
    """Per rank: the node it ran on (GROUP_RANK), LOCAL_RANK, and the rule torchrun's static
    rendezvous numbers ranks by (node rank x ranks per node + local rank)."""
    rows = []
    for r in sorted(records, key=lambda r: r["rank"]):
        rule = r["group_rank"] * r["local_world_size"] + r["local_rank"]
        rows.append([r["rank"], r["group_rank"], r["local_rank"], r["local_world_size"],
                     r["world_size"], f"{rule} {'ok' if rule == r['rank'] else 'DIFFERS'}",
                     f"{r['sum']:g}"])
    return text_table(["RANK", "GROUP_RANK (node)", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                       "WORLD_SIZE", "node x LOCAL_WORLD_SIZE + LOCAL_RANK", "sum"], rows)


def ring_bytes_per_direction(records: list[dict]) -> int:
    """What a ring all-reduce must move across the cable in each direction, for a
    2-node run.

    Every rank sends 2(n-1)/n of the payload per all_reduce (lesson 02) to its right-hand
    neighbour in the ring 0 -> 1 -> ... -> n-1 -> 0. With ranks numbered node by node,
    exactly one ring link goes from node 0 to node 1 (node 0's last rank to node 1's
    first) and one back (node 1's last rank to rank 0), so each direction carries one
    rank's share.
    """
    first = records[0]
    n = first["world_size"]
    return first["steps"] * first["payload_bytes"] * 2 * (n - 1) // n


def bytes_crossed(cluster, before: dict, after: dict, records: list[dict]) -> str:
    """Host 0's link counters over the run against the ring all-reduce's payload."""
    first = records[0]
    n, mib = first["world_size"], first["payload_bytes"] / 2**20
    expected = ring_bytes_per_direction(records)
    lines = [f"payload: {first['steps']} all_reduce calls of {mib:g} MiB on {n} ranks; each rank "
             f"sends 2(n-1)/n x {mib:g} MiB = {2 * (n - 1) / n * mib:g} MiB per call",
             f"expected across the link, each direction: {expected:,} bytes "
             f"({expected / 2**20:.2f} MiB)"]
    if cluster.mode != "namespaces":
        return "\n".join(lines + ["measured: nothing to count, both hosts shared this machine's "
                                   "loopback (run as root to get network namespaces and links)"])
    for what, key in (("host 0 -> host 1", "tx_bytes"), ("host 1 -> host 0", "rx_bytes")):
        got = after[key] - before[key]
        lines.append(f"measured {what}: {got:,} bytes ({got / 2**20:.2f} MiB), "
                     f"{got / expected - 1:+.1%} over the payload")
    packets = after["tx_packets"] - before["tx_packets"]
    lines.append(f"(the extra: TCP/IP headers of {packets} packets, acknowledgements, "
                 "the rendezvous and gloo's connection set-up)")
    return "\n".join(lines)


def bytes_claim(cluster, before: dict, after: dict, records: list[dict]) -> str:
    """Whether each direction of host 0's link carried the ring's share, plus at most 3%
    of packet headers and set-up (and never less)."""
    if cluster.mode != "namespaces":
        return "no link to count on loopback"
    expected = ring_bytes_per_direction(records)
    ok = all(1.0 <= (after[k] - before[k]) / expected <= 1.03 for k in ("tx_bytes", "rx_bytes"))
    return ("each direction of host 0's link carried one rank's ring share, 2(n-1)/n of the "
            f"payload per call, plus under 3%: {ok}")


def interfaces_used(records: list[dict], cluster) -> str:
    """Per node: whether the launcher pointed gloo (GLOO_SOCKET_IFNAME) at that host's own
    link; on loopback, the value it set."""
    by_node: dict[int, set[str]] = {}
    for r in records:
        by_node.setdefault(r["group_rank"], set()).add(r["ifname"] or "(unset: gloo's own choice)")
    if cluster.mode != "namespaces":
        return "\n".join(f"node {node}: GLOO_SOCKET_IFNAME={', '.join(sorted(names))}"
                         for node, names in sorted(by_node.items()))
    return "\n".join(f"node {node}: GLOO_SOCKET_IFNAME names host {node}'s own link: "
                     f"{names == {cluster.interfaces[node]}}" for node, names in sorted(by_node.items()))


def refused_loopback(run) -> str:
    """For a run with GLOO_SOCKET_IFNAME=lo: whether it failed to start, and whether a
    rank's error says it was refused at 127.0.0.1 (its own machine)."""
    refused = [r.rank for r in run.ranks
               if "Connection refused" in r.stderr and "remote=[127.0.0.1]" in r.stderr]
    return "\n".join([
        f"the job got past init_process_group: {any('sum' in rec for rec in run.records)}",
        f"a rank was refused connecting to 127.0.0.1, its own machine: {bool(refused)}",
    ])


def first_error(run) -> str:
    """The first rank's 'connectFullMesh failed' line, build paths shortened."""
    from labutils.runtime.runfiles import shorten_build_paths

    for r in run.ranks:
        for line in r.stderr.splitlines():
            if line.startswith("RuntimeError") and "connectFullMesh" in line:
                return f"rank {r.rank}: {shorten_build_paths(line)}"
    return "no rank raised connectFullMesh's error"


def node_commands(script: str, *, nnodes: int, nproc: int, endpoint: str, rdzv_id: str,
                  log_dir: str, ifname: str) -> str:
    """The `labutils launch` command each machine runs for one job, with its environment.

    Args:
        script: the training script, at the same path on every machine.
        nnodes: machines; each runs the same command with its own --node-rank.
        nproc: ranks per machine.
        endpoint: HOST:PORT of node 0, reachable from every machine.
        rdzv_id: the job's name; the run folder is LOG_DIR/RDZV_ID.
        log_dir: a folder every machine shares (NFS, Lustre, ...), so every node shows
            every rank.
        ifname: the network interface the ranks should use on every machine.
    """
    blocks = []
    for node in range(nnodes):
        words = ["labutils", "launch", "-n", str(nproc), "--nnodes", str(nnodes),
                 "--node-rank", str(node), "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
                 "--log-dir", log_dir, script]
        blocks.append(f"# machine {node}\n"
                      f"export GLOO_SOCKET_IFNAME={ifname} NCCL_SOCKET_IFNAME={ifname} "
                      "NCCL_DEBUG=INFO\n" + shlex.join(words))
    return "\n".join(blocks)


def changed_lines(before: str, after: str) -> str:
    """The lines of after that are not in before (what a variant of a generated file adds)."""
    old = set(before.splitlines())
    return "\n".join(line for line in after.splitlines() if line not in old)


def compose_node_services() -> str:
    """docker/compose.yaml's node0 and node1 services as written in the file, and the words
    in which their commands differ."""
    import yaml

    text = (REPO / "docker" / "compose.yaml").read_text()
    services = yaml.safe_load(text)["services"]
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "node0:")
    end = next(i for i, line in enumerate(lines) if line.startswith("volumes:"))
    shown = "\n".join(lines[start:end]).rstrip()
    a, b = services["node0"]["command"], services["node1"]["command"]
    if len(a) != len(b):
        return f"{shown}\n\nnode0 and node1 commands differ in length"
    diff = [f"word {i}: {x!r} / {y!r}" for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return f"{shown}\n\nnode0 and node1 commands differ only in: {'; '.join(diff)}"


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
