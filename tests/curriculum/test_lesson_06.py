"""Lesson 06: the hand-written synchronised BatchNorm against BatchNorm on the whole
batch (real torchrun runs at 2 and 4 ranks), CPU autocast's dtypes, the scaling model
and its claims (pure, and scaling.py for real on a shaped 2-host cluster), the link
byte and interface checks, and the other in-process helpers."""

from __future__ import annotations

import pytest
from helpers import LESSONS, autocast_problem

from labutils import launch
from labutils.course import lesson

LESSON = LESSONS / "06_production_patterns"


@pytest.fixture
def lesson06():
    return lesson.load(LESSON, "lesson06")


@pytest.mark.parametrize("nproc", [2, 4])
def test_allreduce_batchnorm_equals_batchnorm_on_the_whole_batch(runs_dir, nproc):
    result = launch(LESSON / "batchnorm_ranks.py", nproc, args=["allreduce"], display="none",
                    hang_timeout=90, timeout=300)
    assert result.ok, result.summary()
    assert sorted(r["rank"] for r in result.records) == list(range(nproc))
    for rec in result.records:
        for key in ("bn_output_vs_reference", "running_stats_vs_reference", "grads_vs_reference"):
            assert float(rec[key]) < 1e-5, (key, rec)
    assert len({rec["running_stats_sha"] for rec in result.records}) == 1


def test_plain_batchnorm_differs_from_the_whole_batch_and_across_ranks(runs_dir):
    result = launch(LESSON / "batchnorm_ranks.py", 2, args=["local"], display="none",
                    hang_timeout=90, timeout=300)
    assert result.ok, result.summary()
    assert all(float(rec["bn_output_vs_reference"]) > 1e-2 for rec in result.records)
    assert len({rec["running_stats_sha"] for rec in result.records}) == 2


def test_clip_before_unscale_shrinks_the_update_by_the_scale(lesson06):
    table = lesson06.clip_order(max_norm=0.25, init_scale=2.0 ** 16)
    rows = {line[:33].strip(): line[33:].split() for line in table.splitlines()[2:]}
    assert float(rows["no scaler"][1]) == pytest.approx(0.25)
    assert float(rows["unscale_, clip, step"][1]) == pytest.approx(0.25)
    assert float(rows["clip, then step (unscales inside)"][1]) == pytest.approx(0.25 / 2 ** 16, rel=1e-3)


def _autocast_outputs():
    import torch

    linear, x, ops = autocast_problem()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = linear(x)
        outputs = {name: op(hidden) for name, op in ops.items()}
    outputs["cross_entropy"].backward()
    return x, hidden, outputs, linear


def test_cpu_autocast_keeps_softmax_sum_layer_norm_in_the_input_dtype():
    """The lesson's claim about torch's CPU lists (CUDA's differ): if a torch release
    moves an op between lists, this fails and the lesson's text must change."""
    import torch

    x, hidden, outputs, linear = _autocast_outputs()
    assert (x.dtype, hidden.dtype) == (torch.float32, torch.bfloat16)
    for op in ("softmax", "log_softmax", "sum", "layer_norm"):
        assert outputs[op].dtype == torch.bfloat16, op
    for op in ("cross_entropy", "prod", "linalg.inv"):
        assert outputs[op].dtype == torch.float32, op
    assert outputs["fft.rfft"].dtype == torch.complex64
    assert linear.weight.dtype == linear.weight.grad.dtype == torch.float32


def test_dtype_table_lists_input_and_output_per_op(lesson06):
    table = lesson06.dtype_table(*_autocast_outputs()).splitlines()
    rows = {line[:29].strip(): line[29:].split() for line in table[2:]}
    assert rows["Linear (a matmul)"] == ["float32", "bfloat16"]
    assert rows["softmax"] == ["bfloat16", "bfloat16"]
    assert rows["cross_entropy"] == ["bfloat16", "float32"]
    assert rows["its gradient, after backward"] == ["float32"]


def test_autocast_dtypes_per_device_and_an_op_that_fails(lesson06):
    """The helper behind the CPU-against-CUDA table (its CUDA half: tests/test_gpu.py)."""
    linear, x, ops = autocast_problem()

    def refuses(h):
        raise RuntimeError("\"my_op\" not implemented for 'BFloat16'\nsecond line")

    got = lesson06.autocast_dtypes("cpu", linear, x, {**ops, "refuses": refuses})
    assert got["Linear (a matmul)"] == "bfloat16"
    assert (got["softmax"], got["sum"], got["cross_entropy"]) == ("bfloat16", "bfloat16", "float32")
    assert got["fft.rfft"] == "complex64"
    assert got["refuses"] == "fails (\"my_op\" not implemented for 'BFloat16')"
    assert linear.weight.device.type == "cpu" and linear.weight.grad is None  # a copy ran


# ------------------------------------------------------------------ scaling
class _Run:
    def __init__(self, records, ok=True):
        self.records, self.ok = records, ok

    def headline(self):
        return "run FAILED"


def _scaling_records(hosts, compute_ms, allreduce_ms, step_extra_ms=0.0):
    """Records as scaling.py writes them: compute and step per mode, the all-reduces."""
    recs = []
    for rank in range(hosts):
        weak_c = compute_ms[hosts] / 1e3
        strong_c = weak_c / hosts
        comm = allreduce_ms[hosts] / 1e3
        recs.append({"rank": rank, "weak_compute_s": weak_c, "strong_compute_s": strong_c,
                     "weak_step_s": weak_c + comm + step_extra_ms / 1e3,
                     "strong_step_s": strong_c + comm + step_extra_ms / 1e3,
                     "tiny_allreduce_s": 0.0002, "grad_allreduce_s": comm,
                     "grad_bytes": 4 * 2**20, "batch": 2048})
    return recs


def _model(points, link_bps=400e6):
    def ring(n, p):
        return p["alpha_s"] + 2 * (n - 1) / n * p["grad_bytes"] * 8 / link_bps

    allreduce = {n: ring(n, p) for n, p in points.items()}
    steps = {m: {n: p[f"{m}_compute_s"] + ring(n, p) for n, p in points.items()}
             for m in ("strong", "weak")}
    return allreduce, steps


def test_scaling_points_take_the_slowest_ranks_compute_and_refuse_failed_runs(lesson06):
    recs = _scaling_records(2, {2: 80.0}, {2: 84.0})
    recs[1]["weak_compute_s"] = 0.1  # the slowest rank: every rank waits for it
    points = lesson06.scaling_points({2: _Run(recs)})
    assert points[2]["weak_compute_s"] == 0.1
    assert points[2]["allreduce_s"] == pytest.approx(0.084)
    with pytest.raises(RuntimeError, match="2-host scaling run failed"):
        lesson06.scaling_points({2: _Run(recs, ok=False)})


def _claims(lesson06, step_extra_ms=0.0, allreduce_ms=None):
    wire = 4 * 2**20 * 8 / 400e6 * 1e3  # ms for 4 MiB at 400 Mbit/s
    allreduce_ms = allreduce_ms or {1: 0.0, 2: wire + 0.2, 4: 1.5 * wire + 0.2}
    compute = {1: 80.0, 2: 84.0, 4: 160.0}
    runs = {n: _Run(_scaling_records(n, compute, allreduce_ms,
                                     step_extra_ms if n > 1 else 0.0)) for n in (1, 2, 4)}
    points = lesson06.scaling_points(runs)
    allreduce, steps = _model(points)
    return points, steps, lesson06.scaling_claims(points, allreduce, steps, tolerance=0.2)


def test_scaling_claims_hold_for_a_step_of_compute_plus_ring_allreduce(lesson06):
    points, steps, claims = _claims(lesson06)
    assert claims.count(": True") == 5 and "False" not in claims
    table = lesson06.scaling_table(points, steps)
    assert "baseline" in table and "efficiency, measured" in table


def test_scaling_claims_fail_when_the_step_is_far_from_the_model(lesson06):
    _, _, claims = _claims(lesson06, step_extra_ms=100.0)  # something the model lacks
    assert "within 20% of the model's, strong and weak, 2 and 4 hosts: False" in claims


def test_scaling_claims_fail_when_the_allreduce_does_not_grow_like_the_ring(lesson06):
    wire = 4 * 2**20 * 8 / 400e6 * 1e3
    _, _, claims = _claims(lesson06, allreduce_ms={1: 0.0, 2: wire, 4: wire})  # a tree? a bug?
    lines = claims.splitlines()
    assert lines[0].endswith(": False") and lines[1].endswith(": False")


def test_finite_drops_the_predictions_a_missing_link_could_not_make(lesson06):
    import math

    model = {"strong": {1: 0.08, 2: math.nan}, "weak": {1: 0.08, 2: 0.17}}
    assert lesson06.finite(model) == {"strong": {1: 0.08}, "weak": {1: 0.08, 2: 0.17}}


def test_allreduce_table_shows_the_ring_bytes_per_host(lesson06):
    points, _, _ = _claims(lesson06)
    allreduce, _ = _model(points)
    rows = lesson06.allreduce_table(points, allreduce).splitlines()[2:]
    assert [r.split()[:2] for r in rows] == [["2", "4.00"], ["4", "6.00"]]


@pytest.mark.serial  # a step against compute + all-reduce, timed apart: a loaded moment
@pytest.mark.timeout(300)  # put one step 28% above the sum in the parallel pass (2026-11-27)
def test_scaling_script_on_a_shaped_two_host_cluster(runs_dir, lesson06):
    """scaling.py for real: on 2 hosts whose links are capped, the gradients' all-reduce
    takes what the ring model says, and a step is about compute + all-reduce."""
    from labutils.cluster import virtual_cluster

    with virtual_cluster(2, link="400mbit") as cluster:
        if cluster.mode != "namespaces":
            pytest.skip(f"virtual cluster on loopback here: {cluster.reason}")
        run = cluster.launch(LESSON / "scaling.py", 1, args=["512"], display="none",
                             hang_timeout=60, timeout=240)
        link = lesson06.link_bps(cluster)
    point = lesson06.scaling_points({2: run})[2]
    assert point["batch"] == 512 and point["grad_bytes"] == 4 * (512 * 1024 + 1024 + 1024 * 512 + 512
                                                                 + 512 * 10 + 10)
    model = point["alpha_s"] + point["grad_bytes"] * 8 / link
    assert point["allreduce_s"] == pytest.approx(model, rel=0.2)
    for mode in ("strong", "weak"):
        assert point[f"{mode}_step_s"] == pytest.approx(point[f"{mode}_compute_s"] + model, rel=0.25)


def test_scaling_script_at_one_rank_measures_one_baseline_for_both_modes(runs_dir):
    """At 1 rank strong and weak are one problem: one measurement, so both efficiencies
    divide the same T1 (measured twice, a moment of load could put strong above weak)."""
    run = launch(LESSON / "scaling.py", 1, args=["256"], display="none", timeout=120)
    assert run.ok, run.headline()
    (rec,) = run.records
    assert rec["batch"] == 256
    assert (rec["strong_step_s"], rec["strong_compute_s"]) == (rec["weak_step_s"], rec["weak_compute_s"])
    assert 0 < rec["strong_compute_s"] <= rec["strong_step_s"] * 1.5


# ------------------------------------------------------------ beyond one machine
def _two_node_records(steps=4, payload=1 << 18):
    return [{"rank": r, "group_rank": r // 2, "local_rank": r % 2, "local_world_size": 2,
             "world_size": 4, "sum": 10.0, "payload_bytes": payload * 4, "steps": steps,
             "ifname": ""} for r in (3, 1, 0, 2)]


def test_ring_share_per_direction_is_one_rank_of_2_n_minus_1_over_n(lesson06):
    records = _two_node_records()
    assert lesson06.ring_bytes_per_direction(records) == 4 * (1 << 20) * 3 // 2
    table = lesson06.rank_node_table(records).splitlines()
    assert [line.split()[0] for line in table[2:]] == ["0", "1", "2", "3"]
    assert all(" ok " in line and "DIFFERS" not in line for line in table[2:])


def test_bytes_crossed_on_loopback_says_there_is_nothing_to_count(lesson06):
    from labutils.cluster import VirtualCluster

    cluster = VirtualCluster(hosts=2, mode="loopback", reason="no root")
    text = lesson06.bytes_crossed(cluster, {}, {}, _two_node_records())
    assert "6,291,456 bytes" in text and "nothing to count" in text
    assert lesson06.bytes_claim(cluster, {}, {}, _two_node_records()) == "no link to count on loopback"


@pytest.mark.parametrize("tx, rx, ok", [(6_328_000, 6_329_000, True), (6_291_456, 6_291_456, True),
                                        (6_000_000, 6_329_000, False),  # less than the ring's share
                                        (6_600_000, 6_329_000, False),  # 5% more: not headers
                                        (12_582_912, 12_582_912, False)])  # the whole tensor twice
def test_bytes_claim_allows_the_ring_share_plus_headers_only(lesson06, tx, rx, ok):
    from labutils.cluster import VirtualCluster

    cluster = VirtualCluster(hosts=2, mode="namespaces")
    before = {"tx_bytes": 1000, "rx_bytes": 2000}
    after = {"tx_bytes": 1000 + tx, "rx_bytes": 2000 + rx}
    assert lesson06.bytes_claim(cluster, before, after, _two_node_records()).endswith(f": {ok}")


def test_interfaces_used_checks_each_node_against_its_own_link(lesson06):
    from labutils.cluster import VirtualCluster

    cluster = VirtualCluster(hosts=2, mode="namespaces", interfaces=["luaah0", "luaah1"])
    records = [dict(r, ifname=f"luaah{r['group_rank']}") for r in _two_node_records()]
    assert lesson06.interfaces_used(records, cluster).splitlines() == [
        "node 0: GLOO_SOCKET_IFNAME names host 0's own link: True",
        "node 1: GLOO_SOCKET_IFNAME names host 1's own link: True"]
    next(r for r in records if r["group_rank"] == 0)["ifname"] = "lo"
    assert "host 0's own link: False" in lesson06.interfaces_used(records, cluster)


def test_refused_loopback_reads_the_ranks_errors(lesson06):
    class Rank:
        def __init__(self, rank, stderr):
            self.rank, self.stderr = rank, stderr

    class Run:
        records = []
        ranks = [Rank(0, ""), Rank(2, "RuntimeError: Gloo connectFullMesh failed with "
                                      "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                                      "pair.cc:152] timed out connecting: SO_ERROR: Connection "
                                      "refused, remote=[127.0.0.1]:123")]

    assert lesson06.refused_loopback(Run()).splitlines() == [
        "the job got past init_process_group: False",
        "a rank was refused connecting to 127.0.0.1, its own machine: True"]
    assert lesson06.first_error(Run()).startswith(
        "rank 2: RuntimeError: Gloo connectFullMesh failed with [.../third_party/gloo/")


def test_node_commands_parse_with_the_cli_and_differ_only_in_node_rank(lesson06):
    import shlex

    from labutils.cli import build_parser

    text = lesson06.node_commands("train.py", nnodes=2, nproc=4, endpoint="node0:29500",
                                  rdzv_id="job-1", log_dir="/shared/runs", ifname="eth0")
    commands = [shlex.split(line) for line in text.splitlines() if line.startswith("labutils")]
    assert len(commands) == 2
    parsed = [build_parser().parse_args(words[1:]) for words in commands]
    assert [ns.node_rank for ns in parsed] == [0, 1]
    for ns in parsed:
        assert (ns.nproc, ns.nnodes, ns.rdzv_endpoint, ns.rdzv_id, ns.log_dir, ns.script) == \
            (4, "2", "node0:29500", "job-1", "/shared/runs", "train.py")
    assert [w for w in commands[0] if w not in commands[1]] == ["0"]
    assert text.count("GLOO_SOCKET_IFNAME=eth0") == 2


def test_compose_node_services_differ_only_in_node_rank(lesson06):
    text = lesson06.compose_node_services()
    assert "hostname: node0" in text and "hostname: node1" in text
    assert text.splitlines()[-1] == "node0 and node1 commands differ only in: word 7: '0' / '1'"


def test_show_function_prints_a_scripts_function_or_says_it_is_missing(lesson06, capsys):
    lesson06.show_function("scaling.py", "measure")
    shown = capsys.readouterr().out
    assert shown.startswith("def measure(") and "ddp.no_sync()" in shown
    with pytest.raises(LookupError, match="no function nothing in scaling.py"):
        lesson06.show_function("scaling.py", "nothing")


def _trace(folder, steps: list[tuple[float, float, float]]) -> None:
    """A profile of DDP steps, each (backward's end, its last autograd op's end, the
    first all_reduce's start) in microseconds from the step's start at 100k * i."""
    events = []
    for i, (end, last_op, first) in enumerate(steps):
        t = 100_000 * i
        events += [{"ph": "X", "name": "backward", "ts": t, "dur": end},
                   {"ph": "X", "name": "autograd::engine::evaluate_function: AddmmBackward0",
                    "ts": t + 10, "dur": last_op - 10},
                   {"ph": "X", "name": "gloo:all_reduce", "ts": t + first, "dur": 5_000},
                   {"ph": "X", "name": "gloo:all_reduce", "ts": t + end - 100, "dur": 50}]
    folder.mkdir(parents=True)
    (folder / "ddp_step_rank0.json").write_text(__import__("json").dumps({"traceEvents": events}))


def test_overlap_is_read_against_the_last_gradient_not_the_backward_span(lesson06, tmp_path,
                                                                       monkeypatch):
    """Every all-reduce starts inside the profiler's backward span (DDP's wait is in it);
    a step overlaps only when one starts before backward computed its last gradient."""
    monkeypatch.setattr(lesson06, "FILES", tmp_path)
    _trace(tmp_path / "t", [(30_000, 20_000, 8_000), (30_000, 20_000, 25_000),
                            (30_000, 20_000, 21_000)])
    assert lesson06.trace_overlap("t").splitlines() == [
        "gloo:all_reduce events per profiled step: 2",
        "the first all_reduce started before backward computed its last gradient, in most "
        "profiled steps: False"]  # 1 of 3
    # one late start among three steps (its gloo thread waited for a core) still says True
    _trace(tmp_path / "u", [(30_000, 20_000, 8_000), (30_000, 20_000, 21_000),
                            (30_000, 20_000, 12_000)])
    assert lesson06.trace_overlap("u").endswith("in most profiled steps: True")
