"""Helpers for the lesson 06 notebook: the in-process mixed-precision demos, readings of
the profiling, scaling and two-node runs, the cluster recipes, and the self-check. The
rank scripts do not import this.
"""

from __future__ import annotations

import shlex
import shutil
import statistics
from pathlib import Path

import torch
from torch import nn

from labutils import selfcheck
from labutils.tables import text_table


FILES = Path("runs") / "06_files"
REPO = Path(__file__).resolve().parents[2]  # the course folder: lessons/, docker/, src/


def fresh_dir(name: str) -> str:
    """An empty folder for one run's files (runs/06_files/NAME)."""
    path = FILES / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return str(path)


def trace_file(name: str) -> str:
    """The Chrome trace profile_ddp.py wrote into fresh_dir(name)."""
    path = FILES / name / "ddp_step_rank0.json"
    return f"{path} ({path.stat().st_size / 1e6:.1f} MB)"


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


def scaling_reading(runs: dict[int, list[dict]], seconds: dict[str, dict[int, float]]) -> str:
    """The measured efficiencies next to what this machine's cores allow at best: with
    c cores and n one-thread ranks, n > c ranks share cores, so the ranks can go at
    most c/n as fast as with a core each (an upper bound, before any communication)."""
    cores = min(r["cores"] for recs in runs.values() for r in recs)
    lines = [f"cores these runs could use: {cores}"]
    for n in sorted(seconds["strong"]):
        if n == 1:
            continue
        bound = min(1.0, cores / n)
        strong = seconds["strong"][1] / (n * seconds["strong"][n])
        weak = seconds["weak"][1] / seconds["weak"][n]
        lines.append(f"{n} ranks: at most {bound:.0%} from the cores alone; measured strong "
                     f"{strong:.0%}, weak {weak:.0%}")
    return "\n".join(lines)


def _tiny_problem(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    return model, x, y


def autocast_dtypes() -> str:
    """What runs in bfloat16 under torch.autocast("cpu"), and what stays float32."""
    model, x, y = _tiny_problem()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model[0](x)
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    rows = [["Linear output (matmul)", hidden.dtype], ["model output", out.dtype],
            ["cross_entropy loss", loss.dtype], ["parameters", model[0].weight.dtype],
            ["gradients", model[0].weight.grad.dtype]]
    return text_table(["tensor", "dtype"], [[name, str(d).replace("torch.", "")] for name, d in rows])


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


def step_seconds(runs: dict[int, list[dict]]) -> dict[str, dict[int, float]]:
    """{"strong": {n: s}, "weak": {n: s}} from the scaling runs' records (median over
    ranks: every rank waits for the slowest in each all-reduce anyway)."""
    return {kind: {n: statistics.median(r[f"{kind}_s"] for r in recs) for n, recs in runs.items()}
            for kind in ("strong", "weak")}


def scaling_table(seconds: dict[str, dict[int, float]]) -> str:
    rows = []
    for n in sorted(seconds["strong"]):
        s1, w1 = seconds["strong"][1], seconds["weak"][1]
        sn, wn = seconds["strong"][n], seconds["weak"][n]
        rows.append([n, f"{sn * 1e3:.1f}", f"{s1 / (n * sn):.0%}", f"{wn * 1e3:.1f}",
                     f"{w1 / wn:.0%}", f"{n * 64 / wn:.0f}"])
    return text_table(["ranks", "strong: ms/step", "strong eff.", "weak: ms/step", "weak eff.",
                       "weak: samples/s"], rows, right=[0, 1, 2, 3, 4, 5])


# ------------------------------------------------------------------ beyond one machine
def hosts_line(hosts) -> str:
    """Which kind of "two machines" this run gets, in one line (addresses are this host's)."""
    if hosts.mode == "namespaces":
        return (f"mode: namespaces. node 0 = {hosts.addresses[0]} (the notebook's network), "
                f"node 1 = {hosts.addresses[1]} in network namespace {hosts.namespace}, "
                f"joined by the veth pair {hosts.interfaces[0]} <-> {hosts.interfaces[1]}")
    return f"mode: loopback. {hosts.reason}"


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


def bytes_crossed(hosts, before: dict, after: dict, records: list[dict]) -> str:
    """The veth pair's byte counters over the run against the ring all-reduce's payload."""
    first = records[0]
    n, mib = first["world_size"], first["payload_bytes"] / 2**20
    expected = ring_bytes_per_direction(records)
    lines = [f"payload: {first['steps']} all_reduce calls of {mib:g} MiB on {n} ranks; each rank "
             f"sends 2(n-1)/n x {mib:g} MiB = {2 * (n - 1) / n * mib:g} MiB per call",
             f"expected across the cable, each direction: {expected:,} bytes "
             f"({expected / 2**20:.2f} MiB)"]
    if hosts.mode != "namespaces":
        return "\n".join(lines + ["measured: nothing to count, both nodes shared this machine's "
                                   "loopback (run as root to get namespaces and a veth pair)"])
    for what, key in (("node 0 -> node 1", "tx_bytes"), ("node 1 -> node 0", "rx_bytes")):
        got = after[key] - before[key]
        lines.append(f"measured {what}: {got:,} bytes ({got / 2**20:.2f} MiB), "
                     f"{got / expected - 1:+.1%} over the payload")
    packets = after["tx_packets"] - before["tx_packets"]
    lines.append(f"(the extra: TCP/IP headers of {packets} packets, acknowledgements, "
                 "the rendezvous and gloo's connection set-up)")
    return "\n".join(lines)


def interfaces_used(records: list[dict]) -> str:
    """Which interface each node's ranks were told to use (GLOO_SOCKET_IFNAME)."""
    by_node: dict[int, set[str]] = {}
    for r in records:
        by_node.setdefault(r["group_rank"], set()).add(r["ifname"] or "(unset: gloo's own choice)")
    return "\n".join(f"node {node}: GLOO_SOCKET_IFNAME={', '.join(sorted(names))}"
                     for node, names in sorted(by_node.items()))


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
