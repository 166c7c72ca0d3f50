"""Helpers for the lesson 06 notebook: the in-process mixed-precision demos, readings of
the profiling and scaling runs, and the self-check. The rank scripts do not import this.
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

import torch
from torch import nn

from labutils.tables import text_table


FILES = Path("runs") / "06_files"


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


# The self-check: question -> (expected answer, hint shown for a wrong answer).
EXPECTED = {
    "q1_prefix": ("module.", "print(list(ddp.state_dict())[:1])"),
    "q2_strong_efficiency": (0.625, "T1 / (n * Tn) with T1 = 100 ms, n = 4, T4 = 40 ms"),
    "q3_weak_efficiency": (0.8, "T1 / Tn with T1 = 48 ms, T2 = 60 ms"),
    "q4_who_calls_forward": ("b", "the buffer broadcast in DDP's forward is a collective"),
    "q5_before_clip": ("c", "clip must measure the gradients the optimizer will use"),
}


def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (None: not answered yet)."""
    unknown = sorted(set(answers) - set(EXPECTED))
    if unknown:
        print(f"unknown question names {unknown}; expected {sorted(EXPECTED)}")
    for name, (want, hint) in EXPECTED.items():
        given = answers.get(name)
        if given is None:
            print(f"{name}: not answered yet")
        elif isinstance(want, float):
            ok = isinstance(given, (int, float)) and abs(given - want) < 0.01
            print(f"{name}: correct" if ok else f"{name}: not quite ({given!r}); hint: {hint}")
        elif str(given).strip().lower() == want:
            print(f"{name}: correct")
        else:
            print(f"{name}: not quite ({given!r}); hint: {hint}")


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
