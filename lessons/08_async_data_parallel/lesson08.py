"""Helpers for the lesson 08 notebook: readings of the async_vs_sync.py run (accounting,
staleness, convergence, time use), an in-process replay of the server's log, the
traffic arithmetic of lesson 02, and the self-check. The rank scripts do not import this.
"""

from __future__ import annotations

import hashlib
import math
import statistics

import torch
from torch.nn.utils import parameters_to_vector

from labutils.course import selfcheck
from labutils.course.tables import text_table
from task import gradient, loss_of, make_data, make_model

TARGET_LOSS = 0.011  # "trained" for this task: the loss plateau starts just below it
LABELS = {"sync": "sync DDP", "async": "async PS", "aware": "async PS, staleness-aware"}


def phases(run) -> list[dict]:
    """One dict per phase: mode, lr, label, curve, server (async only), workers {rank: record}."""
    out = []
    for rec in sorted((r for r in run.records if r["kind"] == "phase"), key=lambda r: r["phase"]):
        mine = [r for r in run.records if r.get("phase") == rec["phase"]]
        out.append({**rec, "label": f"{LABELS[rec['mode']]}, lr {rec['lr']:g}",
                    "curve": next(r for r in mine if r["kind"] == "curve"),
                    "server": next((r for r in mine if r["kind"] == "server"), None),
                    "workers": {r["rank"]: r for r in mine if r["kind"] == "worker"}})
    return out


def _loss(value) -> float:
    """A reported loss; report() sends nan and inf as strings."""
    return float(value)


def accounting(run) -> str:
    """Facts that hold in every run whatever the scheduling: each async phase applied
    every pushed gradient exactly once, and the DDP replicas ended identical."""
    n_params = sum(p.numel() for p in make_model().parameters())
    lines = [f"model: {n_params} parameters, {4 * n_params} bytes per gradient and per parameter copy"]
    for p in phases(run):
        if p["server"] is None:
            shas = {w["params_sha"] for w in p["workers"].values()}
            lines.append(f"phase {p['phase']} ({p['label']}): {len(p['curve']['updates']) - 1} steps, "
                         f"every worker computed {sorted({w['gradients'] for w in p['workers'].values()})} "
                         f"gradients, replicas identical: {len(shas) == 1}")
            continue
        s, workers = p["server"], p["workers"]
        # the push numbers of each worker, in the order the server applied them: 0, 1, 2, ...
        exactly_once = all([k for w, k in zip(s["worker"], s["seq"]) if w == rank]
                           == list(range(rec["gradients"])) for rank, rec in workers.items())
        lines += [f"phase {p['phase']} ({p['label']}):",
                  f"  updates applied: {s['version']} = gradients pushed by all workers: "
                  f"{sum(w['gradients'] for w in workers.values())}",
                  f"  every worker's pushes applied exactly once, in its own order: {exactly_once}"
                  f" (and no other: {set(s['worker']) == set(workers)})",
                  f"  messages the server received: {s['headers']} headers "
                  f"(= {s['version']} pushes + {len(workers)} first pulls), {s['grads']} gradients;"
                  f" sent: {s['params_sent']} parameter copies, {s['stops_sent']} stops"]
    return "\n".join(lines)


def _worker_name(p: dict, rank: int) -> str:
    slow = rank == p["slow_rank"] and p["slow_ms"] != p["step_ms"]
    return f"{rank} (slow)" if slow else str(rank)


def _period_s(worker: dict) -> float:
    return worker["wall_s"] / max(worker["gradients"], 1)


def _staleness(p: dict) -> dict[int, tuple[list[int], float, float]]:
    """Per worker of an async phase: the staleness of each of its updates, its time per
    gradient, and its mean staleness predicted from the workers' speeds alone."""
    s = p["server"]
    periods = {rank: _period_s(w) for rank, w in p["workers"].items()}
    return {rank: ([st for w, st in zip(s["worker"], s["staleness"]) if w == rank], periods[rank],
                   sum(periods[rank] / periods[other] for other in periods if other != rank))
            for rank in sorted(p["workers"])}


def staleness_table(run, phase: int) -> str:
    """Per worker: gradients pushed, time per gradient, staleness (mean, median, max)
    and the mean predicted from the workers' speeds alone."""
    p = phases(run)[phase]
    rows = []
    for rank, (mine, period, predicted) in _staleness(p).items():
        rows.append([_worker_name(p, rank), len(mine), f"{1000 * period:.1f}",
                     f"{statistics.mean(mine):.2f}", statistics.median(mine), max(mine),
                     f"{predicted:.2f}"])
    return text_table(["worker", "gradients", "ms per gradient", "staleness mean", "median", "max",
                       "predicted mean"], rows)


def staleness_claims(run, phase: int) -> str:
    """Section 4's claims, read from an async phase with a slow worker: the speeds predict
    each worker's mean staleness, and the slow worker's gradients are the stalest."""
    p = phases(run)[phase]
    per = _staleness(p)
    means = {rank: statistics.mean(mine) for rank, (mine, _, _) in per.items()}
    slow = p["slow_rank"]
    stalest = all(means[slow] > means[r] for r in means if r != slow)
    return "\n".join([
        "every worker's mean staleness is within 20% of the one predicted from the speeds: "
        f"{all(abs(means[r] - predicted) <= 0.2 * predicted for r, (_, _, predicted) in per.items())}",
        f"the slow worker's gradients are the stalest: {stalest}",
    ])


def plot_staleness(run, phase: int):
    """Histogram of the staleness of each worker's updates, one panel per worker."""
    import matplotlib.pyplot as plt

    p = phases(run)[phase]
    s = p["server"]
    ranks = sorted(p["workers"])
    top = max(s["staleness"])
    fig, axes = plt.subplots(1, len(ranks), figsize=(3.2 * len(ranks), 2.6), sharey=True)
    for ax, rank in zip(axes, ranks):
        mine = [st for w, st in zip(s["worker"], s["staleness"]) if w == rank]
        name = _worker_name(p, rank)
        ax.hist(mine, bins=[b - 0.5 for b in range(top + 2)],
                color="tab:red" if "slow" in name else "tab:blue")
        ax.set_title(f"worker {name}", fontsize=10)
        ax.set_xlabel("staleness (updates)")
        ax.set_xticks(range(top + 1))
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("updates")
    fig.suptitle(f"staleness per update, {p['label']}", fontsize=11)
    fig.tight_layout()
    return fig


def _first_reach(curve: dict, target: float) -> tuple[int | None, float | None]:
    for u, t, loss in zip(curve["updates"], curve["t"], curve["loss"]):
        if _loss(loss) <= target:
            return u, t
    return None, None


def convergence_table(run, which: list[int] | None = None, *, target: float = TARGET_LOSS) -> str:
    """Per phase (all, or those in `which`): updates, gradients, wall time, final loss,
    and when the loss first reached `target` (in updates and seconds)."""
    rows = []
    every = phases(run)
    for p in every if which is None else [every[i] for i in which]:
        c = p["curve"]
        final = _loss(c["loss"][-1])
        u, t = _first_reach(c, target)
        rows.append([p["label"], c["updates"][-1], sum(w["gradients"] for w in p["workers"].values()),
                     f"{c['wall_s']:.2f}", "diverged" if _blew_up(final) else f"{final:.4f}",
                     "never" if u is None else u, "never" if t is None else f"{t:.2f}"])
    return text_table(["phase", "updates", "gradients", "seconds", "final loss",
                       f"updates to {target:g}", f"seconds to {target:g}"], rows)


def _blew_up(loss: float) -> bool:
    """A loss that overflowed or passed 1000: the run diverged."""
    return not (math.isfinite(loss) and loss < 1e3)


def _diverged(curve: dict) -> bool:
    return _blew_up(_loss(curve["loss"][-1]))


def _by_label(run) -> dict[str, dict]:
    return {p["label"]: p for p in phases(run)}


def convergence_claims(run, lr: float, *, target: float = TARGET_LOSS) -> str:
    """Sections 5 and 6's claims, read from the run with a slow worker, at learning rate
    0.1 (synchronous and asynchronous both train; the server gets through the gradients
    in a fraction of DDP's time and reaches the target sooner) or 0.5 (DDP trains, the
    server diverges, the staleness-aware step trains, in more updates than DDP)."""
    every = _by_label(run)
    sync, async_ = every[f"sync DDP, lr {lr:g}"], every[f"async PS, lr {lr:g}"]
    s_updates, s_t = _first_reach(sync["curve"], target)
    a_updates, a_t = _first_reach(async_["curve"], target)
    if lr == 0.5:
        aware = every[f"async PS, staleness-aware, lr {lr:g}"]
        w_updates, _ = _first_reach(aware["curve"], target)
        return "\n".join([
            f"synchronous DDP reaches a loss of {target:g}: {s_updates is not None}",
            f"the parameter server diverges: {_diverged(async_['curve'])}",
            f"the staleness-aware step reaches {target:g}: {w_updates is not None}",
            "... in more updates than DDP takes (one gradient each against three): "
            f"{None not in (s_updates, w_updates) and w_updates > s_updates}",
        ])
    both = None not in (s_updates, a_updates)
    return "\n".join([
        "the parameter server gets through the same gradients in at most 0.6 of DDP's time: "
        f"{async_['curve']['wall_s'] <= 0.6 * sync['curve']['wall_s']}",
        f"both reach a loss of {target:g}: {both}",
        f"... in about as many updates (within a factor of 1.5): "
        f"{both and max(s_updates, a_updates) <= 1.5 * min(s_updates, a_updates)}",
        f"... the parameter server sooner in seconds: {both and a_t < s_t}",
    ])


def plot_convergence(run, which: list[int], *, title: str, ceiling: float = 1.0):
    """Loss on the whole data set against updates and against seconds, for the given
    phases; losses above `ceiling` (divergence) are drawn at the ceiling."""
    import matplotlib.pyplot as plt

    fig, (by_update, by_time) = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for p in (phases(run)[i] for i in which):
        c = p["curve"]
        loss = [min(_loss(v), ceiling) if not math.isnan(_loss(v)) else ceiling for v in c["loss"]]
        label = p["label"] + (" (diverged: drawn at the top)" if loss[-1] >= ceiling else "")
        style = {"sync": "-", "async": "--", "aware": ":"}[p["mode"]]
        by_update.plot(c["updates"], loss, style, label=label, lw=1.6)
        by_time.plot(c["t"], loss, style, label=label, lw=1.6)
    for ax, xlabel in ((by_update, "updates applied to the parameters"), (by_time, "seconds")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.axhline(TARGET_LOSS, color="grey", lw=0.8, alpha=0.6)
        ax.grid(True, alpha=0.3)
    by_update.set_ylabel("loss on the whole data set")
    by_update.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def time_use_table(run, which: list[int]) -> str:
    """Per phase and worker: gradients, share of the phase spent computing, and the
    time per gradient spent not computing (waiting for others or for messages)."""
    rows = []
    for p in (phases(run)[i] for i in which):
        for rank in sorted(p["workers"]):
            w = p["workers"][rank]
            rows.append([p["label"], _worker_name(p, rank), w["gradients"], f"{w['computing_s'] / w['wall_s']:.0%}",
                         f"{1000 * (w['wall_s'] - w['computing_s']) / max(w['gradients'], 1):.1f}"])
    return text_table(["phase", "worker", "gradients", "computing", "ms not computing per gradient"], rows)


def replay(run, phase: int, *, stale_workers: set[int] | None = None,
           staleness_aware: bool | None = None, target: float = TARGET_LOSS) -> dict:
    """Replay an async phase in this process from the server's log.

    Each logged update (worker, push number, staleness) is recomputed: the gradient of
    that worker's batch at the parameters of (version - staleness), applied with the
    phase's learning rate. With the logged staleness this repeats the run's arithmetic
    exactly; with some workers' staleness set to 0 it shows what their updates would
    have done had they been fresh (plain sequential SGD on the same batches).

    Args:
        run: the async_vs_sync.py run.
        phase: an async or aware phase.
        stale_workers: workers (ranks) whose logged staleness is kept; the others are
            replayed with staleness 0. None: every worker keeps its staleness.
        staleness_aware: scale steps by 1/(1+staleness); None: as the phase did.
        target: the loss whose first reaching is reported.

    Returns:
        {"final_loss", "reached" (the first update after which the loss on the whole
        data set was at most `target`, or None), "sha" (fingerprint of the final
        parameters), "same_as_run" (bitwise equal to the server's final parameters)}.
    """
    p = phases(run)[phase]
    s = p["server"]
    if s is None:
        raise ValueError(f"phase {phase} is {p['mode']!r}: replay needs an async or aware phase")
    aware = p["mode"] == "aware" if staleness_aware is None else staleness_aware
    n_workers = len(p["workers"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: the same arithmetic, bit for bit
    try:
        data, model = make_data(), make_model()
        history = [parameters_to_vector(model.parameters()).detach().clone()]
        reached = None
        for update, (rank, k, logged) in enumerate(zip(s["worker"], s["seq"], s["staleness"]), 1):
            staleness = logged if stale_workers is None or rank in stale_workers else 0
            grad = gradient(model, history[-1 - staleness], data, rank - 1, k, n_workers)
            step = p["lr"] / (1 + staleness) if aware else p["lr"]
            history.append(history[-1].clone().sub_(grad, alpha=step))
            if reached is None and loss_of(model, history[-1], data) <= target:
                reached = update
        final = history[-1]
        sha = hashlib.sha256(final.numpy().tobytes()).hexdigest()[:12]
        return {"final_loss": loss_of(model, final, data), "reached": reached, "sha": sha,
                "same_as_run": sha == s["params_sha"]}
    finally:
        torch.set_num_threads(threads)


def replay_table(run, phase: int) -> str:
    """The phase replayed with everyone's logged staleness, with only the fast or only
    the slow workers stale, and with nobody stale: the final loss, and when the loss
    first reached the plateau."""
    p = phases(run)[phase]
    fast = {r for r in p["workers"] if r != p["slow_rank"]}
    cases = [("as logged (every worker stale)", None), ("only the fast workers stale", fast),
             ("only the slow worker stale", {p["slow_rank"]}), ("nobody stale (sequential SGD)", set())]
    rows = []
    for name, stale in cases:
        r = replay(run, phase, stale_workers=stale)
        loss = r["final_loss"]
        rows.append([name, "diverged" if _blew_up(loss) else f"{loss:.4f}",
                     "never" if r["reached"] is None else r["reached"]])
    return text_table(["replay of " + p["label"], "final loss", f"updates to {TARGET_LOSS:g}"], rows)


def replay_claims(run, phase: int) -> str:
    """Section 6's claims about who is to blame, from the replays: with nobody stale the
    phase's learning rate trains (it reaches the plateau and ends near it: where on the
    plateau the last step lands varies with the order of the batches, 0.008 to 0.023 in
    18 runs, so the bound is 0.05); the fast workers' stale gradients alone diverge."""
    p = phases(run)[phase]
    fast = {r for r in p["workers"] if r != p["slow_rank"]}
    fresh = replay(run, phase, stale_workers=set())
    fast_only = replay(run, phase, stale_workers=fast)["final_loss"]
    trains = fresh["reached"] is not None and fresh["final_loss"] < 0.05
    return "\n".join([
        f"nobody stale: the loss reaches {TARGET_LOSS:g} and ends below 0.05: {trains}",
        f"only the fast workers stale: diverged: {_blew_up(fast_only)}",
    ])


def even_claims(straggler, even, *, target: float = TARGET_LOSS) -> str:
    """Section 7's claims, from the run without a straggler against the run with one:
    every gradient about n - 1 updates old; DDP's time falls and the server's lead
    shrinks; at 0.1 the server is at the target sooner, DDP at 0.5 in comparable time,
    the server at 0.5 diverges."""
    p = _by_label(even)
    per = _staleness(p["async PS, lr 0.1"])
    n = len(per)
    slow_run = _by_label(straggler)

    def wall(run_phases: dict, label: str) -> float:
        return run_phases[label]["curve"]["wall_s"]

    def ratio(run_phases: dict, lr: str) -> float:
        return wall(run_phases, f"sync DDP, lr {lr}") / wall(run_phases, f"async PS, lr {lr}")

    _, server_t = _first_reach(p["async PS, lr 0.1"]["curve"], target)
    _, ddp01_t = _first_reach(p["sync DDP, lr 0.1"]["curve"], target)
    _, ddp05_t = _first_reach(p["sync DDP, lr 0.5"]["curve"], target)
    return "\n".join([
        f"every worker's mean staleness is within 0.5 of n - 1 = {n - 1}: "
        f"{all(abs(statistics.mean(mine) - (n - 1)) <= 0.5 for mine, _, _ in per.values())}",
        "DDP's 300 gradients take less than half the time they took with the straggler: "
        f"{wall(p, 'sync DDP, lr 0.1') < 0.5 * wall(slow_run, 'sync DDP, lr 0.1')}",
        "DDP's time over the server's is smaller than with the straggler, at both learning rates: "
        f"{all(ratio(p, lr) < ratio(slow_run, lr) for lr in ('0.1', '0.5'))}",
        f"lr 0.1: the parameter server reaches {target:g} sooner in seconds than DDP: "
        f"{None not in (server_t, ddp01_t) and server_t < ddp01_t}",
        f"DDP at 0.5 reaches {target:g} within twice the seconds the server at 0.1 takes: "
        f"{None not in (server_t, ddp05_t) and ddp05_t <= 2 * server_t}",
        f"the parameter server at 0.5 diverges: {_diverged(p['async PS, lr 0.5']['curve'])}",
    ])


def traffic_table(*, param_bytes: float, workers: list[int], link_gb_per_s: float,
                  servers: int = 1) -> str:
    """Bytes per direction through the busiest link while every worker contributes one
    gradient, and the time at `link_gb_per_s` (per direction), for a parameter server
    (n gradients in and n parameter copies out, spread over `servers` shards) and for
    ring all-reduce (lesson 02: every rank sends 2(n-1)/n of the data, and receives as much)."""
    rows = []
    for n in workers:
        ps = n * param_bytes / servers
        ring = 2 * (n - 1) / n * param_bytes
        rows.append([n, f"{ps / 1e9:.2f} GB", f"{ps / (link_gb_per_s * 1e9):.3f}",
                     f"{ring / 1e9:.2f} GB", f"{ring / (link_gb_per_s * 1e9):.3f}"])
    shards = f"{servers} server{'s' * (servers > 1)}"
    return text_table(["workers", f"PS ({shards}): into one server", "seconds",
                       "ring all-reduce: out of each rank", "seconds"], rows, right=(0, 2, 4))


EXPECTED = {
    "q1_staleness": (3, "staleness = server version when applied - version the gradient was computed on"),
    "q2_equal_workers": (3.0, "each of the other n-1 workers pushes about once while one gradient is computed"),
    "q3_straggler_sync": (0.25, "every step waits for the slowest worker: 10 ms of work per 40 ms step"),
    "q4_server_bytes": (1600.0, "the server receives n gradients and sends n parameter copies: 2 * n * P"),
    "q5_aware_step": (0.025, "lr / (1 + staleness)"),
}


def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (None: not answered yet)."""
    selfcheck.check_answers(answers, EXPECTED, rel_tol=0.02)