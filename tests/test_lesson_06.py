"""Lesson 06: the hand-written synchronised BatchNorm against BatchNorm on the whole
batch (real torchrun runs at 2 and 4 ranks), and the in-process helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from labutils import launch

LESSON = Path(__file__).resolve().parent.parent / "lessons" / "06_production_patterns"


@pytest.fixture
def lesson06(monkeypatch):
    monkeypatch.syspath_prepend(str(LESSON))
    monkeypatch.delitem(sys.modules, "lesson06", raising=False)
    import lesson06

    return lesson06


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


def test_autocast_runs_matmuls_in_bfloat16_and_keeps_parameters_float32(lesson06):
    table = lesson06.autocast_dtypes()
    assert "Linear output (matmul)  bfloat16" in table
    assert "parameters              float32" in table and "gradients               float32" in table


def test_scaling_reading_states_the_core_bound(lesson06):
    runs = {n: [{"cores": 2, "strong_s": 0.1, "weak_s": 0.1}] for n in (1, 2, 4)}
    seconds = {"strong": {1: 0.1, 2: 0.05, 4: 0.05}, "weak": {1: 0.1, 2: 0.1, 4: 0.2}}
    reading = lesson06.scaling_reading(runs, seconds)
    assert reading.splitlines() == [
        "cores these runs could use: 2",
        "2 ranks: at most 100% from the cores alone; measured strong 100%, weak 100%",
        "4 ranks: at most 50% from the cores alone; measured strong 50%, weak 50%",
    ]


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
    from labutils.network import VirtualHosts

    hosts = VirtualHosts(reason="no root")
    assert lesson06.hosts_line(hosts) == "mode: loopback. no root"
    text = lesson06.bytes_crossed(hosts, {}, {}, _two_node_records())
    assert "6,291,456 bytes" in text and "nothing to count" in text


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
