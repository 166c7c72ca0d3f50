"""Lessons 01 and 02: their scripts, run for real with torchrun, against single-process references.

The notebooks check the same things once, on the sizes they run; these tests add
the world sizes and cases the notebooks leave out (ring at real world sizes 2 and 3,
the exercise solutions, a DataParallel step on an uneven batch).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import REPO
import torch
from torch import nn

from labutils import launch
from labutils.course import lesson


LESSONS = REPO / "lessons"
LESSON01 = LESSONS / "01_dp_vs_ddp"
LESSON02 = LESSONS / "02_collectives"
SOLUTIONS = REPO / "solutions" / "lessons"


@pytest.fixture
def lesson_modules():
    """Import lesson helper modules (model, ring, ...) under names of their lesson's own
    (labutils.course.lesson), so a lab's ring.py cannot stand in for them."""
    def use(folder: Path, *names: str):
        return [lesson.load(folder, name) for name in names]
    return use


# ------------------------------------------------------------------ lesson 01, in process

@pytest.mark.parametrize(("n_devices", "batch"), [(2, 16), (3, 16), (2, 15), (1, 4)])
def test_thread_data_parallel_equals_one_process(lesson_modules, n_devices, batch):
    model_mod, dp_mod = lesson_modules(LESSON01, "model", "data_parallel")
    reference = model_mod.make_model(**model_mod.PROOF)
    replicated = model_mod.make_model(**model_mod.PROOF)
    ref_opt, dp_opt = model_mod.make_optimizer(reference), model_mod.make_optimizer(replicated)
    dp = dp_mod.ThreadDataParallel(replicated, n_devices)
    for step in range(2):
        x, y = model_mod.make_batch(step, batch, **model_mod.PROOF)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        dp.train_step(x, y, nn.functional.cross_entropy, dp_opt)
    torch.testing.assert_close(model_mod.flat_params(replicated), model_mod.flat_params(reference))
    work = dp.work_table()
    assert [w["device"] for w in work] == list(range(n_devices))
    assert all(w["forward"] > 0 and w["backward"] > 0 for w in work)
    assert all(w["optimizer step"] == 0 for w in work[1:])  # only device 0 steps
    # Bytes per step, from the tensors: parameters out and gradients in, once per other device;
    # the inputs of the other devices out (device 0 keeps the labels).
    traffic = dp.traffic()
    params = model_mod.param_bytes(replicated)
    assert traffic["parameters (replicate)"] == {"device 0 sends": (n_devices - 1) * params,
                                                 "device 0 receives": 0}
    assert traffic["parameter gradients (reduce onto device 0)"]["device 0 receives"] == (n_devices - 1) * params
    x, _ = model_mod.make_batch(0, batch, **model_mod.PROOF)
    first_chunk = x.chunk(n_devices)[0]
    assert traffic["inputs (scatter)"]["device 0 sends"] == (x.numel() - first_chunk.numel()) * 4


def test_replicate_builds_fresh_parameterless_shells_every_step(lesson_modules):
    """As torch.nn.parallel.replicate: new module objects each step, holding plain-tensor
    copies of device 0's parameters (a replica has no Parameters of its own)."""
    model_mod, dp_mod = lesson_modules(LESSON01, "model", "data_parallel")
    model = model_mod.make_model(**model_mod.MANY_SMALL_OPS)
    dp = dp_mod.ThreadDataParallel(model, 3)
    first, second = dp.replicate(), dp.replicate()
    assert first[0] is model and second[0] is model
    assert first[1] is not second[1] and first[2] is not second[2]
    assert list(first[1].parameters()) == []
    assert len(list(first[1].modules())) == len(list(model.modules()))
    x, _ = model_mod.make_batch(0, 4, **model_mod.MANY_SMALL_OPS)
    torch.testing.assert_close(first[2](x), model(x))
    copy_ptrs = {t.data_ptr() for t in dp.copies[1]}
    assert not copy_ptrs & {p.data_ptr() for p in model.parameters()}  # copies, not views


def test_thread_slowdown_reports_alone_and_together(lesson_modules):
    model_mod, dp_mod = lesson_modules(LESSON01, "model", "data_parallel")
    run = dp_mod.thread_slowdown(model_mod.PROOF, n=2, batch=8, steps=3)
    assert run["alone_s"] > 0 and run["together_s"] > 0
    assert run["slowdown"] == pytest.approx(run["together_s"] / run["alone_s"])
    assert 0 < run["on_core"] <= 1.05  # CPU time over wall time, per thread
    assert run["sleeps_per_pass"] >= 0
    assert torch.get_num_threads() > 0  # restored


def test_replicas_at_once_time_the_forward_only(lesson_modules):
    """The GIL shows in the forward's Python work; a backward (C++, no GIL) would dilute
    the threads' time off a core by as much as the machine's autograd engine takes."""
    model_mod, dp_mod = lesson_modules(LESSON01, "model", "data_parallel")
    models = [model_mod.make_model(**model_mod.PROOF) for _ in range(2)]
    x, y = model_mod.make_batch(0, 8, **model_mod.PROOF)
    median, seconds, shares = dp_mod.replicas_at_once(models, x, y, 3)
    assert median > 0 and len(seconds) == len(shares) == 6 and all(0 < s["on_core"] <= 1.05 for s in shares)
    assert all(p.grad is None for m in models for p in m.parameters())


def test_steps_on_core_reads_each_steps_share_on_a_core_and_its_sleeps(lesson_modules, monkeypatch):
    """Each step's CPU time over its wall time, and the sleeps the thread counted during
    it, on clocks the steps move; all read inside the wall-clock interval, so a share
    cannot pass 1."""
    (dp_mod,) = lesson_modules(LESSON01, "data_parallel")
    clock = {"wall": 100.0, "cpu": 7.0, "sleeps": 40}
    reads = []

    class Clock:  # stands in for the time module inside data_parallel
        @staticmethod
        def perf_counter():
            reads.append("wall")
            return clock["wall"]

        @staticmethod
        def thread_time():
            reads.append("cpu")
            return clock["cpu"]

    def sleeps():
        reads.append("sleeps")
        return clock["sleeps"]

    def step(what, _):
        on_core_ms, slept = what
        clock["wall"] += 0.010
        clock["cpu"] += on_core_ms / 1000
        clock["sleeps"] += slept

    monkeypatch.setattr(dp_mod, "time", Clock)
    monkeypatch.setattr(dp_mod, "sleeps_so_far", sleeps)
    seconds, shares = dp_mod.steps_on_core(step, [((5, 0), None), ((5, 3), None), ((10, 0), None)])
    assert seconds == pytest.approx([0.010] * 3)
    assert [s["on_core"] for s in shares] == pytest.approx([0.5, 0.5, 1.0])
    assert [s["sleeps"] for s in shares] == [0, 3, 0]
    assert reads[:6] == ["wall", "cpu", "sleeps", "sleeps", "cpu", "wall"]
    # steps weigh by their seconds for the share on a core; sleeps are per step
    assert dp_mod.pass_totals([0.010, 0.030], [shares[0], {"on_core": 0.9, "sleeps": 5.0}]) \
        == pytest.approx({"on_core": 0.8, "sleeps_per_pass": 2.5})

    # where the kernel does not count sleeps, none are counted
    monkeypatch.setattr(dp_mod, "sleeps_so_far", lambda: None)
    _, shares = dp_mod.steps_on_core(step, [((5, 3), None)])
    assert shares == [pytest.approx({"on_core": 0.5, "sleeps": 0.0})]


def test_time_in_turn_alternates_steps_and_keeps_each_ways_fastest(lesson_modules):
    """One step of each way in turn (a slow moment of the machine falls on both), the
    fastest timed step of each, the warm-up left out of DataParallel's stage times."""
    model_mod, dp_mod = lesson_modules(LESSON01, "model", "data_parallel")
    order, pauses = [], iter([0.0, 0.0, 0.3, 0.0, 0.15, 0.5])

    def slowed(way, name):
        inner = way.step

        def step(x, y):
            order.append(name)
            if name == "one":
                import time
                time.sleep(next(pauses))
            inner(x, y)
        reset = way.reset
        way.step = step
        way.reset = lambda: (order.append(f"reset {name}"), reset())
        return way

    threads_before = torch.get_num_threads()
    one = slowed(dp_mod.one_process(global_batch=8, config=model_mod.PROOF), "one")
    dp = slowed(dp_mod.data_parallel(n_devices=2, per_device_batch=4, config=model_mod.PROOF), "dp")
    single, parallel = dp_mod.time_in_turn([one, dp], dp_mod.global_batches(model_mod.PROOF, 8, 4), warmup=2)
    # the stage times and bytes start over once the 2 warm-up steps are done
    assert order == ["one", "dp"] * 2 + ["reset one", "one", "reset dp", "dp"] + ["one", "dp"] * 3
    # pauses 0.3, 0.0, 0.15, 0.5 on the timed steps: the fastest is the one without (the
    # step itself took 11 ms once beside three busy workers: pauses of 10 ms
    # were no margin)
    assert single["step_s"] < 0.15 and single["kind"] == "one process, 1 thread"
    assert parallel["kind"] == "DataParallel, 2 threads"
    assert parallel["samples_per_s"] == pytest.approx(8 / parallel["step_s"])
    # the stages of the fastest step: device 0 was busy for no longer than that step
    assert 0 < parallel["work"][0]["busy"] <= parallel["step_s"]
    assert torch.get_num_threads() == threads_before


def test_device0_traffic_with_copies_grows_and_with_nccl_does_not(lesson_modules):
    lesson01, model_mod = lesson_modules(LESSON01, "lesson01", "model")
    by_n = lesson01.traffic_by_devices(model_mod.PROOF, per_device_batch=4, devices=(2, 4))
    params = model_mod.param_bytes(model_mod.make_model(**model_mod.PROOF))
    batch_bytes = {n: sum(t["device 0 sends"] + t["device 0 receives"] for what, t in by_n[n]["traffic"].items()
                          if "parameter" not in what) for n in by_n}
    for n in (2, 4):
        copies = lesson01.device0_bytes(by_n[n]["traffic"], n=n, nccl=False)
        nccl = lesson01.device0_bytes(by_n[n]["traffic"], n=n, nccl=True)
        assert copies == batch_bytes[n] + 2 * (n - 1) * params
        assert nccl == pytest.approx(batch_bytes[n] + 2 * params)  # parameters out once, gradients in once
    assert lesson01.ddp_rank_bytes(params, 2) == 2 * params       # 2(n-1)/n of the gradients, each way
    assert lesson01.ddp_rank_bytes(params, 4) == 3 * params


def _link_record(rank, *, step, construction, gradients=1_000_000):
    return {"rank": rank, "part": "link bytes", "gradient_bytes": gradients, "step_s": 0.1,
            "construction_received": construction if rank else 100, "construction_sent": 100 if rank else construction,
            "step_received": step, "step_sent": step}


@pytest.mark.parametrize(("step", "construction", "verdicts"), [
    (1_010_000, 1_020_000, ["True", "True"]),
    (1_200_000, 1_020_000, ["False", "True"]),   # more than the all-reduce's share per step
    (1_010_000, 2_000_000, ["True", "False"]),   # the parameters crossed twice
])
def test_check_link_compares_link_bytes_with_the_all_reduce(lesson_modules, capsys, step, construction, verdicts):
    (lesson01,) = lesson_modules(LESSON01, "lesson01")
    records = [_link_record(r, step=step, construction=construction) for r in (0, 1)]
    lesson01.check_link(records, world_size=2)
    assert [line.rsplit(" ", 1)[1] for line in capsys.readouterr().out.splitlines()] == verdicts


def test_check_link_says_when_nothing_was_measured(lesson_modules, capsys):
    (lesson01,) = lesson_modules(LESSON01, "lesson01")
    records = [{"rank": r, "part": "link bytes", "gradient_bytes": 1, "step_received": None} for r in (0, 1)]
    lesson01.check_link(records, world_size=2)
    assert "not measured" in capsys.readouterr().out


def test_lesson01_self_check_accepts_the_right_answers(lesson_modules, capsys):
    (lesson01,) = lesson_modules(LESSON01, "lesson01")
    lesson01.check_answers({"q1_equivalent_single_batch": 64, "q2_params_come_from_rank": 0,
                            "q3_cpu_dataparallel_key_prefix": "module.", "q4_device_ids_error": "ValueError",
                            "q5_dp_loss_device": 0, "q6_model_where_threads_wait": "MANY_SMALL_OPS"})
    out = capsys.readouterr().out.lower()
    assert "not" not in out and out.count("\n") == 6


def test_thread_data_parallel_rejects_zero_devices(lesson_modules):
    model_mod, dp_mod = lesson_modules(LESSON01, "model", "data_parallel")
    with pytest.raises(ValueError, match="n_devices"):
        dp_mod.ThreadDataParallel(model_mod.make_model(**model_mod.PROOF), 0)


def test_memory_table_puts_optimizer_and_batch_on_device_0(lesson_modules):
    model_mod, dp_mod = lesson_modules(LESSON01, "model", "data_parallel")
    model = model_mod.make_model(**model_mod.PROOF)
    rows = dp_mod.memory_table(model, n_devices=2, global_batch=16, inputs=32, classes=10)
    params = sum(p.numel() for p in model.parameters()) * 4
    assert rows[0]["optimizer state"] == params and rows[1]["optimizer state"] == 0
    assert rows[0]["input batch"] == 16 * 32 * 4 and rows[1]["input batch"] == 8 * 32 * 4
    assert rows[0]["total"] > rows[1]["total"]


@pytest.mark.parametrize(("factor", "verdict"), [(8, "correct"), (1, "not quite"), (16, "not quite")])
def test_sum_loss_exercise_check(lesson_modules, capsys, factor, verdict):
    (lesson01,) = lesson_modules(LESSON01, "lesson01")
    lesson01.check_sum_loss_factor(factor)
    assert capsys.readouterr().out.startswith(verdict)


# ------------------------------------------------------------------ lesson 01, real runs

@pytest.mark.slow
def test_ddp_equals_one_process_with_the_whole_batch(lesson_modules, runs_dir, capsys):
    (lesson01,) = lesson_modules(LESSON01, "lesson01")
    result = launch(LESSON01 / "ddp_train.py", nproc=2, display="none", timeout=240,
                    args=["--timing-steps", "0", "--per-rank-batch", "4", "--steps", "2"])
    assert result.ok, result.summary()
    after = lesson01.part(result.records, "construction")
    assert len({r["checksum_after"] for r in after}) == 1
    assert len({r["checksum_before"] for r in after}) == 2
    assert all(r["ddp_minus_mean_of_local"] <= 1e-6 for r in lesson01.part(result.records, "backward"))
    assert all(r["max_diff_to_rank0"] == 0 for r in lesson01.part(result.records, "after steps"))
    assert "ValueError" in lesson01.one(result.records, "device_ids on a CPU module")["error"]
    lesson01.check_equivalence(result.records, world_size=2, per_rank_batch=4)  # raises on mismatch
    assert "gives the same gradient: False" in capsys.readouterr().out


@pytest.mark.slow
def test_ddp_train_measures_processes_and_a_ddp_step(lesson_modules, runs_dir):
    """Part 4a and 4b of ddp_train.py on 2 local ranks; no link to count off the cluster."""
    (lesson01,) = lesson_modules(LESSON01, "lesson01")
    result = launch(LESSON01 / "ddp_train.py", nproc=2, display="none", timeout=240,
                    args=["--steps", "1", "--timing-steps", "3", "--link-steps", "2", "--batch", "16"])
    assert result.ok, result.summary()
    runs = {r["model"]: r for r in lesson01.part(result.records, "processes at once")}
    assert sorted(runs) == ["FEW_BIG_OPS", "MANY_SMALL_OPS"]
    assert all(r["alone_s"] > 0 and r["together_s"] > 0 and 0 < r["on_core"] <= 1.05 for r in runs.values())
    assert all(r["sleeps_per_pass"] >= 0 for r in runs.values())
    step = lesson01.one(result.records, "ddp step")
    assert step["step_s"] > 0 and step["compute_only_step_s"] > 0 and step["per_rank_batch"] == 16
    links = lesson01.part(result.records, "link bytes")
    assert len(links) == 2 and all(r["step_received"] is None for r in links)


@pytest.mark.slow
def test_ddp_on_two_hosts_sends_parameters_once_and_gradients_each_step(lesson_modules, runs_dir, capsys):
    """The lesson's claim on the virtual cluster: link bytes per step = the all-reduce's share."""
    from labutils.cluster import virtual_cluster

    (lesson01,) = lesson_modules(LESSON01, "lesson01")
    with virtual_cluster(2, link="1gbit") as cluster:
        if cluster.mode != "namespaces":
            pytest.skip(f"virtual cluster on loopback here: {cluster.reason}")
        result = cluster.launch(LESSON01 / "ddp_train.py", nproc=1, display="none", timeout=240,
                                args=["--steps", "1", "--timing-steps", "0", "--link-steps", "2", "--batch", "16"])
    assert result.ok, result.summary()
    lesson01.check_link(result.records, world_size=2)
    assert capsys.readouterr().out.splitlines() == [
        "per step, every link carried 2(N-1)/N x the gradients each way (within 5%): True",
        "while DDP(model) was built, every rank but 0 received the parameters once (within 5%): True"]


@pytest.mark.slow
def test_manual_ddp_solution_matches_reference(lesson_modules, runs_dir):
    (lesson01,) = lesson_modules(LESSON01, "lesson01")
    result = launch(SOLUTIONS / "01_dp_vs_ddp" / "exercise_manual_ddp.py", nproc=2,
                    display="none", timeout=240)
    assert result.ok, result.summary()
    rec = next(r for r in result.records if r["rank"] == 0)
    _, reference = lesson01.reference_run(global_batch=2 * rec["per_rank_batch"], steps=rec["steps"])
    torch.testing.assert_close(torch.tensor(rec["params"]), reference)


def test_exercise_checks_skip_unattempted_exercises(lesson_modules, capsys):
    (lesson01,) = lesson_modules(LESSON01, "lesson01")
    (lesson02,) = lesson_modules(LESSON02, "lesson02")
    lesson01.check_manual_ddp()
    lesson02.check_parity_ring()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["not attempted yet", "not attempted yet"]


# ------------------------------------------------------------------ lesson 02

def ring_bytes_solution(numel: int, n: int, rank: int) -> int:
    """Exercise 1 of lesson 02, solved: every chunk but one in each of the two phases."""
    sizes = [numel // n + (1 if i < numel % n else 0) for i in range(n)]
    return 4 * (2 * numel - sizes[(rank + 1) % n] - sizes[(rank + 2) % n])


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_ring_matches_all_reduce_at_real_world_sizes(lesson_modules, runs_dir, capsys, nproc):
    (lesson02,) = lesson_modules(LESSON02, "lesson02")
    result = launch(LESSON02 / "ring_bench.py", nproc=nproc, display="none", timeout=240,
                    args=["--check-only"])
    assert result.ok, result.summary()  # ring_bench.py asserts ring == dist.all_reduce itself
    checks = [r for r in result.records if "check" in r]
    assert [r["group_size"] for r in checks] == list(range(2, nproc + 1))
    assert all(r["max_abs_diff"] < 1e-12 for r in checks)
    ring = [r for r in result.records if r.get("traffic") == "ring" and r["group_size"] == nproc]
    mean_ratio = sum(r["sent"] for r in ring) / len(ring) / ring[0]["data_bytes"]
    assert mean_ratio == pytest.approx(2 * (nproc - 1) / nproc, rel=1e-3)
    lesson02.check_ring_bytes(ring_bytes_solution, result.records)
    assert capsys.readouterr().out.startswith("correct")


@pytest.mark.slow
def test_parity_ring_solution_does_not_deadlock(runs_dir):
    result = launch(SOLUTIONS / "02_collectives" / "exercise_parity_ring.py", nproc=3,
                    display="none", hang_timeout=10, timeout=240)
    assert result.ok, result.summary()
    assert [r["sizes_checked"] for r in result.records] == [7, 7, 7]


@pytest.mark.slow
def test_blocking_ring_deadlocks_and_is_diagnosed(runs_dir):
    result = launch(LESSON02 / "ring_deadlock.py", nproc=2, display="none", hang_timeout=3,
                    timeout=240)
    assert result.reason == "hang", result.summary()
    assert set(result.hang.calls.values()) == {"send"}
    assert result.hang.stragglers == []


@pytest.mark.slow
def test_ring_bench_counts_each_hosts_link_bytes_on_a_virtual_cluster(runs_dir):
    from labutils.cluster import virtual_cluster

    size = 4 * 2**20  # 3 hosts: chunks of 1.4 MB, so the pipelined ring sends 2 segments each
    with virtual_cluster(3, link="400mbit") as cluster:
        if cluster.mode != "namespaces":
            pytest.skip(f"virtual cluster on loopback here: {cluster.reason}")
        result = cluster.launch(LESSON02 / "ring_bench.py", nproc=1, display="none", timeout=240,
                                args=["--skip-checks", "--min-bytes", str(size), "--max-bytes",
                                      str(size), "--iters", "1"])
    assert result.ok, result.summary()
    sent = {r["algorithm"]: [b / size for b in r["link_sent"]] for r in result.records}
    expected = {"library": [4 / 3] * 3, "ring": [4 / 3] * 3, "pipelined ring": [4 / 3] * 3,
                "naive ring": [2] * 3, "reduce+broadcast": [2, 1, 1]}
    assert sent.keys() == expected.keys()
    for name, factors in expected.items():  # headers and barriers add a little, never less
        assert all(f <= got <= 1.02 * f for got, f in zip(sent[name], factors)), (name, sent[name])
    # every host is on this machine: the cores other programs held while the calls ran
    assert all(r["cores"] >= 1 and 0 <= r["others_cores"] <= r["cores"] for r in result.records)


def test_check_ring_bytes_reports_wrong_formula(lesson_modules, capsys):
    (lesson02,) = lesson_modules(LESSON02, "lesson02")
    records = [{"rank": r, "traffic": "ring", "group_size": 3, "data_bytes": 4004,
                "sent": ring_bytes_solution(1001, 3, r)} for r in range(3)]
    lesson02.check_ring_bytes(ring_bytes_solution, records)
    assert capsys.readouterr().out.startswith("correct: your formula matches all 3")
    lesson02.check_ring_bytes(lambda numel, n, rank: 2 * (n - 1) * numel * 4 // n, records)
    assert "hint: tensor_split" in capsys.readouterr().out


def test_bandwidth_helpers(lesson_modules):
    (lesson02,) = lesson_modules(LESSON02, "lesson02")
    records = [{"rank": 0, "algorithm": a, "nbytes": s, "seconds": 1e-4 + s / f}
               for a, f in (("library", 2e9), ("ring", 1e9)) for s in (8, 1024, 2**20)]
    series = lesson02.bandwidth_series(records)
    assert list(series) == ["library", "ring"] and series["ring"][0] == [8, 1024, 2**20]
    table = lesson02.bandwidth_table(series, world_size=4, metric="busbw").splitlines()
    assert table[0] == "busbw of one all_reduce on 4 ranks, MB/s"
    assert table[1].split() == ["bytes", "floats", "library", "ring"] and len(table) == 6
    # one unit per column: busbw = 1.5 * 2**20 bytes / (100 µs + 2**20 / beta), in MB/s
    assert table[-1].split() == ["1048576", "262144", "2519", "1369"]
    times = lesson02.bandwidth_table(series, world_size=4, metric="time").splitlines()
    assert times[3].split() == ["8", "2", "0.100", "0.100"]  # 100 µs shown in ms
    fits = lesson02.fit_all(series)
    assert fits["ring"].beta_Bps == pytest.approx(1e9, rel=1e-6)
    fit_lines = lesson02.fit_table(fits, series, world_size=4).splitlines()
    assert "1 MiB" in fit_lines[0] and "beta (MB/s)" in fit_lines[1]
    assert fit_lines[-1].split()[:3] == ["ring", "0.100", "1000"]
    assert lesson02.busbw_ratio(series, "ring", "library", 2**20) == pytest.approx(
        (1e-4 + 2**20 / 2e9) / (1e-4 + 2**20 / 1e9))


def _series(lesson02, seconds):
    """{algorithm: {size: seconds}} as ring_bench.py's records, through bandwidth_series."""
    return lesson02.bandwidth_series([{"rank": 0, "algorithm": a, "nbytes": size, "seconds": t}
                                      for a, times in seconds.items() for size, t in times.items()])


def test_the_bandwidth_claims_read_the_series_and_can_say_false(lesson_modules):
    (lesson02,) = lesson_modules(LESSON02, "lesson02")
    small, big = 1024, 2**25
    loopback = {"library": {small: 3e-3, big: 0.047}, "ring": {small: 5e-3, big: 0.050},
                "naive ring": {small: 2e-3, big: 0.158}, "reduce+broadcast": {small: 0.5e-3, big: 0.092}}
    verdicts = [line.rsplit(": ", 1)[1] for line in lesson02.loopback_claims(_series(lesson02, loopback)).splitlines()]
    assert verdicts == ["True", "True"]
    loopback["naive ring"][big] = 0.049  # as fast as the ring: it did not fall behind
    loopback["reduce+broadcast"][small] = 6e-3
    verdicts = [line.rsplit(": ", 1)[1] for line in lesson02.loopback_claims(_series(lesson02, loopback)).splitlines()]
    assert verdicts == ["False", "False"]
    mib = 2**20
    wire = {"library": {mib: 0.10, 16 * mib: 1.0}, "ring": {mib: 0.13, 16 * mib: 1.1},
            "pipelined ring": {mib: 0.10, 16 * mib: 1.0}}
    assert lesson02.wire_claims(_series(lesson02, wire)).count(": True") == 3
    wire["ring"] = {mib: 0.09, 16 * mib: 1.4}  # ahead at 1 MiB, far behind at 16
    verdicts = [line.rsplit(": ", 1)[1] for line in lesson02.wire_claims(_series(lesson02, wire)).splitlines()]
    assert verdicts == ["False", "False", "False"]


def test_traffic_table_one_row_per_algorithm(lesson_modules):
    (lesson02,) = lesson_modules(LESSON02, "lesson02")
    records = [{"rank": r, "traffic": "reduce+broadcast", "group_size": 3, "data_bytes": 400,
                "sent": 800 if r == 0 else 400} for r in (2, 0, 1)]
    rows = lesson02.traffic_table(records).splitlines()
    assert len(rows) == 3
    assert rows[2].split()[:8] == ["3", "reduce+broadcast", "2.000", "1.000", "1.000",
                                   "2.000", "1.000", "1.000"]


def test_wire_table_predicts_time_from_bytes_on_the_busiest_link(lesson_modules):
    (lesson02,) = lesson_modules(LESSON02, "lesson02")
    size, link = 2**20, 50e6  # 1 MiB on a 50 MB/s link
    records = [{"rank": 0, "algorithm": "ring", "nbytes": size, "seconds": 1.5 * size / link,
                "link_sent": [1.5 * size] * 4, "link_received": [1.5 * size] * 4},
               {"rank": 0, "algorithm": "reduce+broadcast", "nbytes": size,
                "seconds": 3 * 6 * size / link,  # three times what the wire needs
                "link_sent": [3 * size, size, size, size], "link_received": [3 * size] + [size] * 3}]
    predicted = lesson02.wire_predictions(records, link_Bps=link, world_size=4)
    assert predicted["ring"][0] == pytest.approx(1.5 * size / link)
    assert predicted["reduce+broadcast"][0] == pytest.approx(6 * size / link)
    table = lesson02.wire_table(records, link_Bps=link, world_size=4)
    assert "3.000 1.000 1.000 1.000" in table
    ring_row = next(line for line in table.splitlines() if line.startswith("ring"))
    rb_row = next(line for line in table.splitlines() if line.startswith("reduce+broadcast"))
    assert ring_row.split()[-2:] == ["1.00", "1.00"]  # measured / predicted, busbw / link
    assert rb_row.split()[-2:] == ["3.00", "0.08"]


@pytest.mark.parametrize(("factor", "others", "said"), [
    (1.1, 0.2, "True"),    # quiet: the times follow the bytes
    (1.6, 1.1, "False (other programs kept 1.1 of this machine's 2 cores busy"),  # a busy machine
    (1.6, 0.3, "False"),   # slow with the cores free: no excuse offered
    (0.8, 1.1, "False"),   # faster than the link allows: the link reading is wrong, not the load
])
def test_wire_check_holds_times_to_their_bytes_and_names_a_busy_machine(lesson_modules, factor, others, said):
    (lesson02,) = lesson_modules(LESSON02, "lesson02")
    size, link = 2**20, 50e6
    records = [{"rank": 0, "algorithm": name, "nbytes": size, "cores": 2, "others_cores": others,
                "seconds": (factor if name == "ring" else 1.0) * load * size / link}
               for name, load in (("ring", 1.5), ("naive ring", 3), ("reduce+broadcast", 6))]
    records.append({"rank": 0, "algorithm": "ring", "nbytes": size // 4, "seconds": 9.0,
                    "cores": 2, "others_cores": 0.0})  # a smaller size: not checked
    line = lesson02.wire_check(records, link_Bps=link, world_size=4)
    assert line.startswith("every algorithm takes 0.9x to 1.5x the time its bytes need on the link: ")
    assert line.split("link: ", 1)[1].startswith(said), line
    if said == "False":
        assert "other programs" not in line


@pytest.mark.parametrize(
    ("threads_sleeps", "processes_sleeps", "verdict"),
    [(116.0, 0.01, "True"),   # quiet: the threads hand the GIL over ~100 times a pass
     (0.56, 0.01, "True"),    # one busy process beside them: fewer, longer sleeps
     (0.20, 0.00, "False"),   # under one sleep every 4 passes: no GIL to speak of
     (2.0, 0.5, "False")],    # the processes sleep too: something else puts them to sleep
)
def test_gil_check_compares_how_often_replicas_sleep(lesson_modules, threads_sleeps, processes_sleeps, verdict):
    (lesson01,) = lesson_modules(LESSON01, "lesson01")
    threads = {"MANY_SMALL_OPS": {"alone_s": 0.005, "together_s": 0.008, "on_core": 0.6,
                                  "sleeps_per_pass": threads_sleeps}}
    records = [{"part": "processes at once", "rank": 0, "model": "MANY_SMALL_OPS", "alone_s": 0.005,
                "together_s": 0.007, "on_core": 0.6, "sleeps_per_pass": processes_sleeps}]
    assert lesson01.gil_check(threads, records).endswith(f": {verdict}")


@pytest.mark.parametrize(("ddp_s", "said", "near_one"), [
    (0.012, "True", "True"),                                         # 0.67x against 0.40x
    (0.025, "False (DDP 0.32x, DataParallel 0.40x)", "True"),          # the numbers when it fails
    (0.005, "True", "False"),                                        # 1.6x: near twice
])
def test_ddp_beats_dp_compares_each_with_its_own_baseline(lesson_modules, ddp_s, said, near_one):
    (lesson01,) = lesson_modules(LESSON01, "lesson01")
    single, dp = {"step_s": 0.008}, {"step_s": 0.020}
    ddp_step = {"step_s": ddp_s, "one_process_step_s": 0.008}
    assert lesson01.ddp_beats_dp(single, dp, ddp_step) == (
        f"DDP faster than DataParallel's threads on MANY_SMALL_OPS, each against one process: {said}\n"
        f"neither comes near twice one process's speed (both below 1.5x): {near_one}")
